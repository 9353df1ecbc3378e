"""Pipeline parallelism on the CPU (gloo): layers split into stages, each stage a tensor-parallel
group of its own. Greedy tokens equal the single-process engine's and transformers'; each rank
holds its stage's weights and KV cache only; micro-batches keep both stages busy; blocks are
accounted on every rank after aborts; a dead rank fails the engine naming it and leaves no process;
two torchrun "nodes" on loopback run the same code path."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from family_fixtures import PROMPTS, greedy_tokens, hf_greedy, scale_routers, tiny_llm
from model_fixtures import make_tiny_checkpoint
from process_checks import assert_gone, running

from paged_backend import SamplingParams
from paged_backend.attention.torch_attn import TorchAttentionBackend
from paged_backend.config import EngineConfig
from paged_backend.distributed import PPStage, partition_layers
from paged_backend.models.model_info import ModelInfo
from paged_backend.worker.model_loader import load_model
from paged_backend.worker.tensor_parallel import WorkerDiedError

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """3 layers (an uneven split over 2 stages), 4 q / 2 KV heads, biases, untied LM head."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("pp") / "llama", "LlamaForCausalLM", seed=3,
                                num_hidden_layers=3, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    return path, hf_greedy(path)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """Tied embeddings: the last stage holds the embedding as its LM head."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("pp") / "tied", "LlamaForCausalLM", seed=4,
                                num_hidden_layers=2, tie_word_embeddings=True, vocab_size=255)
    return path, hf_greedy(path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """Qwen3-MoE: a dense first layer, then two routed layers of 8 experts (top-2)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("pp") / "moe", "Qwen3MoeForCausalLM", num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                mlp_only_layers=[0], num_hidden_layers=3)
    scale_routers(path)
    return path, hf_greedy(path)


def _kill_mid_run(engine, pid: int, rank: int) -> None:
    """kill -9 of ``pid`` (rank ``rank``) while requests run: the engine fails naming it within seconds,
    and stays failed."""
    for i in range(4):
        engine.add_request(f"k{i}", PROMPTS[i], LONG)
    engine.step()
    threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank {rank} \(pid {pid}, exit code -9\)") as err:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 20.0
    assert str(err.value).startswith("pipeline-parallel worker")
    with pytest.raises(WorkerDiedError, match=f"rank {rank}"):
        engine.runner.rank_reports([])


def _pp(path: Path, **kw):
    return tiny_llm(path, kv_cache_memory_bytes=1 << 20, **{"pipeline_parallel_size": 2, **kw})


# -- no processes ---------------------------------------------------------------------------------


def test_layer_partition():
    assert partition_layers(3, 2) == [(0, 2), (2, 3)]
    assert partition_layers(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert partition_layers(4, 2, "3,1") == [(0, 3), (3, 4)]
    with pytest.raises(ValueError, match="summing to the model's 4 layers"):
        partition_layers(4, 2, "2,1")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) is larger than the model's 2 layers"):
        partition_layers(2, 3)


def test_config_and_cli_refuse_what_pipeline_parallelism_does_not_run():
    from paged_backend.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "hi", "--pipeline-parallel-size", "2", "--pp-layer-partition",
                                      "3,1", "--tensor-parallel-size", "2"])
    config = engine_config_from_args(args)
    assert (config.pipeline_parallel_size, config.pp_layer_partition, config.tensor_parallel_size) == (2, "3,1", 2)
    assert EngineConfig().pipeline_parallel_size == 1
    for kw, what in ((dict(swap_space=1.0), "swap_space"), (dict(async_scheduling=True), "async_scheduling"),
                     (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config")):
        with pytest.raises(ValueError, match=f"{what} is not supported with pipeline_parallel_size > 1"):
            EngineConfig(pipeline_parallel_size=2, **kw)
    with pytest.raises(ValueError, match="needs 2 positive layer counts"):
        EngineConfig(pipeline_parallel_size=2, pp_layer_partition="4")
    with pytest.raises(ValueError, match="needs pipeline_parallel_size > 1"):
        EngineConfig(pp_layer_partition="4")


def test_a_stage_builds_and_loads_only_its_layers(llama, tied):
    """No rank holds another stage's weights: the first stage embeds, the last has the norm and LM head
    (with tied embeddings: the embedding, as the head)."""
    def params(path: Path, stage: PPStage) -> set[str]:
        info = ModelInfo.from_dir(path)
        model = load_model(path, info, torch.float32, "cpu", TorchAttentionBackend(), pp=stage)
        return {n for n, _ in model.named_parameters()}

    first = params(llama[0], PPStage(0, 2, 0, 1, 0, 1, 3))
    last = params(llama[0], PPStage(1, 2, 0, 1, 1, 3, 3))
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"1", "2"}
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first and "model.norm.weight" not in first
    assert "model.embed_tokens.weight" not in last and {"lm_head.weight", "model.norm.weight"} <= last
    tied_last = params(tied[0], PPStage(1, 2, 0, 1, 1, 2, 2))
    assert "model.embed_tokens.weight" in tied_last and "model.layers.0.mlp.down_proj.weight" not in tied_last


def test_every_stage_runs_its_part_of_the_profiling_prefill_alone(llama):
    """On CUDA each rank sizes its KV budget from a dummy prefill: a stage runs it without the others
    (zero activations in, nothing sent: here no process group exists, so any send would fail)."""
    import torch.distributed as dist

    from paged_backend.distributed import PipelineGroups
    from paged_backend.worker.pipeline_parallel import PipelineStageRunner

    path, _ = llama
    info = ModelInfo.from_dir(path)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", pipeline_parallel_size=3)
    for p, (start, end) in enumerate(partition_layers(3, 3)):
        stage = PPStage(p, 3, 0, 1, start, end, 3)
        runner = PipelineStageRunner(config, path, info, torch.device("cpu"), torch.float32,
                                     PipelineGroups(None, None, stage))
        assert len(runner.kv_specs) == 1 and (runner.model.lm_head is not None) == stage.is_last
        runner.warm_up_prefill()
    assert not dist.is_initialized()


# -- PP = 2 ----------------------------------------------------------------------------------------


def test_pp2_matches_tp1_and_hf_overlaps_stages_and_accounts_blocks(llama):
    path, expected = llama
    tp1 = tiny_llm(path, kv_cache_memory_bytes=1 << 20)
    assert greedy_tokens(tp1) == expected
    llm = _pp(path, pp_layer_partition="1,2")
    engine, runner = llm.engine, llm.engine.runner
    pids = runner.worker_pids
    try:
        assert len(pids) == 1 and running(pids[0])
        assert greedy_tokens(llm) == expected
        # each rank's KV cache holds its stage's layers; the block count is the minimum: stage 1's 2 layers
        reports = runner.rank_reports([])
        assert [(r.rank, r.layers) for r in reports] == [(0, (0, 1)), (1, (1, 3))]
        assert {r.num_blocks for r in reports} == {engine.runner.num_blocks}
        per_layer = tp1.engine.runner.bytes_per_block // 3
        assert engine.runner.num_blocks == (1 << 20) // (2 * per_layer)  # the budget over stage 1's 2 layers

        # micro-batches: two steps in flight, stage 0 running step k + 1 while stage 1 runs step k
        assert engine.pipeline.max_in_flight == 2 and runner.max_in_flight == 2
        traces = runner.stage_traces()
        assert [t["rank"] for t in traces] == [0, 1] and traces[0]["steps"] == traces[1]["steps"] > 0
        stage0 = {seq: (a, b) for seq, a, b in traces[0]["intervals"]}
        overlapped = [seq for seq, a, b in traces[1]["intervals"]
                      if seq + 1 in stage0 and stage0[seq + 1][0] < b and a < stage0[seq + 1][1]]
        assert overlapped, traces  # typically most steps (20 of 24 on 2 idle cores); any shows the concurrency

        # logprobs and prompt logprobs (rows of the logits the last stage sends) agree with TP = 1
        lp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
        got, ref = (x.generate([PROMPTS[2]], lp, use_tqdm=False)[0] for x in (llm, tp1))
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(got.prompt_logprobs[1:] + got.outputs[0].logprobs,
                        ref.prompt_logprobs[1:] + ref.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)

        # n = 2: the samples fork when the prompt's step lands (forked blocks, copy-on-write on every stage)
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True,
                                                        n=2), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[exp, exp] for exp in expected[:2]]

        # aborts, some with a step in flight: every rank holds exactly the blocks rank 0 handed out
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, LONG)
        for _ in range(3):
            engine.step()
        assert engine.pipeline.in_flight  # steps are in flight while the aborts come
        engine.abort_request("r1")
        engine.step()
        engine.abort_request("r3")
        for _ in range(4):
            engine.step()
        used = engine.kv.block_pool.num_total_usable - engine.kv.num_free_blocks
        assert used > 0
        reports = runner.rank_reports([r.request_id for r in engine.scheduler.running])
        assert [r.num_used_blocks for r in reports] == [used, used]
        engine.abort_request("r0")
        engine.abort_request("r2")
        while engine.has_unfinished_requests() or engine.pipeline.in_flight:
            engine.step()
        assert engine.kv.num_free_blocks == engine.kv.block_pool.num_total_usable
        assert all(r.num_used_blocks == 0 for r in runner.rank_reports([]))
        assert greedy_tokens(llm) == expected  # and the engine goes on
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_pp2_moe_greedy_equals_hf(moe):
    path, expected = moe
    llm = _pp(path)
    pids = llm.engine.runner.worker_pids
    try:
        assert greedy_tokens(llm) == expected
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_pp2_preemption_with_steps_in_flight_keeps_the_tokens(llama):
    """A cache so small that requests are preempted (with these limits, one of them while its token is in
    flight: it is readmitted once the token lands)."""
    path, expected = llama
    llm = tiny_llm(path, pipeline_parallel_size=2, num_gpu_blocks_override=7, max_num_batched_tokens=16)
    pids = llm.engine.runner.worker_pids
    try:
        assert greedy_tokens(llm) == expected
        assert llm.engine.stats.num_preemptions_total > 0
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.block_pool.num_total_usable
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_pp2_async_engine_concurrent_chunked_tied(tied):
    """The serving loop (AsyncEngine) with concurrent streams, prompts in 16-token chunks, a tied LM head."""
    import asyncio

    from smollm2 import model_dir

    from paged_backend.engine.async_engine import AsyncEngine

    path, expected = tied
    engine = AsyncEngine(EngineConfig(model=str(path), tokenizer=model_dir(), dtype="float32", device="cpu",
                                      kv_cache_memory_bytes=1 << 20, log_stats_interval=0, seed=0,
                                      pipeline_parallel_size=2, max_num_batched_tokens=16))
    pids = engine.engine.runner.worker_pids
    params = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(f"a{i}", prompt, params):
            tokens += delta.outputs[0].token_ids if delta.outputs else []
        return tokens

    async def every() -> list[list[int]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    try:
        assert asyncio.run(every()) == expected
        assert engine.engine.pipeline.max_in_flight == 2
    finally:
        engine.shutdown()
    assert_gone(pids)


# -- TP = 2 x PP = 2 -------------------------------------------------------------------------------


def test_tp2_pp2_llama_matches_hf_then_a_killed_stage_rank_fails_the_engine(llama):
    path, expected = llama
    llm = _pp(path, tensor_parallel_size=2, max_model_len=512)
    engine = llm.engine
    pids = engine.runner.worker_pids
    try:
        assert len(pids) == 3
        assert greedy_tokens(llm) == expected
        reports = engine.runner.rank_reports([])
        assert [(r.rank, r.layers, r.kv_cache_shape[3]) for r in reports] == [
            (0, (0, 2), 1), (1, (0, 2), 1), (2, (2, 3), 1), (3, (2, 3), 1)]  # one KV head per TP rank
        assert [r.pid for r in reports[1:]] == pids

        _kill_mid_run(engine, pids[2], 3)  # the last stage's TP rank 1
    finally:
        llm.shutdown()
    assert_gone(pids)
    assert not [c for c in multiprocessing.active_children() if c.pid in pids]


def test_tp2_pp2_moe_with_expert_parallel(moe):
    path, expected = moe
    llm = _pp(path, tensor_parallel_size=2, enable_expert_parallel=True)
    pids = llm.engine.runner.worker_pids
    try:
        assert greedy_tokens(llm) == expected
        assert llm.engine.runner.local.model.model.layers[1].mlp.experts.w13.shape[0] == 4  # experts 0..3 here
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_pp3_matches_hf_then_a_killed_middle_stage_fails_the_engine(llama):
    """Three stages of one layer each; kill -9 of the middle one: the stages around it fail in turn, the
    engine names it at once."""
    path, expected = llama
    llm = _pp(path, pipeline_parallel_size=3, max_model_len=512)
    engine = llm.engine
    pids = engine.runner.worker_pids
    try:
        assert greedy_tokens(llm) == expected
        assert [r.layers for r in engine.runner.rank_reports([])] == [(0, 1), (1, 2), (2, 3)]
        _kill_mid_run(engine, pids[0], 1)
    finally:
        llm.shutdown()
    assert_gone(pids)


# -- torchrun: two nodes on loopback ---------------------------------------------------------------


_TORCHRUN_SCRIPT = """
import os, sys
from paged_backend import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tokenizer=sys.argv[2], pipeline_parallel_size=2, dtype="float32", device="cpu",
              kv_cache_memory_bytes=1 << 20, log_stats_interval=0)
    # rank 1 (the second node) served stage 1 inside LLM(...) and exited when rank 0 shut down
    assert os.environ["RANK"] == "0"
    out = llm.generate([[5, 17, 33, 4, 9, 100, 21]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    print("TOKENS", *out[0].outputs[0].token_ids, flush=True)
    llm.shutdown()
"""


def test_torchrun_two_nodes_on_loopback(llama, tmp_path):
    from smollm2 import model_dir

    path, expected = llama
    script = tmp_path / "run_pp.py"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                               str(port), str(script), str(path), str(model_dir())],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [n.communicate(timeout=180) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    tokens = [int(t) for t in outs[0][0].split("TOKENS", 1)[1].split()]
    assert tokens == expected[0]
