"""The Triton fused-MoE kernels under the CPU interpreter: the expert-alignment routing (a
hand-made example exactly, random routings by their invariants), the grouped GEMM into a
poisoned buffer, and ``fused_moe`` against a float64 loop over (token, slot) pairs (fp32 and
bf16; K 1..3; experts without tokens and all tokens on one expert; router weights on the input
or the output; the unsorted pairs path and the sorted path; shapes that are no multiple of the
tiles); expert parallelism (``expert_map``: pairs of experts held elsewhere get no slot and add
nothing); the config choice and the tuning-table hook; the launcher's argument errors; and
``fused_moe_ref`` when it exists."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from paged_backend.kernels.fused_moe import (
    CONFIG_DIR,
    CONFIG_DIR_ENV,
    MoEConfig,
    config_file_name,
    fused_moe,
    load_config_table,
    moe_align_block_size,
    moe_gemm,
    pick_config,
    route,
    table_for,
    tuned_table,
)
from paged_backend.kernels.fused_moe_ref import moe_align_block_size_ref

pytestmark = pytest.mark.usefixtures("poison_uninitialized")

PAIRS = MoEConfig(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, num_stages=1)  # unsorted, one program per pair
SORTED = MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_stages=1)
SORTED_SWIZZLED = MoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_stages=1)  # 4 n-tiles, k loop


def _moe_loop(x, w13, w2, topk_weights, topk_ids, apply_router_weight_on_input=False):
    """The contract in float64, one (token, slot) pair at a time."""
    x, w13, w2, tw = (t.double() for t in (x, w13, w2, topk_weights))
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for m in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e, w = int(topk_ids[m, k]), tw[m, k]
            xin = x[m] * w if apply_router_weight_on_input else x[m]
            h = torch.nn.functional.silu(xin @ w13[e, :inter].T) * (xin @ w13[e, inter:].T)
            y = h @ w2[e].T
            out[m] += y if apply_router_weight_on_input else w * y
    return out


def _routing(m, e, k, gen, experts=None):
    """Distinct experts per token drawn from ``experts`` (default all E), softmax-like weights."""
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(m)]
                      or [torch.zeros(k, dtype=torch.int64)])[:m]
    weights = torch.softmax(torch.randn(m, k, generator=gen), dim=-1)
    return weights.float(), ids.to(torch.int32)


def _inputs(m, e, k, dtype, seed, h=64, inter=32, experts=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(dtype)
    return (x, w13, w2, *_routing(m, e, k, gen, experts))


def _rel_err(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _check(m, e, k, dtype, config, *, seed=0, on_input=False, experts=None, ids=None, h=64, inter=32):
    x, w13, w2, tw, tid = _inputs(m, e, k, dtype, seed, h, inter, experts)
    if ids is not None:
        tid = ids
    want = _moe_loop(x, w13, w2, tw, tid, on_input)
    got = fused_moe(x, w13, w2, tw, tid, config=config, apply_router_weight_on_input=on_input)
    assert got.shape == (m, h) and got.dtype == dtype
    assert _rel_err(got, want) < TOL[dtype], (m, e, k, dtype, config)
    return got


# -- moe_align_block_size ------------------------------------------------------------------------


def _runs_sorted(sorted_ids, ntpp, block_m):
    """sorted_token_ids with each tile's pairs in ascending order (the kernel's order inside an
    expert's run is the atomics'); the sentinel stays last in its tile."""
    tiles = sorted_ids[: int(ntpp)].view(-1, block_m)
    return torch.cat([tiles.sort(dim=1).values.reshape(-1), sorted_ids[int(ntpp):]])


def test_align_hand_made_example():
    # pairs p = 2m + k: experts [2, 0, 2, 1, 0, 2]; expert 3 has none
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    s = 6  # sentinel M*K
    for align in (moe_align_block_size_ref, moe_align_block_size):
        sorted_ids, expert_ids, ntpp = align(ids, 4, 4)
        assert sorted_ids.dtype == expert_ids.dtype == ntpp.dtype == torch.int32
        assert int(ntpp) == 12
        assert _runs_sorted(sorted_ids, ntpp, 4)[:12].tolist() == [1, 4, s, s, 3, s, s, s, 0, 2, 5, s]
        assert expert_ids[:3].tolist() == [0, 1, 2]
        # capacity: 6 pairs + 4 experts x 3 padding = 18 rows, 5 tiles; the rest unused
        assert sorted_ids.numel() == 20 and (sorted_ids[12:] == s).all()
        assert expert_ids.tolist()[3:] == [-1, -1]
    assert moe_align_block_size_ref(ids, 4, 4)[0][:12].tolist() == [1, 4, s, s, 3, s, s, s, 0, 2, 5, s]


@pytest.mark.parametrize("m,k,e,block_m,seed", [(1, 1, 4, 16, 0), (5, 2, 8, 16, 1), (37, 3, 8, 16, 2),
                                                (70, 2, 4, 32, 3), (9, 3, 6, 64, 4), (700, 4, 160, 16, 5)])
def test_align_invariants_on_random_routings(m, k, e, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    experts = list(range(0, e, 2)) if seed % 2 else None  # odd seeds: odd experts get no tokens
    ids = _routing(m, e, k, gen, experts)[1].to(torch.int64 if seed % 2 else torch.int32)
    ref = moe_align_block_size_ref(ids, block_m, e)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, block_m, e)
    assert torch.equal(expert_ids, ref[1]) and torch.equal(ntpp, ref[2])
    assert torch.equal(_runs_sorted(sorted_ids, ntpp, block_m), _runs_sorted(ref[0], ref[2], block_m))
    pairs, used = m * k, int(ntpp)
    flat = ids.reshape(-1)
    assert used % block_m == 0 and sorted_ids.numel() % block_m == 0
    assert sorted_ids.numel() // block_m == expert_ids.numel()
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert (sorted_ids[used:] == pairs).all() and (expert_ids[used // block_m:] == -1).all()
    counts = torch.bincount(flat.long(), minlength=e)
    tiles = sorted_ids[:used].view(-1, block_m)
    for t, row in enumerate(tiles):
        members = row[row < pairs].long()
        assert members.numel() > 0  # padding never fills a whole tile
        assert (flat[members] == expert_ids[t]).all()  # one expert per tile
    for ex in range(e):  # ceil(count / block_m) tiles each, none for an expert without tokens
        assert int((expert_ids == ex).sum()) == -(-int(counts[ex]) // block_m)


def test_align_gives_no_slot_to_pairs_of_experts_held_elsewhere():
    # pairs p = 2m + k, local experts [1, -1, 0, 1, -1, -1]: pairs 1, 4, 5 belong to another rank
    ids = torch.tensor([[1, -1], [0, 1], [-1, -1]], dtype=torch.int32)
    s = 6
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, 4, 2)
    assert int(ntpp) == 8
    assert _runs_sorted(sorted_ids, ntpp, 4)[:8].tolist() == [2, s, s, s, 0, 3, s, s]
    assert expert_ids.tolist()[:2] == [0, 1] and (expert_ids[2:] == -1).all()
    assert (sorted_ids[8:] == s).all()


# -- the grouped GEMM ------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [PAIRS, SORTED, SORTED_SWIZZLED])
def test_grouped_gemm_writes_every_pair_row_into_a_poisoned_buffer(config):
    m, e, k = 7, 4, 2
    x, w13, _, tw, tid = _inputs(m, e, k, torch.float32, seed=11)
    out = torch.full((m * k, w13.shape[1]), float("nan"))
    weights = tw.reshape(-1)
    moe_gemm(x, w13, out, route(tid, e, config), config, pairs_per_row=k, routed_weights=weights)
    flat = tid.reshape(-1).long()
    want = torch.stack([w13[flat[p]].double() @ x[p // k].double() for p in range(m * k)]) * weights[:, None]
    assert not out.isnan().any()
    assert _rel_err(out, want) < 1e-6


# -- fused_moe against the float64 loop ----------------------------------------------------------


# (M, E, K, dtype, config, apply_router_weight_on_input)
CASES = [
    (1, 4, 1, torch.float32, PAIRS, False),
    (1, 8, 3, torch.bfloat16, PAIRS, True),
    (3, 8, 2, torch.float32, PAIRS, False),
    (5, 4, 2, torch.bfloat16, SORTED, False),
    (17, 8, 1, torch.float32, SORTED, True),
    (33, 6, 3, torch.bfloat16, SORTED, False),
    (70, 8, 2, torch.float32, SORTED_SWIZZLED, False),
    (70, 4, 1, torch.bfloat16, SORTED_SWIZZLED, True),
]


@pytest.mark.parametrize("m,e,k,dtype,config,on_input", CASES)
def test_fused_moe_matches_loop(m, e, k, dtype, config, on_input):
    _check(m, e, k, dtype, config, seed=m + e + k, on_input=on_input)


@pytest.mark.parametrize("config", [PAIRS, SORTED])
def test_experts_without_tokens(config):
    _check(6, 8, 2, torch.float32, config, seed=3, experts=[1, 6])  # six of eight experts idle
    _check(4, 8, 3, torch.bfloat16, config, seed=4, experts=[0, 2, 5])


@pytest.mark.parametrize("config", [PAIRS, SORTED])
def test_all_tokens_on_one_expert(config):
    _check(9, 4, 1, torch.float32, config, seed=5, ids=torch.full((9, 1), 2, dtype=torch.int32))
    ids = torch.stack([torch.full((20,), 3), torch.arange(20) % 3], dim=1)  # expert 3 in every token
    _check(20, 4, 2, torch.bfloat16, config, seed=6, ids=ids.to(torch.int64))


def test_shapes_not_multiples_of_the_tiles():
    """H 40, I 24 against 32/16 tiles (masked N and K tails, GEMM 2's K loop uneven); 37 tokens."""
    ragged = MoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_stages=1)
    _check(37, 5, 2, torch.float32, ragged, seed=7, h=40, inter=24)
    _check(3, 5, 2, torch.bfloat16, MoEConfig(BLOCK_M=1, BLOCK_N=32, BLOCK_K=16), seed=8, h=40, inter=24)


def test_default_config_paths_agree():
    """``config=None`` at a decode shape (pairs path) and a prefill shape (sorted), both vs the loop;
    and forcing the other path gives the same result."""
    assert not pick_config(2, 8, 32, 64, torch.float32, top_k=2).sorted
    assert pick_config(40, 8, 32, 64, torch.float32, top_k=2).sorted
    for m in (2, 40):
        got = _check(m, 8, 2, torch.float32, None, seed=9)
        x, w13, w2, tw, tid = _inputs(m, 8, 2, torch.float32, 9)
        other = fused_moe(x, w13, w2, tw, tid, config=SORTED if m == 2 else PAIRS)
        torch.testing.assert_close(got, other, rtol=1e-5, atol=1e-5)


def _rank_maps(e: int, ranks: int) -> list[tuple[int, int, torch.Tensor]]:
    """(first expert, count, expert_map) of each rank: contiguous blocks, the remainder on the first."""
    base, extra = divmod(e, ranks)
    out, start = [], 0
    for r in range(ranks):
        count = base + (r < extra)
        mapping = torch.full((e,), -1, dtype=torch.int32)
        mapping[start:start + count] = torch.arange(count, dtype=torch.int32)
        out.append((start, count, mapping))
        start += count
    return out


@pytest.mark.parametrize("config", [PAIRS, SORTED])
@pytest.mark.parametrize("m,e,k,ranks,on_input", [(3, 8, 2, 2, False), (2, 8, 1, 2, True), (20, 8, 2, 3, False),
                                                  (9, 6, 3, 4, True)])
def test_expert_map_computes_only_the_local_experts(config, m, e, k, ranks, on_input):
    """Each rank, holding a block of whole experts, gives the loop over its own pairs only (the rest
    zero, in poisoned buffers); the ranks' outputs sum to the whole layer's."""
    x, w13, w2, tw, tid = _inputs(m, e, k, torch.float32, seed=m + ranks)
    total = torch.zeros(m, x.shape[1], dtype=torch.float64)
    for start, count, mapping in _rank_maps(e, ranks):
        local = (tid >= start) & (tid < start + count)
        got = fused_moe(x, w13[start:start + count], w2[start:start + count], tw, tid, config=config,
                        apply_router_weight_on_input=on_input, expert_map=mapping)
        want = _moe_loop(x, w13, w2, tw * local, tid, on_input)  # other ranks' pairs weigh 0
        assert not got.isnan().any()
        assert _rel_err(got, want) < 1e-5 or ((want == 0).all() and (got == 0).all())  # a rank without pairs
        total += got.double()
    assert _rel_err(total, _moe_loop(x, w13, w2, tw, tid, on_input)) < 1e-5


def test_no_tokens():
    x, w13, w2, tw, tid = _inputs(0, 4, 2, torch.float32, 0)
    assert fused_moe(x, w13, w2, tw, tid).shape == (0, 64)


# -- config selection --------------------------------------------------------------------------------


def test_pick_config_defaults_and_tuning_table(tmp_path):
    assert not pick_config(1, 8, 14336, 4096, torch.bfloat16, top_k=2).sorted  # decode: pairs
    assert not pick_config(4, 8, 14336, 4096, torch.bfloat16, top_k=2).sorted  # 8 pairs, one per expert
    assert pick_config(5, 8, 14336, 4096, torch.bfloat16, top_k=2).BLOCK_M == 16  # 10 pairs, M <= E
    assert pick_config(512, 8, 14336, 4096, torch.bfloat16, top_k=2).BLOCK_M == 64  # prefill
    name = config_file_name(8, 14336, "NVIDIA H200")
    assert name == "E=8,N=14336,device_name=NVIDIA_H200.json"
    assert config_file_name(8, 14336, "NVIDIA H200", "fp8_w8a8").endswith(",dtype=fp8_w8a8.json")
    entry = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16, "num_warps": 8,
             "num_stages": 4}
    (tmp_path / name).write_text(json.dumps({"1": {**entry, "BLOCK_SIZE_M": 16}, "64": entry}))
    table = load_config_table(tmp_path / name)
    assert table[64] == MoEConfig(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=4)
    assert pick_config(48, 8, 14336, 4096, torch.bfloat16, table=table) == table[64]  # nearest M
    assert pick_config(20, 8, 14336, 4096, torch.bfloat16, table=table) == table[1]
    with pytest.raises(ValueError, match="BLOCK_SIZE_K"):
        MoEConfig.from_vllm({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "GROUP_SIZE_M": 1})


def test_tuned_table_found_by_shape_and_device(tmp_path, monkeypatch):
    """``tuned_table`` reads $PAGED_BACKEND_MOE_CONFIG_DIR's file for (E, N, device), else the shipped
    folder's, else None; ``table_for`` gives none off CUDA (the interpreter and the CPU use defaults)."""
    entry = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
             "num_stages": 3}
    (tmp_path / config_file_name(4, 96, "Test GPU")).write_text(json.dumps({"8": entry}))
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    tuned_table.cache_clear()
    try:
        assert tuned_table(4, 96, "Test GPU") == {8: MoEConfig.from_vllm(entry)}
        assert tuned_table(4, 97, "Test GPU") is None and tuned_table(4, 96, "Other GPU") is None
    finally:
        tuned_table.cache_clear()
    assert table_for(torch.zeros(2, 8, dtype=torch.bfloat16), 4, 96) is None


def test_shipped_tuning_tables_parse_and_cover_decode_and_prefill():
    """Every table in paged_backend/kernels/fused_moe_configs is a valid vLLM-format table named for its shape,
    with entries from one token to prefill sizes."""
    files = sorted(p for p in os.listdir(CONFIG_DIR) if p.endswith(".json"))
    for name in files:
        table = load_config_table(os.path.join(CONFIG_DIR, name))
        # key=value pairs split at commas outside brackets (fp8 tables: ...,block_shape=[128,128].json)
        fields = dict(re.findall(r"(\w+)=(\[[^\]]*\]|[^,]+)", name.removesuffix(".json")))
        assert int(fields["E"]) > 0 and int(fields["N"]) > 0 and fields["device_name"], name
        assert min(table) == 1 and max(table) >= 1024, name


def test_tune_candidates_are_valid_and_fit():
    """The tuner's search space: the pairs path only for few pairs, row tiles no taller than the
    pairs per expert warrant, every candidate within the shared-memory budget."""
    from paged_backend.benchmarks.moe_tune import SMEM_BYTES, launch_candidates, tile_candidates

    decode, prefill = tile_candidates(1, 128, 8), tile_candidates(4096, 128, 8)
    assert any(not c.sorted for c in decode) and all(c.sorted for c in tile_candidates(16, 128, 8))
    assert {c.BLOCK_M for c in tile_candidates(64, 128, 8)} == {16}  # 4 pairs per expert
    assert {c.BLOCK_M for c in prefill} == {16, 32, 64, 128}
    for cfg in prefill + launch_candidates(prefill[-2:]):
        assert (cfg.BLOCK_M * cfg.BLOCK_K + cfg.BLOCK_K * cfg.BLOCK_N) * 2 * cfg.num_stages <= SMEM_BYTES
    refined = launch_candidates([decode[0], decode[0], prefill[0]])
    assert len(set(refined)) == len(refined) > 1 and decode[0] in refined


@pytest.mark.parametrize("kw,match", [(dict(BLOCK_M=8), "BLOCK_M"), (dict(BLOCK_N=24), "BLOCK_N"),
                                      (dict(BLOCK_K=8), "BLOCK_K"), (dict(GROUP_M=0), "GROUP_M")])
def test_config_rejects_bad_tiles(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kw)


# -- argument errors ---------------------------------------------------------------------------------


def _args(**over):
    x, w13, w2, tw, tid = _inputs(3, 4, 2, torch.float32, 0)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=tw, topk_ids=tid)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,match", [
    (dict(w13=torch.zeros(4, 63, 64)), ValueError, "odd"),
    (dict(w13=torch.zeros(4, 64, 48)), ValueError, r"w13 must have shape \(4, 64, 64\)"),
    (dict(w2=torch.zeros(4, 64, 16)), ValueError, r"w2 must have shape \(4, 64, 32\)"),
    (dict(w2=torch.zeros(3, 64, 32)), ValueError, "w2 must have shape"),
    (dict(x=torch.zeros(3, 64, 1)), ValueError, "x must have 2 dims"),
    (dict(w13=torch.zeros(4, 64, 64, dtype=torch.bfloat16)), TypeError, "w13 must have dtype"),
    (dict(w2=torch.zeros(4, 64, 32, dtype=torch.float16)), TypeError, "w2 must have dtype"),
    (dict(x=torch.zeros(3, 64, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(topk_weights=torch.zeros(3, 2, dtype=torch.bfloat16)), TypeError, "topk_weights must have dtype"),
    (dict(topk_ids=torch.zeros(3, 2)), TypeError, "topk_ids must have dtype"),
    (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32)), ValueError, "one row per token"),
    (dict(topk_weights=torch.zeros(3, 1)), ValueError, r"topk_weights must have shape \(3, 2\)"),
    (dict(topk_ids=torch.tensor([[0, 4], [1, 2], [3, 0]], dtype=torch.int32)), ValueError, r"\[0, 4\).*to 4"),
    (dict(topk_ids=torch.tensor([[0, -1], [1, 2], [3, 0]])), ValueError, r"\[0, 4\).*from -1"),
    (dict(topk_ids=torch.zeros(2, 3, dtype=torch.int32).T), ValueError, "topk_ids must be contiguous"),
    (dict(w2=torch.zeros(4, 32, 64).transpose(1, 2)), ValueError, "w2 must be contiguous in its last dim"),
    (dict(expert_map=torch.tensor([0, 1, -1, 4], dtype=torch.int32)), ValueError, r"expert_map values.*\[-1, 4\)"),
    (dict(expert_map=torch.tensor([0, -1, 1])), ValueError, r"\[0, 3\) \(expert_map's length\)"),
    (dict(expert_map=torch.tensor([0.0, 1, 2, 3])), TypeError, "expert_map must have dtype"),
])
def test_launcher_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        fused_moe(**_args(**over))


# -- the torch reference, once it exists -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on_input", [False, True])
def test_against_fused_moe_ref(on_input, dtype):
    ref = pytest.importorskip("paged_backend.kernels.fused_moe_ref")
    x, w13, w2, tw, tid = _inputs(11, 6, 2, dtype, 10)
    want = _moe_loop(x, w13, w2, tw, tid, on_input)
    expected = ref.fused_moe_ref(x, w13, w2, tw, tid, apply_router_weight_on_input=on_input)
    assert _rel_err(expected, want) < TOL[dtype]
    for config in (PAIRS, SORTED):
        got = fused_moe(x, w13, w2, tw, tid, config=config, apply_router_weight_on_input=on_input)
        assert _rel_err(got, want) < TOL[dtype]
        assert _rel_err(got, expected.double()) < TOL[dtype]


# -- compiled, on the GPU ----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 4, 300])
def test_compiled_mixtral_shaped(dtype, m):
    """Mixtral-like routing (E 8, top 2) at H 1024, I 1408 with the default configs."""
    gen = torch.Generator().manual_seed(m)
    h, inter, e, k = 1024, 1408, 8, 2
    x = torch.randn(m, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter**0.5
    tw, tid = _routing(m, e, k, gen)
    want = _moe_loop(x, w13, w2, tw, tid)
    dev = [t.cuda() for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), tw, tid)]
    got = fused_moe(*dev).cpu()
    assert _rel_err(got, want) < {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
