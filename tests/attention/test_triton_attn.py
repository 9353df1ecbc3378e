"""The Triton attention backend and kernel ops against the torch reference backend / ops,
through the same metadata the model runner builds, over several engine steps."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from paged_backend.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from paged_backend.attention.torch_attn import TorchAttentionBackend  # noqa: E402
from paged_backend.attention.triton_attn import TritonAttentionBackend  # noqa: E402
from paged_backend.kernels.cache_write_ref import FP8_DTYPE  # noqa: E402
from paged_backend.models.layers import reference_ops  # noqa: E402
from paged_backend.models.ops import get_kernel_ops, triton_ops  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEVICE = torch.device("cuda" if CUDA else "cpu")

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def step_meta(reqs, block_tables: dict[int, list[int]], block_size: int, max_blocks: int):
    """reqs: (request index, computed tokens, new tokens) -> metadata as the model runner builds it."""
    slots, seq_lens, qlens, rows = [], [], [], []
    for r, done, new in reqs:
        blocks = block_tables[r]
        for pos in range(done, done + new):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(done + new)
        qlens.append(new)
        rows.append(blocks + [0] * (max_blocks - len(blocks)))
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=qlens,
    )


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,kv_dtype",
    [
        (9, 3, 64, 16, torch.bfloat16, torch.bfloat16),  # SmolLM2's attention shape
        (9, 3, 64, 32, torch.float32, torch.float32),
        (8, 2, 128, 16, torch.bfloat16, FP8_DTYPE),
    ],
)
def test_backend_matches_torch_over_steps(heads, kv_heads, head_dim, block_size, dtype, kv_dtype):
    """Prefill + chunked prefill + prefix hit, then decode steps: same cache bits, same outputs."""
    g = torch.Generator().manual_seed(0)
    num_blocks = 24
    cache_t = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), device=DEVICE).to(kv_dtype)
    cache_r = cache_t.cpu().clone()  # the reference backend writes into this one
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = {0: ids[0:4], 1: ids[4:8], 2: ids[8:12]}
    # request 2 shares request 0's first block (a prefix-cache hit of one full block)
    tables[2][0] = tables[0][0]
    steps = [
        [(0, 0, block_size + 5), (1, 0, 7)],  # prefills
        [(1, 7, 12), (0, block_size + 5, 1), (2, block_size, 6)],  # chunk, decode, prefix hit
        [(0, block_size + 6, 1), (1, 19, 1), (2, block_size + 6, 1)],  # decodes
    ]
    ks = torch.tensor(0.8, device=DEVICE)
    vs = torch.tensor(0.45, device=DEVICE)
    triton_b, torch_b = TritonAttentionBackend(), TorchAttentionBackend()
    for step in steps:
        meta = step_meta(step, tables, block_size, 4)
        t = int(meta.query_start_loc[-1])
        q = (torch.randn((t, heads, head_dim), generator=g)).to(dtype).to(DEVICE)
        k = (torch.randn((t, kv_heads, head_dim), generator=g) * 2).to(dtype).to(DEVICE)
        v = (torch.randn((t, kv_heads, head_dim), generator=g) * 2).to(dtype).to(DEVICE)
        out = triton_b.forward(q, k, v, cache_t, meta, head_dim**-0.5, ks, vs)
        # prefill steps: the layer's rotary folds the kernel's q scale in; the kernel sees the same bits
        factor = triton_b.query_scale(q, cache_t, meta, head_dim**-0.5)
        assert (factor is None) == (meta.max_query_len == 1)
        if factor is not None:
            again = triton_b.forward(torch.mul(q, factor), k, v, cache_t, meta, head_dim**-0.5, ks, vs, q_scaled=True)
            assert torch.equal(again, out)
        ref = torch_b.forward(q.cpu(), k.cpu(), v.cpu(), cache_r, _cpu(meta), head_dim**-0.5, ks.cpu(), vs.cpu())
        assert not out.isnan().any()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol, rtol=tol)
        # cache contents: bit-equal, including the untouched (NaN) slots
        view = torch.uint8 if kv_dtype == FP8_DTYPE else {2: torch.int16, 4: torch.int32}[cache_t.element_size()]
        assert torch.equal(cache_t.cpu().view(view), cache_r.view(view))


def _cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.cpu(), block_tables=meta.block_tables.cpu(), seq_lens=meta.seq_lens.cpu(),
        query_start_loc=meta.query_start_loc.cpu(), max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len, block_size=meta.block_size, seq_lens_cpu=meta.seq_lens_cpu,
        query_lens_cpu=meta.query_lens_cpu, sliding_window=meta.sliding_window,
    )  # fmt: skip


def test_backend_selection():
    assert isinstance(get_attention_backend("triton", DEVICE), TritonAttentionBackend)
    assert get_attention_backend("auto", torch.device("cuda")).name == "triton"
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"


def test_kernel_ops_selection_and_agreement():
    assert get_kernel_ops("cpu") == reference_ops()
    assert get_kernel_ops("cuda") == triton_ops()
    assert get_kernel_ops("cpu", "triton") == triton_ops()
    with pytest.raises(ValueError, match="unknown"):
        get_kernel_ops("cpu", "nope")
    ours, ref = triton_ops(), reference_ops()
    g = torch.Generator().manual_seed(1)
    x = torch.randn((4, 2 * 48), generator=g).to(torch.bfloat16)
    assert torch.equal(ours.silu_and_mul(x.to(DEVICE)).cpu(), ref.silu_and_mul(x))
    w = torch.randn(96, generator=g).to(torch.bfloat16)
    res = torch.randn((4, 96), generator=g).to(torch.bfloat16)
    (a, ra), (b, rb) = ours.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5, res.to(DEVICE)), ref.rms_norm(x, w, 1e-5, res)
    assert torch.equal(ra.cpu(), rb)
    torch.testing.assert_close(a.cpu(), b, atol=2 * 2**-7, rtol=2 * 2**-7)
    from paged_backend.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq

    table = rope_cos_sin_cache(rope_inv_freq(32, 10000.0), 64)
    q = torch.randn((4, 3, 32), generator=g).to(torch.bfloat16)
    k = torch.randn((4, 1, 32), generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 63, 7])
    (qa, ka), (qb, kb) = ours.rotary(pos.to(DEVICE), q.to(DEVICE), k.to(DEVICE), table.to(DEVICE)), ref.rotary(
        pos, q, k, table
    )
    torch.testing.assert_close(qa.cpu(), qb, atol=2**-7, rtol=2**-7)  # one bf16 rounding (FMA on the GPU)
    torch.testing.assert_close(ka.cpu(), kb, atol=2**-7, rtol=2**-7)
