"""The CPU's default KV-cache size: a share of RAM, capped at 4 GiB and at what max_num_seqs
requests of max_model_len tokens can use (GPU sizing profiles the card and is not changed here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_backend.worker.model_runner import CPU_KV_BUDGET_CAP, cpu_default_num_blocks

GIB = 1 << 30


def test_the_cpu_cache_holds_no_more_than_max_num_seqs_full_length_requests():
    # 8 requests of 1024 tokens: 64 blocks each, plus the null block; far under 4 GiB
    assert cpu_default_num_blocks(1 << 20, 16, 1024, 8, available_ram=64 * GIB) == 8 * 64 + 1
    # a context that is not a multiple of the block size rounds up per request
    assert cpu_default_num_blocks(1 << 20, 16, 1000, 2, available_ram=64 * GIB) == 2 * 63 + 1


def test_the_memory_cap_still_bounds_a_long_context_or_many_requests():
    assert cpu_default_num_blocks(1 << 20, 16, 8192, 256, available_ram=64 * GIB) == CPU_KV_BUDGET_CAP // (1 << 20)
    assert cpu_default_num_blocks(1 << 20, 16, 8192, 256, available_ram=1 * GIB) == GIB // 4 // (1 << 20)
    assert cpu_default_num_blocks(1 << 30, 16, 8192, 256, available_ram=1 * GIB) == 2  # never fewer than two


@pytest.mark.slow
def test_the_engine_sizes_its_cpu_cache_from_the_limits():
    from paged_backend import LLM

    llm = LLM("SmolLM2-135M-Instruct", device="cpu", max_model_len=256, max_num_seqs=4)
    try:
        info = llm.engine.model_info()
        assert info["num_gpu_blocks"] == 4 * 256 // 16  # the null block is not counted
        assert info["kv_capacity_tokens"] >= 4 * 256
    finally:
        llm.engine.shutdown()


# -- a draft model's cache shares the target's block ids: a block id costs both caches' bytes ----------

def _draft_dir(d: Path) -> Path:
    """A tiny Llama of another shape (3 layers, 1 KV head of 32): its bytes per block differ from the target's."""
    from tiny_llama import CONFIG

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 3, "num_attention_heads": 2,
                                               "num_key_value_heads": 1}))
    return d


def _engine_with_draft(tmp_path: Path, **kw):
    from tiny_llama import write_tiny_llama

    from paged_backend import LLM

    spec = {"method": "draft_model", "model": str(_draft_dir(tmp_path / "draft")), "num_speculative_tokens": 2}
    return LLM(str(write_tiny_llama(tmp_path / "target")), load_format="dummy", dtype="float32", max_model_len=256,
               max_num_seqs=4, speculative_config=spec, **kw).engine


def test_the_kv_budget_is_divided_by_the_target_and_draft_bytes_per_block(tmp_path) -> None:
    engine = _engine_with_draft(tmp_path, device="cpu", kv_cache_memory_bytes=1_000_000)
    try:
        target, draft = engine.runner, engine.spec.draft.runner
        # fp32, blocks of 16: target 2 layers x K,V x 2 heads x 16 dims; draft 3 layers x K,V x 1 head x 32 dims
        assert target.bytes_per_block == 2 * 2 * 2 * 16 * 16 * 4 == 8192
        assert draft.bytes_per_block == 3 * 2 * 1 * 32 * 16 * 4 == 12288
        assert target.num_blocks == draft.num_blocks == 1_000_000 // (8192 + 12288) == 48
        assert target.kv_budget_bytes == 1_000_000
        assert sum(t.numel() * t.element_size() for t in target.kv_caches + draft.kv_caches) == 48 * 20480
    finally:
        engine.shutdown()


def test_the_cpu_default_counts_the_draft_bytes_too() -> None:
    # the same RAM share holds fewer block ids when each one also has a draft block
    ram = 64 << 20
    assert cpu_default_num_blocks(8192 + 12288, 16, 8192, 256, available_ram=ram) == ram // 4 // 20480 == 819


@pytest.mark.cuda
def test_the_profiled_gpu_budget_is_divided_by_the_summed_bytes(tmp_path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = _engine_with_draft(tmp_path, device="cuda", gpu_memory_utilization=0.3)
    try:
        target, draft = engine.runner, engine.spec.draft.runner
        per_block = target.bytes_per_block + draft.bytes_per_block
        assert target.kv_budget_bytes is not None and target.kv_budget_bytes > 0
        assert target.num_blocks == draft.num_blocks == target.kv_budget_bytes // per_block
    finally:
        engine.shutdown()
