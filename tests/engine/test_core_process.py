"""The engine core process (``engine_core_process``): the same outputs as in-process, aborts that free
the core's blocks at once, a killed core that fails every request within seconds, no process left."""

from __future__ import annotations

import asyncio
import gc

import psutil
import pytest
from core_kill import kill_core_under
from paged_backend.adapters.api import AdapterError, EngineAdapter
from smollm2 import PROMPTS, model_dir

from paged_backend import AsyncEngine, EngineConfig, SamplingParams
from paged_backend.engine.core_client import EngineCoreClient
from paged_backend.errors import EngineDeadError
from paged_backend.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow



def _args(**kw: object) -> dict:
    return dict(model=model_dir(), dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20,
                log_stats_interval=0, **kw)

LONG = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)


def _core_children() -> set[int]:
    """This process's spawned children (not multiprocessing's resource tracker)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in cmd and p.status() != psutil.STATUS_ZOMBIE:
            out.add(p.pid)
    return out


def _cli_config(*argv: str) -> EngineConfig:
    import argparse

    from paged_backend.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("source", ["cli", "bentoml", "triton"])
def test_the_flag_reaches_the_config_from_every_front_end(source):
    if source == "cli":
        assert not _cli_config().engine_core_process
        config = _cli_config("--engine-core-process")
    elif source == "bentoml":
        from paged_backend.adapters.bentoml_service import ServeArgs

        assert not ServeArgs().engine_config().engine_core_process
        config = ServeArgs(engine_core_process="true").engine_config()
    else:
        from paged_backend.adapters.triton_protocol import engine_config_from_model_json

        config, ignored = engine_config_from_model_json({"model": "SmolLM2-135M-Instruct", "engine_core_process": True})
        assert not ignored
    assert config.engine_core_process is True


@pytest.mark.parametrize("source", ["cli", "bentoml", "triton"])
def test_several_front_ends_turn_the_shared_core_on(source):
    """--engine-core-shared; BentoML workers > 1; Triton instance_group count > 1 (one count, or gpus)."""
    if source == "cli":
        assert not _cli_config().engine_core_shared
        assert _cli_config("--engine-core-shared").engine_core_shared
    elif source == "bentoml":
        from paged_backend.adapters.bentoml_service import ServeArgs, service_config

        assert not ServeArgs(device="cpu").engine_config().engine_core_shared
        args = ServeArgs(device="cpu", workers=3)
        assert args.engine_config().engine_core_shared and service_config(args)["workers"] == 3
    else:
        from paged_backend.adapters.triton_protocol import instance_count, shared_core_config

        config = EngineConfig(model="SmolLM2-135M-Instruct")
        one = {"instance_group": [{"count": 1, "kind": "KIND_MODEL"}]}
        assert instance_count({}) == instance_count(one) == 1
        assert not shared_core_config(config, one).engine_core_shared
        for several in ({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]},
                        {"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]}):
            assert instance_count(several) == 2
            assert shared_core_config(config, several).engine_core_shared


@pytest.fixture(scope="module")
def client():
    c = EngineCoreClient(EngineConfig(**_args(engine_core_process=True)))
    yield c
    c.shutdown()


async def _tokens(engine, rid: str, prompt, params: SamplingParams) -> tuple:
    """Each sample's tokens, and the prompt and its ids as every delta reports them."""
    outs: dict[int, list[int]] = {}
    prompts = set()
    async for d in engine.generate(rid, prompt, params):
        prompts.add((d.prompt, tuple(d.prompt_token_ids)))
        for c in d.outputs:
            outs.setdefault(c.index, []).extend(c.token_ids)
    return [outs[i] for i in sorted(outs)], prompts


def _same_requests(engine) -> list:
    json_choice = SamplingParams(max_tokens=8, temperature=0,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

    async def main():
        return await asyncio.gather(
            *[_tokens(engine, f"g{i}", p, SamplingParams(max_tokens=8, temperature=0)) for i, p in
              enumerate(PROMPTS[:3])],
            _tokens(engine, "seeded", PROMPTS[3], SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=7)),
            _tokens(engine, "choice", "Is the sky blue? Answer:", json_choice))

    return asyncio.run(main())


def test_outputs_equal_the_in_process_engine(client):
    in_process = AsyncEngine(EngineConfig(**_args()))
    try:
        expected = _same_requests(in_process)
    finally:
        in_process.shutdown()
    got = _same_requests(client)
    assert got == expected
    assert all(len(prompts) == 1 for _, prompts in got)
    assert client.tokenizer.decode(got[-1][0][0], skip_special_tokens=True) in ("yes", "no")  # the grammar crossed


def test_abort_frees_the_blocks_in_the_core_at_once(client):
    before = client.stats()["num_aborted_total"]

    async def main():
        stream = client.generate("long", PROMPTS[4], LONG)
        await stream.__anext__()
        assert client.core_state()["num_free_blocks"] < client.core_state()["num_total_usable"]
        await client.abort("long")
        state, stats = client.core_state(), client.stats()  # nothing awaited in between
        rest = [d async for d in stream]
        return state, stats, rest

    state, stats, rest = asyncio.run(main())
    assert state["num_free_blocks"] == state["num_total_usable"] and state["num_unfinished"] == 0
    assert stats["num_aborted_total"] == before + 1 and stats["num_running"] == 0
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"


def test_shutdown_leaves_no_process(client):
    pid = client.pid
    assert pid in _core_children()
    assert gc.get_freeze_count() > 0  # the serving process's heap, frozen while the reader runs

    async def main():
        stream = client.generate("cut", PROMPTS[0], LONG)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, client.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert not client.is_ready and not client.is_dead
    assert pid not in _core_children() and not _core_children()
    assert gc.get_freeze_count() == 0  # given back with the reader


def test_killed_core_fails_every_request_and_health():
    before = _core_children()
    adapter = EngineAdapter(_args(max_model_len=512, engine_core_process=True), metrics=None)
    adapter.start()
    (pid,) = _core_children() - before
    assert adapter.is_alive and adapter.is_ready

    errors, elapsed = asyncio.run(kill_core_under([(adapter, f"k{i}", PROMPTS[i]) for i in range(3)], pid, LONG))
    try:
        assert elapsed < 5
        assert all(e is not None and e.kind == "unavailable" for e in errors)
        assert not adapter.is_alive and not adapter.is_ready
        assert "killed by signal SIGKILL" in adapter.failure
        with pytest.raises(AdapterError) as new:
            asyncio.run(adapter.complete("Hi", SamplingParams(max_tokens=2)))
        assert new.value.status == 503
    finally:
        adapter.shutdown()
    assert not _core_children() - before


def test_a_core_that_cannot_start_raises_its_error_here():
    before = _core_children()
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size"):
        EngineCoreClient(EngineConfig(**_args(tensor_parallel_size=2, engine_core_process=True)))
    assert not _core_children() - before
