"""What the calibration (calibration.py) times for each op: lmq's kernel and torch's counterpart (what
lmq's engine runs when the kernel declines) on the same representative operands.

Each function takes `lmq`, the op's public function with the calibration bypassed (`lmq_kernels.cpu` passes it), and
the class's representative sizes, and returns (run_lmq, run_torch), each running its side once. Weights and
K/V come from a ring of copies larger than the last-level cache (RING_BYTES): in a decode step every layer
reads its own weights and K/V cold from memory, and an operand that stays in cache would favour the kernel
that is faster on cached data. Consecutive calls (of either side) take consecutive copies.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .layout import padded_stride


def _llc_bytes() -> int:
    """The largest CPU cache's size (/sys), 32 MiB when unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best or 32 << 20


RING_BYTES = min(max(2 * _llc_bytes(), 32 << 20), 256 << 20)


_BUFFERS: dict[int, torch.Tensor] = {}   # slot -> flat float32 memory the rings of that slot share


def _ring(shape: tuple[int, ...], slot: int = 0) -> torch.Tensor:
    """[copies, *shape] float32 of 0.01 (written, so no page is shared), copies x shape >= RING_BYTES. The
    rings of one `slot` share their memory, kept for the process (benches only read their rings, and a bench
    is done before the next one is made): its pages are touched once, not for every class measured."""
    one = 4 * int(torch.tensor(shape).prod())
    copies = max(1, -(-RING_BYTES // max(one, 1)))
    n = copies * one // 4
    flat = _BUFFERS.get(slot)
    if flat is None or flat.numel() < n:
        flat = _BUFFERS[slot] = torch.full((n,), 0.01)
    return flat[:n].view(copies, *shape)


class _Next:
    """Consecutive indices into a ring, shared by both sides."""

    def __init__(self, n: int):
        self.n, self.i = n, 0

    def __call__(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


def gemm(lmq, m: int, k: int, n: int, panel: int = 0):
    """out = x @ w_t, x [m, k], w_t [k, n] K-major with the engine's row stride: lmq(x, w_t, out) vs torch.mm;
    with `panel`, lmq reads panel-major copies [n / panel, k, panel] (`panels=`) and torch the K-major w_t."""
    ring = _ring((k, padded_stride(n, 4)))[..., :n]      # the engine's layout (see layout.py)
    x, out = torch.randn(m, k), torch.empty(m, n)
    nxt = _Next(ring.shape[0])
    if panel:
        panels = _ring((n // panel, k, panel), slot=1)[:ring.shape[0]]   # as many copies: one index for both sides
        return (lambda: lmq(x, ring[0], out, panels=panels[nxt()]),
                lambda: torch.mm(x, ring[nxt()], out=out))
    return (lambda: lmq(x, ring[nxt()], out), lambda: torch.mm(x, ring[nxt()], out=out))


def rmsnorm(lmq, m: int, n: int):
    """The step's RMSNorm of m rows of n (the engine's torch form: engine/fused/ops.py, _rmsnorm_torch)."""
    x, w, out = torch.randn(m, n), torch.randn(n), torch.empty(m, n)

    def torch_side():
        out.copy_(w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)))

    return (lambda: lmq(x, w, 1e-5, out), torch_side)


def silu_mul(lmq, m: int, i: int):
    """out = silu(gate) * up of m rows, gu = [gate | up] (the engine's torch form)."""
    gu, out = torch.randn(m, 2 * i), torch.empty(m, i)
    return (lambda: lmq(gu, out), lambda: out.copy_(F.silu(gu[:, :i]) * gu[:, i:]))


def attention(lmq, b: int, hq: int, hkv: int, d: int, s: int):
    """One query a row over s columns of a paged K/V store read through page tables (rows from different
    first columns): lmq(q, k, v, table, start, out, scale) vs the engine's torch form (gather the rows'
    slots, then grouped SDPA with the rows' masks)."""
    store = _ring((2, b * s + 1, hkv, d))         # a ring of stores: [copies, K|V, slots, Hkv, D]
    q, out = torch.randn(b, hq, d), torch.empty(b, hq, d)
    table = (torch.randperm(b * s, dtype=torch.int32) + 1).view(b, s).contiguous()  # scattered pages
    start = torch.randint(0, max(1, s // 4), (b,), dtype=torch.int32)
    start[0] = 0
    allowed = (torch.arange(s)[None] >= start[:, None])[:, None, None]                   # [b, 1, 1, s]
    cols = table.view(-1)
    nxt = _Next(store.shape[0])
    scale = d ** -0.5

    def lmq_side():
        kv = store[nxt()]
        lmq(q, kv[0], kv[1], table, start, out, scale)

    def torch_side():
        kv = store[nxt()]
        k = kv[0].index_select(0, cols).view(b, s, hkv, d).transpose(1, 2)               # [b, hkv, s, d]
        v = kv[1].index_select(0, cols).view(b, s, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k, v, attn_mask=allowed, scale=scale)
        out.copy_(o.reshape(b, hq, d))

    return lmq_side, torch_side


def prefill_attention(lmq, b: int, t: int, hq: int, hkv: int, d: int, s: int):
    """t new tokens a row after s - t columns every row shares (the engine's common prefill: few-shot calls,
    chats, after a trie hit): lmq(q, k, v, table, start, new, end, out, scale) vs the engine's torch form
    (gather the rows' columns, then torch's fused attention with the causal mask aligned to the last column)."""
    t = min(t, s)
    prefix = s - t
    store = _ring((2, prefix + b * t + 1, hkv, d))
    shared = torch.arange(1, prefix + 1, dtype=torch.int32).expand(b, prefix)
    own = (torch.arange(b * t, dtype=torch.int32) + prefix + 1).view(b, t)
    table = torch.cat([shared, own], 1).contiguous()
    start, new = torch.zeros(b, dtype=torch.int32), torch.full((b,), t, dtype=torch.int32)
    q = torch.randn(b, t, hq, d)
    out = torch.empty_like(q)
    cols = table.view(-1)
    allowed = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]                # [t, s]
    nxt = _Next(store.shape[0])
    scale = d ** -0.5

    def lmq_side():
        kv = store[nxt()]
        lmq(q, kv[0], kv[1], table, start, new, s, out, scale)

    def torch_side():
        kv = store[nxt()]
        k = kv[0].index_select(0, cols).view(b, s, hkv, d).transpose(1, 2)               # [b, hkv, s, d]
        v = kv[1].index_select(0, cols).view(b, s, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=allowed, scale=scale,
                                           enable_gqa=hq != hkv)
        out.copy_(o.transpose(1, 2))

    return lmq_side, torch_side


def rope_append(lmq, n: int, hq: int, hkv: int, d: int, norms: bool):
    """RoPE of n one-token rows' q and k (with q/k RMSNorms when `norms`) and the K/V append through the
    page tables: lmq(...) vs the engine's torch form (norms, rotate-half by roll, scatter into the store)."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    cos, sin = torch.rand(n, d // 2, generator=g), torch.rand(n, d // 2, generator=g)
    positions = torch.arange(n, dtype=torch.int32)
    qn, kn = (torch.ones(d), torch.ones(d)) if norms else (None, None)
    q = torch.empty(n, hq, d)
    slots = 4 * n + 1
    kc, vc = torch.zeros(slots, hkv, d), torch.zeros(slots, hkv, d)
    table = torch.arange(1, slots, dtype=torch.int32).view(n, 4).contiguous()
    dest = table[:, 3].long()

    def torch_side():
        qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
        if norms:
            qk = torch.cat([qk[:, :hq] * torch.rsqrt(qk[:, :hq].pow(2).mean(-1, keepdim=True) + 1e-6) * qn,
                            qk[:, hq:] * torch.rsqrt(qk[:, hq:].pow(2).mean(-1, keepdim=True) + 1e-6) * kn], 1)
        c = torch.cat((cos, cos), dim=-1)[:, None]
        s = torch.cat((-sin, sin), dim=-1)[:, None]
        roped = qk * c + torch.roll(qk, d // 2, dims=-1) * s
        q.copy_(roped[:, :hq])
        kc[dest] = roped[:, hq:]
        vc[dest] = qkv[:, (hq + hkv) * d:].view(n, hkv, d)

    return (lambda: lmq(qkv, cos, sin, positions, qn, kn, 1e-6, q, kc, vc, table, 1, 3, n), torch_side)


def qgemm(lmq, dequantize, m: int, k: int, n: int, int4: bool):
    """out = x @ W^T for a weight-only quantized W [n, k] (qgemm.c's layouts, groups of 32 along k):
    lmq(x, q, scale, zero, out) vs what the engine runs otherwise, W de-quantized to float32 (`dequantize`,
    torch's passes where it declines) and torch.mm."""
    copies = max(1, -(-RING_BYTES // max(n * k // (2 if int4 else 1), 1)))
    g = torch.Generator().manual_seed(0)
    if int4:
        q = torch.randint(0, 256, (copies, n, k // 2), dtype=torch.uint8, generator=g)
        zero = torch.rand(copies, n, k // 32, generator=g) - 0.5
    else:
        q = torch.randint(-127, 128, (copies, n, k), dtype=torch.int8, generator=g)
        zero = None
    scale = torch.rand(copies, n, k // 32, generator=g) * 0.01
    x, out, w = torch.randn(m, k), torch.empty(m, n), torch.empty(n, k)
    nxt = _Next(copies)
    z = (lambda i: zero[i]) if int4 else (lambda i: None)

    def torch_side():
        i = nxt()
        if not dequantize(q[i], scale[i], z(i), w):
            groups = w.view(n, k // 32, 32)
            if int4:
                b = q[i].view(n, k // 32, 16)
                groups.copy_(torch.cat([b & 15, b >> 4], -1).float() * scale[i][..., None] + zero[i][..., None])
            else:
                groups.copy_(q[i].view(n, k // 32, 32).float() * scale[i][..., None])
        torch.mm(x, w.t(), out=out)

    def lmq_side():
        i = nxt()
        lmq(x, q[i], scale[i], z(i), out)

    return lmq_side, torch_side


def masked_argmax(lmq, r: int, v: int, masked: bool):
    """The greedy picks of a step's r rows of v logits, each under its own mask (or none): lmq(logits, masks,
    out) vs the engine's torch form (`engine/picks.py`: the masks stacked, where, then argmax)."""
    logits, out = torch.randn(r, v), torch.empty(r, dtype=torch.long)
    if not masked:
        return (lambda: lmq(logits, None, out), lambda: torch.argmax(logits, -1, out=out))
    masks = list(torch.rand(r, v) < 0.5)
    return (lambda: lmq(logits, masks, out),
            lambda: torch.argmax(torch.where(torch.stack(masks), logits, float("-inf")), -1, out=out))
