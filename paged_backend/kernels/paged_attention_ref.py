"""Reference paged attention over the block table (the CPU path of the engine).

One call serves every step the scheduler makes: decode (q_len 1), prefill, chunked
prefill and prefix-cache hits. Request i's new queries are rows
``query_start_loc[i]:query_start_loc[i+1]`` and sit at positions
``ctx_i .. seq_lens[i]-1`` with ``ctx_i = seq_lens[i] - q_len_i``; query j attends to
cached positions ``0 .. ctx_i + j`` (causal), optionally only the last ``sliding_window``.

Math in float32; fp8 caches are dequantized with ``k_scale`` / ``v_scale``. Decode rows
are done in one padded batch; requests with several new tokens one at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache [NB, BS, Hkv, D], slots int64 [..., L] -> [..., L, Hkv, D] float32 (dequantized)."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    x = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, cache.shape[2], cache.shape[3]).float()
    if scale is not None:
        x = x * scale.float()
    return x


def _slots(block_row: torch.Tensor, positions: torch.Tensor, bs: int) -> torch.Tensor:
    """Cache slot of each position: block_row[pos // bs] * bs + pos % bs (int64)."""
    return block_row.long().gather(-1, positions // bs) * bs + positions % bs


def _attend(
    q: torch.Tensor,  # [B, Q, H, D] float32
    k: torch.Tensor,  # [B, L, Hkv, D] float32
    v: torch.Tensor,  # [B, L, Hkv, D] float32
    mask: torch.Tensor | None,  # [B, Q, L] bool, True = attend; None = plain causal (Q == L)
    scale: float,
    decode: bool = False,
) -> torch.Tensor:  # [B, Q, H, D] float32
    """Exact softmax attention through torch's SDPA (GQA without copying K/V).

    ``decode``: one query per row attending to all of its L keys (mask only pads rows)."""
    b, nq, h, d = q.shape
    hkv = k.shape[2]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
    if decode:
        # the G query heads of a KV head are rows of one [G, D] query
        qg = q.view(b, hkv, h // hkv, d)
        o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=None if mask is None else mask[:, None],
                                           scale=scale)
        return o.reshape(b, 1, h, d)
    qt = q.transpose(1, 2)
    gqa = {"enable_gqa": True} if hkv != h else {}
    if mask is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, **gqa)
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None], scale=scale, **gqa)
    return o.transpose(1, 2)


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D], dtype of query
    t, h, d = query.shape
    out = torch.zeros((t, h, d), dtype=torch.float32, device=query.device)
    if t == 0:
        return out.to(query.dtype)
    bs = kv_cache.shape[2]
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    ks = k_scale if fp8 else None
    vs = v_scale if fp8 else None
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    qlens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]

    decode = [i for i, ql in enumerate(qlens) if ql == 1]
    if decode:
        idx = torch.tensor(decode, device=query.device)
        max_len = max(lens[i] for i in decode)
        sl = seq_lens[idx].long()
        pos = torch.arange(max_len, device=query.device)
        mask = pos[None, :] < sl[:, None]
        # padding positions read the row's last written slot (finite, then masked out), never
        # slots past its length, which may hold stale data or NaN (0 * NaN would be NaN)
        slots = _slots(block_tables[idx], torch.minimum(pos[None, :], sl[:, None] - 1), bs)
        k = _gather(kv_cache[0], slots, ks)
        v = _gather(kv_cache[1], slots, vs)
        if sliding_window is not None:
            mask &= pos[None, :] > (sl[:, None] - 1 - sliding_window)
        rows = torch.tensor([qsl[i] for i in decode], device=query.device)
        q = query[rows].float().unsqueeze(1)
        equal = sliding_window is None and all(lens[i] == max_len for i in decode)
        # rows of one length need no mask: SDPA can then take its fused kernel
        out[rows] = _attend(q, k, v, None if equal else mask[:, None, :], scale, decode=True)[:, 0]

    for i, ql in enumerate(qlens):
        if ql > 1:
            out[qsl[i] : qsl[i + 1]] = attend_request(query[qsl[i] : qsl[i + 1]], kv_cache, block_tables[i],
                                                      lens[i], scale, ks, vs, sliding_window)
    return out.to(query.dtype)


def attend_request(
    query: torch.Tensor,  # [Q, H, D]: the request's new tokens, at positions length-Q .. length-1
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_row: torch.Tensor,  # int32 [max_blocks]: the request's block table row
    length: int,  # context + new tokens
    scale: float,
    k_scale: torch.Tensor | None = None,  # applied when given (pass None for a non-fp8 cache)
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [Q, H, D] float32
    """Causal attention of one request's new tokens over its cached positions 0..length-1."""
    ql = query.shape[0]
    ctx = length - ql
    bs = kv_cache.shape[2]
    slots = _slots(block_row, torch.arange(length, device=query.device), bs)
    k = _gather(kv_cache[0], slots, k_scale)[None]
    v = _gather(kv_cache[1], slots, v_scale)[None]
    q = query.float()[None]
    mask = None
    if ctx > 0 or sliding_window is not None:
        qpos = torch.arange(ql, device=query.device)[:, None] + ctx
        kpos = torch.arange(length, device=query.device)[None, :]
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        mask = mask[None]
    return _attend(q, k, v, mask, scale)[0]
