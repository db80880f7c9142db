"""Text and tokens, the engine's bottom layer: a tokenizer's vocabulary index (token bytes, special tokens,
memoized lookups; kept on disk per tokenizer), and exact tokenization with prefix reuse."""
