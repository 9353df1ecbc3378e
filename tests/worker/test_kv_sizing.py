"""The CPU's default KV-cache size: a share of RAM, capped at 4 GiB and at what max_num_seqs
requests of max_model_len tokens can use (GPU sizing profiles the card and is not changed here)."""

from __future__ import annotations

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
