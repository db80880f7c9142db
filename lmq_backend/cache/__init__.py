"""The prefix cache and the K/V store it keeps its pages in.

    prefix_cache.py  `PrefixCache`: match / insert / lock / unlock / evict, and a request's `Pin` on it
    trie.py          `PrefixTrie`: the radix trie of token ids whose nodes own K/V slots
    kv_store.py      `KVStore`: every token's K/V, one slot a token, and who holds each slot
    stats.py         the cache's statistics as `backend.stats()` reports them
"""
