"""Tensor parallelism on the CPU (gloo): the engine spawns its workers; greedy tokens equal the
single-process engine's and transformers'; KV blocks are accounted on every rank; shutdown and
a dead worker leave no process behind and never hang."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from model_fixtures import hf_model, make_tiny_checkpoint
from process_checks import assert_gone as _assert_gone
from process_checks import running as _running

from paged_backend import LLM, SamplingParams
from paged_backend.config import EngineConfig
from paged_backend.distributed import TPGroup
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.parallel import (
    LazyTensor,
    check_tp_compatible,
    kv_head_range,
    local_heads,
    shard_for_rank,
)
from paged_backend.worker.model_loader import load_model
from paged_backend.worker.tensor_parallel import WorkerDiedError

MAX_NEW = 12
PROMPTS = [
    [1, 5, 9, 33, 7],
    [1, *range(100, 141)],  # 42 tokens: chunked over several steps at a 32-token budget
    [1, 17, 17, 17, 200, 201, 3],
    [1, *range(100, 120), 9, 9],  # shares its first block with the second prompt (prefix cache)
]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def _engine_args(model: Path, tokenizer: str, **kw) -> dict:
    args = dict(model=str(model), tokenizer=tokenizer, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20,
                max_num_batched_tokens=32, log_stats_interval=0, seed=0)
    args.update(kw)
    return args


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
@torch.no_grad()
def _hf_greedy(path: Path) -> list[list[int]]:
    model = hf_model(path)
    res = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=0)
        res.append(out[0, len(p):].tolist())
    return res


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from paged_backend.models.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="module")
def divisible(tmp_path_factory) -> Path:
    """4 q / 2 KV heads (one KV head per rank at TP=2); biases everywhere, untied LM head."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "div", "LlamaForCausalLM", seed=1,
                                attention_bias=True, mlp_bias=True, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory) -> Path:
    """4 q / 1 KV head (replicated on both ranks); tied embeddings; vocab 255 (a padded row)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "rep", "LlamaForCausalLM", seed=2,
                                num_key_value_heads=1, tie_word_embeddings=True, vocab_size=255)


# -- the slicing math (no processes) -------------------------------------------------------------


def _group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, torch.device("cpu"))


def test_replicated_kv_head_is_the_one_the_ranks_q_heads_use():
    hq, hkv = 8, 2
    for size in (4, 8):
        for rank in range(size):
            first, count = kv_head_range(hkv, _group(rank, size))
            q_per_rank = hq // size
            q_heads = range(rank * q_per_rank, (rank + 1) * q_per_rank)
            assert count == 1
            assert {h // (hq // hkv) for h in q_heads} == {first}
    assert [kv_head_range(4, _group(r, 2)) for r in range(2)] == [(0, 2), (2, 2)]


def test_incompatible_sizes_are_refused_before_any_process(divisible, tokenizer_dir):
    info = ModelInfo.from_dir(divisible)
    check_tp_compatible(info, 2)
    check_tp_compatible(info, 4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tp_compatible(info, 3)
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(**_engine_args(divisible, tokenizer_dir, tensor_parallel_size=3))
    assert multiprocessing.active_children() == before


def test_expert_parallel_is_a_no_op_on_a_dense_model(divisible):
    """enable_expert_parallel on a model without experts: the same checks and the same parameters."""
    from paged_backend.attention.torch_attn import TorchAttentionBackend

    info = ModelInfo.from_dir(divisible)
    check_tp_compatible(info, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tp_compatible(info, 3, expert_parallel=True)

    def shapes(ep: bool) -> dict[str, torch.Size]:
        tp = TPGroup(1, 2, torch.device("cpu"), expert_parallel=ep)  # loading runs no collective
        model = load_model(divisible, info, torch.float32, "cpu", TorchAttentionBackend(), tp=tp)
        return {n: p.shape for n, p in model.named_parameters()}

    assert shapes(True) == shapes(False)


def test_lazy_slice_reads_the_same_as_the_tensor(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.randn(12, 6)
    save_file({"w": w}, tmp_path / "w.safetensors")

    class Row:  # a layer holding input columns [2, 4)
        from paged_backend.models.parallel import TPSpec

        tp_spec = TPSpec("row", in_range=(2, 2))

    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        lazy = LazyTensor(f.get_slice("w"))
        assert lazy.shape == w.shape
        assert torch.equal(lazy.narrow(0, 3, 4), w[3:7])
        assert torch.equal(shard_for_rank(Row(), lazy, in_dim=1), w[:, 2:4])
        assert torch.equal(shard_for_rank(Row(), lazy, in_dim=1, in_pack=2), w[:, 1:2])
        assert torch.equal(shard_for_rank(object(), lazy, out_dim=0), w)  # no TP: the whole tensor
        dst = torch.empty(12, 6)
        dst.copy_(lazy)  # loaders that know nothing of TP read the whole tensor
        assert torch.equal(dst, w) and lazy.numel() == 72


def test_local_heads():
    class Info:  # only the fields local_heads reads
        num_heads, num_kv_heads = 8, 2

    assert local_heads(Info, _group(0, 2)) == (4, 1)
    assert local_heads(Info, _group(3, 4)) == (2, 1)
    assert local_heads(Info, _group(5, 8)) == (1, 1)
    assert local_heads(Info, None) == (8, 2)


# -- TP = 2 against TP = 1 and transformers --------------------------------------------------


def test_tp2_divisible_heads_matches_tp1_and_hf_and_accounts_blocks(divisible, tokenizer_dir):
    expected = _hf_greedy(divisible)
    tp1 = LLM(**_engine_args(divisible, tokenizer_dir))
    assert _tokens(tp1.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected

    llm = LLM(**_engine_args(divisible, tokenizer_dir, tensor_parallel_size=2))
    engine, runner = llm.engine, llm.engine.runner
    pids = runner.worker_pids
    try:
        assert len(pids) == 1 and all(_running(p) for p in pids)
        # KV blocks: each rank holds 1 of the 2 KV heads, so the same budget gives twice TP=1's blocks
        assert engine.runner.num_blocks == 2 * tp1.engine.runner.num_blocks

        # mid-run: every rank holds exactly the blocks rank 0's manager has handed out
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, GREEDY)
        for _ in range(4):
            engine.step()
        used = engine.kv.block_pool.num_total_usable - engine.kv.num_free_blocks
        assert used > 0
        reports = runner.rank_reports([r.request_id for r in engine.scheduler.running])
        assert [r.rank for r in reports] == [0, 1] and reports[1].pid == pids[0]
        for r in reports:
            assert r.num_blocks == engine.runner.num_blocks
            assert r.kv_cache_shape == (2, engine.runner.num_blocks, 16, 1, 16)
            assert r.num_used_blocks == used
        while engine.has_unfinished_requests():
            engine.step()

        # a second pass (prefix-cache hits, chunked prefill) and n=2 (forked blocks, copy-on-write)
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        assert engine.get_stats()["prefix_cache_hits"] > 0
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=2), use_tqdm=False)
        for o, exp in zip(outs, expected[:2], strict=True):
            assert [c.token_ids for c in o.outputs] == [exp, exp]

        # logprobs and prompt logprobs (the gathered logits of prompt rows) agree with TP = 1
        lp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
        got, ref = (x.generate([PROMPTS[1]], lp, use_tqdm=False)[0] for x in (llm, tp1))
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(got.prompt_logprobs[1:] + got.outputs[0].logprobs,
                        ref.prompt_logprobs[1:] + ref.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)

        assert engine.kv.num_free_blocks == engine.kv.block_pool.num_total_usable
        for r in runner.rank_reports([]):
            assert r.num_used_blocks == 0 and r.num_free_blocks == engine.runner.num_blocks - 1
    finally:
        llm.shutdown()
    _assert_gone(pids)
    assert not [c for c in multiprocessing.active_children() if c.pid in pids]
    llm.shutdown()  # idempotent
    engine.add_request("late", PROMPTS[0], GREEDY)
    with pytest.raises(WorkerDiedError, match="shut down"):
        engine.step()


def test_tp2_replicated_kv_head_async_engine(replicated, tokenizer_dir):
    from paged_backend.engine.async_engine import AsyncEngine

    expected = _hf_greedy(replicated)
    assert _tokens(LLM(**_engine_args(replicated, tokenizer_dir)).generate(PROMPTS, GREEDY, use_tqdm=False)) == expected

    engine = AsyncEngine(EngineConfig(**_engine_args(replicated, tokenizer_dir, tensor_parallel_size=2)))
    pids = engine.engine.runner.worker_pids
    try:
        assert engine.engine.runner.num_kv_heads == 1

        async def one(i: int, p: list[int]) -> list[int]:
            toks: list[int] = []
            async for d in engine.generate(f"a{i}", p, GREEDY):
                toks += d.outputs[0].token_ids if d.outputs else []
            return toks

        async def all_of():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

        assert asyncio.run(all_of()) == expected
        for r in engine.engine.runner.rank_reports([]):
            assert r.num_used_blocks == 0 and r.kv_cache_shape[3] == 1
    finally:
        engine.shutdown()
    _assert_gone(pids)


def test_tp4_replicates_kv_heads_over_rank_pairs(divisible, tokenizer_dir):
    """4 q / 2 KV heads over 4 ranks: one q head each, ranks (0, 1) share KV head 0, (2, 3) head 1."""
    llm = LLM(**_engine_args(divisible, tokenizer_dir, tensor_parallel_size=4))
    pids = llm.engine.runner.worker_pids
    try:
        assert len(pids) == 3
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == _hf_greedy(divisible)
        reports = llm.engine.runner.rank_reports([])
        assert [r.rank for r in reports] == [0, 1, 2, 3]
        assert {r.num_blocks for r in reports} == {llm.engine.runner.num_blocks}
        assert all(r.num_used_blocks == 0 for r in reports)
    finally:
        llm.shutdown()
    _assert_gone(pids)


_TORCHRUN_SCRIPT = """
import os, sys
from paged_backend import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tokenizer=sys.argv[2], tensor_parallel_size=2, dtype="float32", device="cpu",
              kv_cache_memory_bytes=1 << 20, log_stats_interval=0)
    # ranks > 0 served the model inside LLM(...) and exited when rank 0 shut down
    assert os.environ["RANK"] == "0"
    out = llm.generate([[1, 5, 9, 33, 7]], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    print("TOKENS", *out[0].outputs[0].token_ids, flush=True)
    llm.shutdown()
"""


def test_torchrun_rank0_is_the_engine(divisible, tokenizer_dir, tmp_path):
    import socket

    script = tmp_path / "run_torchrun.py"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(divisible),
                          tokenizer_dir], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    tokens = [int(t) for t in res.stdout.split("TOKENS", 1)[1].split()]
    assert tokens == _hf_greedy(divisible)[0]


# -- failures and process hygiene ------------------------------------------------------------------


def test_killed_worker_fails_the_engine_quickly(divisible, tokenizer_dir):
    llm = LLM(**_engine_args(divisible, tokenizer_dir, tensor_parallel_size=2, max_model_len=512))
    engine = llm.engine
    (pid,) = engine.runner.worker_pids
    try:
        for i in range(4):
            engine.add_request(f"k{i}", PROMPTS[i % len(PROMPTS)],
                               SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        engine.step()
        killer = threading.Timer(0.2, os.kill, (pid, signal.SIGKILL))
        start = time.monotonic()
        killer.start()
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}, exit code -9\) died"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 20.0
        with pytest.raises(WorkerDiedError, match="rank 1"):  # and it stays failed, at once
            engine.runner.rank_reports([])
    finally:
        llm.shutdown()
    _assert_gone([pid])


_EXIT_SCRIPT = """
import sys
from paged_backend import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tokenizer=sys.argv[2], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20,
              log_stats_interval=0, **{sys.argv[3]: 2})
    out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    print("PIDS", *llm.engine.runner.worker_pids, flush=True)
    # no shutdown: interpreter exit must take the workers down
"""


@pytest.mark.parametrize("size", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_interpreter_exit_leaves_no_worker(divisible, tokenizer_dir, tmp_path, size):
    script = tmp_path / "run_tp.py"
    script.write_text(_EXIT_SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(divisible), tokenizer_dir, size], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    pids = [int(p) for p in res.stdout.split("PIDS", 1)[1].split()]
    assert len(pids) == 1
    _assert_gone(pids)


# -- adapters and CLI pass the size through ------------------------------------------------------


def test_cli_bentoml_and_triton_pass_tensor_parallel_size_and_expert_parallel():
    from paged_backend.adapters.bentoml_service import ServeArgs, service_config
    from paged_backend.adapters.triton_protocol import engine_config_from_model_json

    from paged_backend.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2"])
    assert engine_config_from_args(args).tensor_parallel_size == 2
    assert service_config(ServeArgs(device="cuda", tensor_parallel_size=4))["resources"]["gpu"] == 4
    assert service_config(ServeArgs(device="cpu", tensor_parallel_size=4))["resources"] == {}
    pp = ServeArgs(device="cuda", tensor_parallel_size=2, pipeline_parallel_size=3)
    assert service_config(pp)["resources"]["gpu"] == 6 and pp.engine_config().pipeline_parallel_size == 3
    config, _ = engine_config_from_model_json({"model": "m", "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 2)
    args = build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert engine_config_from_args(args).enable_expert_parallel
    assert not engine_config_from_args(build_parser().parse_args(["generate", "hi"])).enable_expert_parallel
    assert EngineConfig(enable_expert_parallel=True).tensor_parallel_size == 1  # allowed: a no-op there
