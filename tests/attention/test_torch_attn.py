"""The torch backend's fast CPU path against ``paged_attention_ref``.

Caches are random where requests read and NaN where they must not (the null block that pads
block tables, the slots past each request's length in its last block), so a gathered stale
slot that reaches the output shows as NaN; ``torch.empty`` is NaN-filled too.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from paged_backend.attention.backend import AttentionMetadata
from paged_backend.attention.torch_attn import TorchAttentionBackend
from paged_backend.kernels.cache_write_ref import FP8_DTYPE, write_kv_cache_ref
from paged_backend.kernels.paged_attention_ref import paged_attention_ref

pytestmark = pytest.mark.usefixtures("poison_uninitialized")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_step(
    reqs: list[tuple[int, int]],  # (cached context, new tokens) per request
    heads: int,
    kv_heads: int,
    block_size: int = 16,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    fp8: bool = False,
    seed: int = 0,
    host_lists: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, the step's new k / v, a poisoned cache holding the context, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in reqs]
    nblk = [-(-length // block_size) for length in lens]
    num_blocks = sum(nblk) + 4
    cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g) * 2
    cache[:, 0] = float("nan")  # the null block
    ids = (torch.randperm(num_blocks - 1, generator=g)[: sum(nblk)] + 1).tolist()
    table = torch.zeros((len(reqs), max(nblk) + 1), dtype=torch.int32)
    slots: list[int] = []
    i = 0
    for r, ((ctx, _), length) in enumerate(zip(reqs, lens, strict=True)):
        row = ids[i : i + nblk[r]]
        i += nblk[r]
        table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        cache[:, row[-1], (length - 1) % block_size + 1 :] = float("nan")  # past the length
        slots += [row[p // block_size] * block_size + p % block_size for p in range(ctx, length)]
    cache = cache.to(FP8_DTYPE) if fp8 else cache.to(dtype)
    t = len(slots)
    q = torch.randn((t, heads, head_dim), generator=g).to(dtype)
    k = torch.randn((t, kv_heads, head_dim), generator=g).to(dtype)
    v = torch.randn((t, kv_heads, head_dim), generator=g).to(dtype)
    qlens = [n for _, n in reqs]
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        block_size=block_size,
        seq_lens_cpu=lens if host_lists else None,
        query_lens_cpu=qlens if host_lists else None,
    )
    return q, k, v, cache, meta


def run_both(q, k, v, cache, meta, scale=0.2, ks=None, vs=None):
    """The backend on one copy of the cache; the reference write + attention on another."""
    one = torch.ones(())
    ks = one if ks is None else ks
    vs = one if vs is None else vs
    ours_cache, ref_cache = cache.clone(), cache.clone()
    out = TorchAttentionBackend().forward(q, k, v, ours_cache, meta, scale, ks, vs)
    write_kv_cache_ref(k, v, ref_cache, meta.slot_mapping, ks, vs)
    ref = paged_attention_ref(q, ref_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, ks, vs,
                              meta.sliding_window)
    assert torch.equal(ours_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "cache write differs"
    return out, ref


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not ref.isnan().any()
    assert not out.isnan().any(), "a stale or unwritten slot reached the output"
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


DECODE_EQUAL = [(40, 1)] * 5  # one length, not a multiple of the block size: no mask
DECODE_RAGGED = [(37, 1), (64, 1), (0, 1), (130, 1), (15, 1)]  # page boundaries, a first token
MIXED = [(37, 1), (0, 19), (23, 9), (64, 1), (0, 1), (5, 3)]  # decode, prefill, chunk / prefix hit


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA ratio 1, 3, 8
@pytest.mark.parametrize("batch", ["equal", "ragged", "mixed"])
def test_matches_reference(heads, kv_heads, batch):
    reqs = {"equal": DECODE_EQUAL, "ragged": DECODE_RAGGED, "mixed": MIXED}[batch]
    check(*run_both(*make_step(reqs, heads, kv_heads)))


@pytest.mark.parametrize("batch", ["ragged", "mixed"])
def test_q_scaled(batch):
    """q carrying scale x log2(e) (``q_scaled``, as the Triton backend's callers pass it): the same
    attention; this backend asks for no such factor."""
    q, k, v, cache, meta = make_step(DECODE_RAGGED if batch == "ragged" else MIXED, 9, 3, seed=5)
    backend = TorchAttentionBackend()
    assert backend.query_scale(q, cache, meta, 0.2) is None
    one = torch.ones(())
    out = backend.forward(q * (0.2 * math.log2(math.e)), k, v, cache.clone(), meta, 0.2, one, one, q_scaled=True)
    check(out, run_both(q, k, v, cache, meta)[1])


@pytest.mark.parametrize("block_size", [16, 32])
def test_bfloat16_and_block_sizes(block_size):
    q, k, v, cache, meta = make_step(MIXED, 6, 2, block_size=block_size, dtype=torch.bfloat16, seed=1)
    check(*run_both(q, k, v, cache, meta))


@pytest.mark.parametrize("window", [1, 8, 40])
@pytest.mark.parametrize("batch", ["equal", "mixed"])
def test_sliding_window(window, batch):
    q, k, v, cache, meta = make_step(DECODE_EQUAL if batch == "equal" else MIXED, 4, 2, seed=2)
    check(*run_both(q, k, v, cache, replace(meta, sliding_window=window)))


@pytest.mark.parametrize("batch", ["ragged", "mixed"])
def test_fp8_cache(batch):
    q, k, v, cache, meta = make_step(DECODE_RAGGED if batch == "ragged" else MIXED, 9, 3, fp8=True, seed=3)
    assert cache.dtype == FP8_DTYPE
    out, ref = run_both(q, k, v, cache, meta, ks=torch.tensor(0.37), vs=torch.tensor(1.9))
    check(out, ref)
    plain, _ = run_both(q, k, v, cache, meta)  # the scales matter
    assert not torch.allclose(plain, ref, atol=1e-2, rtol=1e-2)


def test_without_host_lists_and_padding_rows():
    """No seq_lens_cpu / query_lens_cpu; query rows past query_start_loc[-1] come back as zeros."""
    q, k, v, cache, meta = make_step(DECODE_RAGGED, 6, 2, seed=4, host_lists=False)
    pad = torch.randn((3, *q.shape[1:]))
    out, ref = run_both(torch.cat([q, pad]), torch.cat([k, pad[:, :2]]), torch.cat([v, pad[:, :2]]), cache,
                        replace(meta, slot_mapping=torch.cat([meta.slot_mapping, torch.full((3,), -1)])))
    check(out[: len(q)], ref[: len(q)])
    assert torch.equal(out[len(q) :], torch.zeros_like(pad))


def test_plan_shared_by_layers_of_a_step():
    """Layers reuse one step plan: each still reads its own cache; a replaced sliding window gets its own."""
    q, k, v, cache, meta = make_step(MIXED, 4, 2, seed=5)
    backend = TorchAttentionBackend()
    one = torch.ones(())
    caches = [cache.clone(), (cache * 0.5).clone()]
    outs = [backend.forward(q, k, v, c, meta, 0.2, one, one) for c in caches]

    def plans() -> int:
        return sum(key[0] == "torch_attn.plan" for key in meta.step_cache)

    assert plans() == 1
    windowed = replace(meta, sliding_window=8)
    assert windowed.step_cache is meta.step_cache
    outs.append(backend.forward(q, k, v, caches[0], windowed, 0.2, one, one))
    assert plans() == 2
    for c, out, m in zip(caches + caches[:1], outs, [meta, meta, windowed], strict=True):
        ref = paged_attention_ref(q, c, m.block_tables, m.seq_lens, m.query_start_loc, 0.2, None, None, m.sliding_window)
        check(out, ref)
    assert not torch.allclose(outs[0], outs[1])
    assert not torch.allclose(outs[0], outs[2])


def test_empty_step():
    q, k, v, cache, meta = make_step([(5, 0), (9, 1)], 4, 2, seed=6)
    check(*run_both(q, k, v, cache, meta))
    out = TorchAttentionBackend().forward(q[:0], k[:0], v[:0], cache, replace(
        meta, slot_mapping=meta.slot_mapping[:0], block_tables=meta.block_tables[:0], seq_lens=meta.seq_lens[:0],
        query_start_loc=meta.query_start_loc[:1], seq_lens_cpu=[], query_lens_cpu=[], step_cache={}),
        0.2, torch.ones(()), torch.ones(()))
    assert out.shape == (0, 4, 32)


class Engine:
    """Requests over a shared paged cache, step by step: the backend on one copy of the cache, the
    reference on another. Freed and never-written slots hold NaN, so stale data that reaches an
    output shows; a layer is one cache (several layers share the backend, as in the model)."""

    def __init__(self, layers: int = 2, num_blocks: int = 64, block_size: int = 16, kv_heads: int = 2,
                 heads: int = 6, head_dim: int = 32, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.bs, self.hkv, self.h, self.d = block_size, kv_heads, heads, head_dim
        shape = (2, num_blocks, block_size, kv_heads, head_dim)
        self.ours = [torch.full(shape, float("nan")) for _ in range(layers)]
        self.ref = [c.clone() for c in self.ours]
        self.free = (torch.randperm(num_blocks - 1, generator=self.g) + 1).tolist()
        self.reqs: dict[str, tuple[list[int], int]] = {}  # name -> (blocks, length)
        self.backend = TorchAttentionBackend()

    def finish(self, name: str) -> None:
        blocks, _ = self.reqs.pop(name)
        for c in self.ours + self.ref:
            c[:, blocks] = float("nan")
        self.free += blocks

    def cow_last_block(self, name: str) -> None:
        """The request's last block moves to a fresh block with the same content (copy-on-write)."""
        blocks, n = self.reqs[name]
        new = self.free.pop()
        for c in self.ours + self.ref:
            c[:, new] = c[:, blocks[-1]]
            c[:, blocks[-1]] = float("nan")
        self.free.append(blocks[-1])
        self.reqs[name] = (blocks[:-1] + [new], n)

    def step(self, new_tokens: dict[str, int], layers: list[int] | None = None, order: list[str] | None = None,
             window: int | None = None) -> None:
        """Schedules ``new_tokens`` per request (a new name starts a request); checks every layer run
        (``layers``: only these go through the backend, the others' caches are written directly)."""
        names = order or list(new_tokens)
        lens, qlens, slots, rows = [], [], [], []
        for name in names:
            blocks, n = self.reqs.get(name, ([], 0))
            q = new_tokens[name]
            while len(blocks) * self.bs < n + q:
                blocks = blocks + [self.free.pop()]
            self.reqs[name] = (blocks, n + q)
            slots += [blocks[p // self.bs] * self.bs + p % self.bs for p in range(n, n + q)]
            lens.append(n + q)
            qlens.append(q)
            rows.append(blocks)
        width = max(len(r) for r in rows) + 2
        table = torch.full((len(names), width), 7, dtype=torch.int32)  # stale entries past each row's blocks
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=table,
            seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            max_query_len=max(qlens), max_seq_len=max(lens), block_size=self.bs,
            seq_lens_cpu=lens, query_lens_cpu=qlens, sliding_window=window)
        one = torch.ones(())
        t = len(slots)
        for layer in range(len(self.ours)):
            q = torch.randn((t, self.h, self.d), generator=self.g)
            k = torch.randn((t, self.hkv, self.d), generator=self.g)
            v = torch.randn((t, self.hkv, self.d), generator=self.g)
            if layers is not None and layer not in layers:  # its K/V reach the cache another way
                for c in (self.ours[layer], self.ref[layer]):
                    write_kv_cache_ref(k, v, c, meta.slot_mapping, one, one)
                continue
            out = self.backend.forward(q, k, v, self.ours[layer], meta, 0.2, one, one)
            write_kv_cache_ref(k, v, self.ref[layer], meta.slot_mapping, one, one)
            ref = paged_attention_ref(q, self.ref[layer], table, meta.seq_lens, meta.query_start_loc, 0.2,
                                      None, None, window)
            assert torch.equal(self.ours[layer].isnan(), self.ref[layer].isnan())
            check(out, ref)


def test_decode_rows_across_steps():
    """The per-layer decode copy follows rows that continue, finish, join, reorder, change blocks
    (copy-on-write) and outgrow its capacity; every step equals the reference."""
    e = Engine()
    e.step({"a": 20, "b": 35, "c": 16})
    for _ in range(3):
        e.step({"a": 1, "b": 1, "c": 1})  # all fresh, then continuing in place
    e.finish("b")
    e.step({"a": 1, "c": 1, "d": 10})  # rows compacted, a prefill beside them
    e.step({"d": 1, "a": 1, "c": 1})  # d fresh, a and c reordered
    e.cow_last_block("c")
    e.step({"d": 1, "a": 1, "c": 1})  # c gathered again
    for _ in range(40):  # past the first capacity (a: 25 -> 65 positions)
        e.step({"d": 1, "a": 1, "c": 1})
    e.step({"d": 1, "a": 1, "c": 1}, window=9)


def test_decode_rows_of_one_length_and_a_skipped_layer():
    e = Engine(layers=3, seed=1)
    e.step({"a": 33, "b": 33})
    e.step({"a": 1, "b": 1})
    e.step({"a": 1, "b": 1}, layers=[0, 1])  # layer 2 misses a step: its copy is rebuilt
    e.step({"a": 1, "b": 1})
    e.step({"a": 1})
    e.step({"e": 3})  # no decode rows at all: copies dropped
    e.step({"a": 1, "b": 1, "e": 1})


def test_decode_copy_over_its_memory_share_gathers():
    """A cache too small to also hold the decode copy: the plain gather path, same results."""
    e = Engine(num_blocks=12)
    e.step({"a": 70, "b": 60})
    for _ in range(3):
        e.step({"a": 1, "b": 1})
    assert not e.backend._mirrors
