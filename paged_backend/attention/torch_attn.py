"""The pure-torch attention backend: the CPU path of the engine.

Same math as ``paged_attention_ref`` (which stays the simple reference the kernel tests use),
arranged for speed on the CPU, where decode attention dominates a step:

- decode rows (one new token) of a step are attended in one batch that gathers whole cache
  blocks (``index_select`` of ``[num_blocks, block_size * Hkv * D]`` rows: 16x fewer, 16x
  larger copies than gathering token slots) into buffers allocated once per step;
- what the gather needs (block ids, masks, the stale slots to clear) is computed once per
  step and kept in ``meta.step_cache``, shared by every layer;
- slots at or past a row's length inside its gathered blocks (the rest of its last block,
  null blocks that pad shorter rows) are zeroed before attending and masked out: stale or
  poisoned data there can never reach the output (masked NaN would still give NaN);
- requests with several new tokens (prefill, chunks, prefix hits) use the reference's
  per-request attention;
- decode rows that continue the previous step's decode rows (same blocks, one token longer) are
  not gathered again: each layer keeps a float32 copy of its decode rows' K/V in the layout SDPA
  reads best, ``[B, Hkv, L, D]`` (transformers' cache layout), appends the step's new K/V to it
  and attends over it (``_Mirror``). Rows are matched by (length, block ids), so a row whose
  blocks changed (copy-on-write, beam forks, preemption, a new request) is gathered afresh; the
  copy holds exactly what the cache holds, the paged cache stays the only thing written.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from paged_backend.attention.backend import AttentionMetadata
from paged_backend.kernels.cache_write_ref import FP8_DTYPE, write_kv_cache_ref
from paged_backend.kernels.mla_attention_ref import mla_forward_ref
from paged_backend.kernels.paged_attention_ref import attend_request


@dataclass
class _StepPlan:
    """Everything about a step's attention that does not depend on the layer."""

    # decode rows, batched: B rows of up to L positions in nblk blocks each
    decode_rows: torch.Tensor | None  # int64 [B] query rows; None = rows 0..B-1 (all rows decode)
    num_decode: int
    max_len: int  # L
    num_blocks: int  # nblk = ceil(L / block_size)
    blocks: torch.Tensor | None  # int64 [B * nblk] block ids to gather, row by row
    stale: torch.Tensor | None  # int64: flat slots of the gathered [B * nblk * block_size] at/past a row's length
    mask: torch.Tensor | None  # float32 [B, 1, 1, L]: 0 = attend, -inf = not; None = attend to all L
    # (request index, first row, end row) of requests with several new tokens
    multi: list[tuple[int, int, int]] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    decode_ids: list[int] = field(default_factory=list)  # the decode rows' request indices
    buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def gather_buffers(self, dtype: torch.dtype, row_numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather targets, allocated once per step (fresh pages cost as much as the copy)."""
        key = (dtype, row_numel, device)
        bufs = self.buffers.get(key)
        if bufs is None:
            n = self.num_decode * self.num_blocks
            bufs = (torch.empty((n, row_numel), dtype=dtype, device=device),
                    torch.empty((n, row_numel), dtype=dtype, device=device))
            self.buffers[key] = bufs
        return bufs


def _build_plan(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> _StepPlan:
    """Host lists when the runner gave them (one ``tolist`` per step otherwise), then the gather plan."""
    lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    if meta.query_lens_cpu is not None:
        qlens = meta.query_lens_cpu
    else:
        qsl_t = meta.query_start_loc.tolist()
        qlens = [qsl_t[i + 1] - qsl_t[i] for i in range(len(lens))]
    starts = [0] * len(qlens)
    acc = 0
    for i, ql in enumerate(qlens):
        starts[i] = acc
        acc += ql
    decode = [i for i, ql in enumerate(qlens) if ql == 1]
    multi = [(i, starts[i], starts[i] + ql) for i, ql in enumerate(qlens) if ql > 1]
    plan = _StepPlan(None, len(decode), 0, 0, None, None, None, multi, lens, decode)
    if not decode:
        return plan
    bs = meta.block_size
    b = len(decode)
    dl = [lens[i] for i in decode]
    length = max(dl)
    nblk = -(-length // bs)
    plan.max_len, plan.num_blocks = length, nblk
    table = meta.block_tables
    if b == len(qlens) and b == num_tokens:
        rows = None  # the usual all-decode step: row i is request i
    else:
        table = table[torch.tensor(decode, device=table.device)]
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device)
    plan.decode_rows = rows
    plan.blocks = table[:, :nblk].to(device=device, dtype=torch.long).clamp_min(0).reshape(-1)
    window = meta.sliding_window
    if any(n != length for n in dl) or window is not None:
        sl = torch.tensor(dl, dtype=torch.long, device=device)[:, None]
        pos = torch.arange(length, device=device)[None, :]
        keep = pos < sl
        if window is not None:
            keep &= pos > sl - 1 - window
        plan.mask = torch.zeros((b, length), device=device).masked_fill_(~keep, float("-inf"))[:, None, None]
        past = pos >= sl
        if bool(past.any()):
            flat = torch.arange(b, device=device)[:, None] * (nblk * bs) + pos
            plan.stale = flat[past]
    return plan


def _step_plan(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> _StepPlan:
    key = ("torch_attn.plan", meta.sliding_window, num_tokens, device)
    plan = meta.step_cache.get(key)
    if plan is None:
        plan = meta.step_cache[key] = _build_plan(meta, num_tokens, device)
    return plan


def _attend_decode(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    plan: _StepPlan,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:  # [B, H, D] float32
    """One SDPA over all decode rows; the G query heads of a KV head form one [G, D] query."""
    _, nb, bs, hkv, d = kv_cache.shape
    h = query.shape[1]
    b, nblk, length = plan.num_decode, plan.num_blocks, plan.max_len
    fp8 = kv_cache.dtype == FP8_DTYPE
    src = kv_cache.view(torch.uint8) if fp8 else kv_cache  # index_select has no fp8 kernel
    flat = src.view(2, nb, bs * hkv * d)
    kbuf, vbuf = plan.gather_buffers(src.dtype, bs * hkv * d, src.device)
    torch.index_select(flat[0], 0, plan.blocks, out=kbuf)
    torch.index_select(flat[1], 0, plan.blocks, out=vbuf)
    if plan.stale is not None:  # zero bytes are 0.0 in every float format, e4m3 included
        kbuf.view(-1, hkv * d).index_fill_(0, plan.stale, 0)
        vbuf.view(-1, hkv * d).index_fill_(0, plan.stale, 0)
    k, v = kbuf, vbuf
    if fp8:
        k = k.view(FP8_DTYPE).float() * k_scale.float()
        v = v.view(FP8_DTYPE).float() * v_scale.float()
    else:
        k, v = k.float(), v.float()
    k = k.view(b, nblk * bs, hkv, d)[:, :length].transpose(1, 2)  # [B, Hkv, L, D], strided
    v = v.view(b, nblk * bs, hkv, d)[:, :length].transpose(1, 2)
    q = query if plan.decode_rows is None else query[plan.decode_rows]
    q = q.float().reshape(b, hkv, h // hkv, d)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
    return o.reshape(b, h, d)


# the decode-row copy may use up to this fraction of the memory of the layer's paged cache
_MIRROR_MAX_CACHE_FRACTION = 0.5
_MIRROR_ROUND = 64  # capacity in positions: a multiple of this (and of every block size), 32+ past the step's longest row


@dataclass
class _MirrorPlan:
    """A step's decode rows against the previous step's: which row of the copy each one continues."""

    gen: int  # the copy's generation after this step
    prev_gen: int  # the generation a layer's copy must have to be continued
    lens: torch.Tensor  # int64 [B] row lengths (new token included)
    equal_len: int | None  # the common length when all rows have one
    src: torch.Tensor | None  # int64 [n_cont]: row of the previous copy each continuing row comes from
    cont: torch.Tensor | None  # int64 [n_cont]: those rows here; None with src None = all rows, same order
    fresh: list[int]  # rows to gather from the paged cache
    fresh_blocks: torch.Tensor | None  # int64 [len(fresh) * fresh_nblk] their blocks, row by row
    fresh_nblk: int
    fresh_stale: torch.Tensor | None  # int64 flat positions of the gathered [n_fresh * fresh_nblk * bs] at/past a row's length
    keys: dict[tuple[int, ...], int]  # (length, *block ids) -> row, for the next step to match against


@dataclass
class _Mirror:
    """One layer's float32 copy of its decode rows' K/V: [B, Hkv, cap, D]; zero past each row's length."""

    cache: weakref.ref  # the paged cache it copies
    gen: int
    k: torch.Tensor
    v: torch.Tensor


def _row_keys(lens: list[int], table: list[list[int]], bs: int, shift: int) -> list[tuple[int, ...]]:
    """(length - shift, block ids covering it) per row."""
    out = []
    for n, row in zip(lens, table, strict=True):
        m = n - shift
        out.append((m, *row[: -(-m // bs)]))
    return out


class TorchAttentionBackend:
    name = "torch"

    def forward_mla(self, query: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, v_dim: int, kv_scale: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention through its torch reference (``AttentionBackend.forward_mla``)."""
        return mla_forward_ref(query, latent, kv_cache, meta, scale, v_dim, kv_scale)

    def __init__(self) -> None:
        self._gen = 0  # generation of the decode-row copies (one per step that has decode rows)
        self._keys: dict[tuple[int, ...], int] = {}  # the last step's decode rows, by (length, block ids)
        self._mirrors: dict[int, _Mirror] = {}  # id(paged cache) -> its layer's copy

    def _mirror_plan(self, meta: AttentionMetadata, plan: _StepPlan, device: torch.device) -> _MirrorPlan:
        """Built by the first layer of a step (``meta.step_cache``); advances the generation."""
        key = ("torch_attn.mirror", plan.num_decode, device)
        mp = meta.step_cache.get(key)
        if mp is not None:
            return mp
        bs = meta.block_size
        decode = plan.decode_ids
        dl = [plan.lens[i] for i in decode]
        nblk = plan.num_blocks
        table = meta.block_tables
        rows_t = table if plan.decode_rows is None else table[torch.tensor(decode, device=table.device)]
        host = rows_t[:, :nblk].tolist()
        prev = _row_keys(dl, host, bs, 1)  # what each row was after the previous step
        src_l, cont_l, fresh = [], [], []
        for r, k in enumerate(prev):
            j = self._keys.get(k) if k[0] > 0 else None
            if j is None:
                fresh.append(r)
            else:
                src_l.append(j)
                cont_l.append(r)
        self._gen += 1
        same = not fresh and src_l == list(range(len(src_l))) and len(src_l) == len(self._keys)
        lens = torch.tensor(dl, dtype=torch.long, device=device)
        mp = _MirrorPlan(
            gen=self._gen, prev_gen=self._gen - 1, lens=lens,
            equal_len=dl[0] if all(n == dl[0] for n in dl) else None,
            src=None if same else torch.tensor(src_l, dtype=torch.long, device=device),
            cont=None if same else torch.tensor(cont_l, dtype=torch.long, device=device),
            fresh=fresh, fresh_blocks=None, fresh_nblk=0, fresh_stale=None,
            keys={k: r for r, k in enumerate(_row_keys(dl, host, bs, 0))},
        )
        if fresh:
            fl = [dl[r] for r in fresh]
            fn = -(-max(fl) // bs)
            fb = torch.tensor([host[r][:fn] + [0] * (fn - len(host[r][:fn])) for r in fresh], dtype=torch.long)
            mp.fresh_blocks, mp.fresh_nblk = fb.clamp_min(0).reshape(-1).to(device), fn
            pos = torch.arange(fn * bs, device=device)[None, :]
            past = pos >= torch.tensor(fl, device=device)[:, None]
            if bool(past.any()):
                mp.fresh_stale = (torch.arange(len(fresh), device=device)[:, None] * (fn * bs) + pos)[past]
        self._keys = mp.keys
        meta.step_cache[key] = mp
        return mp

    def _mirror(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: _StepPlan, mp: _MirrorPlan
    ) -> _Mirror | None:
        """This layer's copy brought to this step (continued rows moved, new rows gathered, the new
        token appended); None when it would exceed its memory share (the caller gathers instead)."""
        _, nb, bs, hkv, d = kv_cache.shape
        b, length = plan.num_decode, plan.max_len
        m = self._mirrors.get(id(kv_cache))
        if m is not None and (m.cache() is not kv_cache or m.gen != mp.prev_gen):
            m = None  # another cache at a recycled address, or a step this layer missed
        cap = -(-(length + 32) // _MIRROR_ROUND) * _MIRROR_ROUND
        if m is not None and mp.src is None and m.k.shape[2] >= length:
            k_m, v_m = m.k, m.v  # the usual decode step: same rows, room left
        else:
            if 2 * b * cap * hkv * d * 4 > _MIRROR_MAX_CACHE_FRACTION * kv_cache.numel() * kv_cache.element_size():
                self._mirrors.pop(id(kv_cache), None)
                return None
            k_m = torch.zeros((b, hkv, cap, d), dtype=torch.float32, device=kv_cache.device)
            v_m = torch.zeros_like(k_m)
            if m is not None:
                n = min(cap, m.k.shape[2])
                if mp.src is None:
                    k_m[:, :, :n] = m.k[:, :, :n]
                    v_m[:, :, :n] = m.v[:, :, :n]
                elif mp.src.numel():
                    k_m[mp.cont, :, :n] = m.k[mp.src, :, :n]
                    v_m[mp.cont, :, :n] = m.v[mp.src, :, :n]
            fresh = list(range(b)) if m is None else mp.fresh
            if fresh:
                self._gather_rows(kv_cache, fresh, mp, plan, k_m, v_m, all_rows=m is None)
        # append the step's token: the values the cache now holds at each row's last position
        kq = key if plan.decode_rows is None else key[plan.decode_rows]
        vq = value if plan.decode_rows is None else value[plan.decode_rows]
        if mp.equal_len is not None:
            k_m[:, :, mp.equal_len - 1] = kq
            v_m[:, :, mp.equal_len - 1] = vq
        else:
            rows = torch.arange(b, device=k_m.device)
            k_m[rows, :, mp.lens - 1] = kq.float()
            v_m[rows, :, mp.lens - 1] = vq.float()
        m = _Mirror(weakref.ref(kv_cache), mp.gen, k_m, v_m)
        self._mirrors[id(kv_cache)] = m
        return m

    @staticmethod
    def _gather_rows(kv_cache: torch.Tensor, rows: list[int], mp: _MirrorPlan, plan: _StepPlan,
                     k_m: torch.Tensor, v_m: torch.Tensor, all_rows: bool) -> None:
        """Rows ``rows`` of the copy from the paged cache (block gathers, zero at/past each row's length)."""
        _, nb, bs, hkv, d = kv_cache.shape
        if all_rows:
            blocks, nblk, stale = plan.blocks, plan.num_blocks, plan.stale
        else:
            blocks, nblk, stale = mp.fresh_blocks, mp.fresh_nblk, mp.fresh_stale
        flat = kv_cache.view(2, nb, bs * hkv * d)
        n = len(rows)
        upto = min(nblk * bs, plan.max_len)  # slots at/past a row's length below this are zeroed (stale)
        idx = None if all_rows else torch.tensor(rows, dtype=torch.long, device=k_m.device)
        for c, dst in ((0, k_m), (1, v_m)):
            g = flat[c].index_select(0, blocks)
            if stale is not None:
                g.view(-1, hkv * d).index_fill_(0, stale, 0)
            g = g.view(n, nblk * bs, hkv, d)[:, :upto].transpose(1, 2)
            if idx is None:
                dst[:, :, :upto] = g
            else:
                dst[idx, :, :upto] = g.float()

    def query_scale(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> float | None:
        return None  # the scale goes into SDPA / the reference's scores: no pass over q to save

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        q_scaled: bool = False,
    ) -> torch.Tensor:
        if q_scaled:  # query carries scale x log2(e): exp(ln 2 * s) = 2^s, the kernel's exp2 domain
            scale = math.log(2.0)
        write_kv_cache_ref(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        t, h, d = query.shape
        plan = _step_plan(meta, t, query.device)
        fp8 = kv_cache.dtype == FP8_DTYPE
        if not plan.num_decode and self._keys:  # no decode rows: the next ones start afresh
            self._keys, self._mirrors = {}, {}
            self._gen += 1
        ks, vs = (k_scale, v_scale) if fp8 else (None, None)
        if plan.num_decode:
            m = None
            if not fp8:  # (an fp8 copy would need the scales fixed; fp8 caches gather)
                m = self._mirror(kv_cache, key, value, plan, self._mirror_plan(meta, plan, query.device))
            if m is None:
                o = _attend_decode(query, kv_cache, plan, scale, ks, vs)
            else:
                q = query if plan.decode_rows is None else query[plan.decode_rows]
                q = q.float().reshape(plan.num_decode, kv_cache.shape[3], h // kv_cache.shape[3], d)
                length = plan.max_len
                o = F.scaled_dot_product_attention(q, m.k[:, :, :length], m.v[:, :, :length], attn_mask=plan.mask,
                                                   scale=scale).reshape(plan.num_decode, h, d)
            if plan.decode_rows is None:
                return o.to(query.dtype)
        out = torch.zeros((t, h, d), dtype=torch.float32, device=query.device)
        if plan.num_decode:
            out[plan.decode_rows] = o
        for i, start, end in plan.multi:
            out[start:end] = attend_request(query[start:end], kv_cache, meta.block_tables[i], plan.lens[i],
                                            scale, ks, vs, meta.sliding_window)
        return out.to(query.dtype)
