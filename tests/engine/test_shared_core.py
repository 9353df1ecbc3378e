"""A shared engine core (``engine_core_shared``): several front ends on one core process. Each gets its own
greedy outputs (equal to in-process), the same request id from two front ends does not clash, a front end
that is killed has its requests aborted and their blocks freed while the others stream on, a dead core fails
every front end's requests and health, a front end that stops reading is dropped (its requests aborted) while the
others stream on, and the core leaves with its last front end."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import psutil
import pytest
from core_kill import kill_core_under
from paged_backend.adapters.api import AdapterError, EngineAdapter
from smollm2 import PROMPTS, model_dir

from paged_backend import AsyncEngine, EngineConfig, SamplingParams
from paged_backend.engine.core_client import RUN_DIR_ENV, CorePaths, EngineCoreClient

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0)
LONG = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)
OURS = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)


def _args(**kw: object) -> dict:
    return dict(model=model_dir(), dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20,
                log_stats_interval=0, **kw)


@pytest.fixture(autouse=True)
def run_dir(tmp_path_factory, monkeypatch):
    """The shared cores' sockets, keys and locks in a fresh directory (front ends started here inherit it)."""
    path = tmp_path_factory.mktemp("run")
    monkeypatch.setenv(RUN_DIR_ENV, str(path))
    return path


def _core_processes() -> set[int]:
    """Live shared cores started from this process."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "paged_backend.engine.core_process" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            continue
    return out


async def _tokens(engine, rid: str, prompt: str, params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for d in engine.generate(rid, prompt, params):
        out += d.outputs[0].token_ids
    return out


def test_two_front_ends_on_one_core_same_ids_and_last_one_out_stops_it():
    config = EngineConfig(**_args(engine_core_shared=True))
    in_process = AsyncEngine(EngineConfig(**_args()))
    try:
        async def expected():
            return await asyncio.gather(*[_tokens(in_process, f"e{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4])])

        want = asyncio.run(expected())
    finally:
        in_process.shutdown()

    a = EngineCoreClient(config)
    paths = CorePaths.of(config)
    with pytest.raises(AuthenticationError):  # not a front end: refused, and the core goes on accepting
        Client(str(paths.socket), family="AF_UNIX", authkey=b"wrong")
    with socket.socket(socket.AF_UNIX) as s:  # connects, then leaves during the handshake
        s.connect(str(paths.socket))
    b = EngineCoreClient(config)
    try:
        assert a.pid == b.pid and a.client_id != b.client_id
        assert _core_processes() == {a.pid}  # the model loaded once
        assert a.core_state()["num_clients"] == 2

        async def both():  # the same ids from both front ends, at once
            return await asyncio.gather(*[_tokens(a, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:2])],
                                        *[_tokens(b, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[2:4])])

        assert asyncio.run(both()) == want
        state = a.core_state()
        assert state["num_free_blocks"] == state["num_total_usable"] and state["num_unfinished"] == 0

        b.shutdown()  # detaches: the core serves on
        assert a.core_state()["num_clients"] == 1
        assert asyncio.run(_tokens(a, "again", PROMPTS[0], GREEDY)) == want[0]
    finally:
        b.shutdown()
        a.shutdown()
    assert not _core_processes()
    assert not CorePaths.of(config).socket.exists()


FRONT_END = """
import asyncio, sys
from paged_backend import EngineConfig, SamplingParams
from paged_backend.engine.core_client import EngineCoreClient

client = EngineCoreClient(EngineConfig.model_validate_json(sys.argv[1]))
params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)

async def stream(rid):
    async for d in client.generate(rid, "The capital of France is", params):
        print(rid, flush=True)

async def main():
    await asyncio.gather(stream("x"), stream("y"))

asyncio.run(main())
"""


def test_a_killed_front_end_has_its_requests_aborted_while_another_streams():
    config = EngineConfig(**_args(engine_core_shared=True, max_model_len=1024))
    a = EngineCoreClient(config)
    other = subprocess.Popen([sys.executable, "-c", FRONT_END, config.model_dump_json()], stdout=subprocess.PIPE,
                             text=True)
    try:
        aborted_before = a.stats()["num_aborted_total"]

        async def main():
            seen: set[str] = set()
            while seen != {"x", "y"}:  # the other front end streams both of its requests
                seen.add((await asyncio.to_thread(other.stdout.readline)).strip())
            stream = a.generate("x", PROMPTS[0], OURS)  # the same request id as one of the other's: its own
            tokens = list((await stream.__anext__()).outputs[0].token_ids)
            assert a.core_state()["num_unfinished"] == 3
            other.kill()
            deadline = time.monotonic() + 5
            async for d in stream:  # ours streams on while the other's are aborted
                tokens += d.outputs[0].token_ids
                if time.monotonic() < deadline:
                    state = a.core_state()
                    if state["num_unfinished"] == 1:
                        deadline = 0.0
                        assert state["num_clients"] == 1
                        assert a.stats()["num_aborted_total"] == aborted_before + 2
                        assert 0 < state["num_total_usable"] - state["num_free_blocks"] <= OURS.max_tokens // 16 + 2
            assert deadline == 0.0, "the killed front end's requests were not aborted within 5 s"
            assert d.finished and d.outputs[0].finish_reason == "length"
            return tokens

        assert len(asyncio.run(main())) == OURS.max_tokens
        state = a.core_state()
        assert state["num_free_blocks"] == state["num_total_usable"] and state["num_unfinished"] == 0

        async def abort_one():  # an abort from a shared core's front end frees the blocks at once
            stream = a.generate("cut", PROMPTS[1], LONG)
            await stream.__anext__()
            await a.abort("cut")
            return a.core_state()

        state = asyncio.run(abort_one())
        assert state["num_free_blocks"] == state["num_total_usable"] and state["num_unfinished"] == 0
    finally:
        other.kill()
        other.wait()
        a.shutdown()
    assert not _core_processes()


def test_a_dead_core_fails_every_front_end_and_health_then_a_new_one_starts():
    args = _args(max_model_len=512, engine_core_shared=True)
    owner = EngineAdapter(args, metrics=None)  # starts the core
    attached = EngineAdapter(args, metrics=None)
    owner.start()
    attached.start()
    (pid,) = _core_processes()
    assert owner.model_info()["engine_core_pid"] == attached.model_info()["engine_core_pid"] == pid

    try:
        errors, elapsed = asyncio.run(kill_core_under([(owner, "same", PROMPTS[0]), (attached, "same", PROMPTS[1])],
                                                      pid, LONG))
        assert elapsed < 5
        assert all(e is not None and e.kind == "unavailable" for e in errors)
        assert not owner.is_alive and not attached.is_alive and not owner.is_ready
        assert "engine core process was killed by signal SIGKILL" in owner.failure
        assert f"engine core process (pid {pid}) is gone" in attached.failure
        with pytest.raises(AdapterError) as new:
            asyncio.run(attached.complete("Hi", SamplingParams(max_tokens=2)))
        assert new.value.status == 503
    finally:
        owner.shutdown()
        attached.shutdown()
    # its socket is left behind: the next front end starts a new core
    fresh = EngineCoreClient(EngineConfig(**args))
    try:
        assert fresh.pid != pid and _core_processes() == {fresh.pid}
        assert len(asyncio.run(_tokens(fresh, "after", PROMPTS[0], GREEDY))) == GREEDY.max_tokens
    finally:
        fresh.shutdown()
    assert not _core_processes()


def test_a_shared_core_that_cannot_start_raises_its_error_in_the_front_end():
    config = EngineConfig(**_args(tensor_parallel_size=2, engine_core_shared=True))
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size"):
        EngineCoreClient(config)
    assert not _core_processes() and not CorePaths.of(config).socket.exists()


def test_a_run_directory_others_can_read_is_refused(run_dir):
    from paged_backend.engine.core_client import run_dir as core_run_dir

    assert core_run_dir() == run_dir and not run_dir.stat().st_mode & 0o077
    run_dir.chmod(0o755)  # the key file would be for everyone to find
    with pytest.raises(PermissionError, match="must belong to this user"):
        EngineCoreClient(EngineConfig(**_args(engine_core_shared=True)))
    assert not _core_processes()


STALLED_FRONT_END = """
import asyncio, sys
from paged_backend import EngineConfig, SamplingParams
from paged_backend.engine.core_client import EngineCoreClient

client = EngineCoreClient(EngineConfig.model_validate_json(sys.argv[1]))
# 20 logprobs per token: its messages are large, so its socket buffer fills within a few steps once it stops reading
params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0, logprobs=20)

async def stream(rid):
    async for d in client.generate(rid, "The capital of France is", params):
        print(rid, flush=True)

async def main():
    await asyncio.gather(*(stream(f"s{i}") for i in range(4)))

asyncio.run(main())
"""


def test_a_front_end_that_stops_reading_is_dropped_while_another_streams(monkeypatch):
    from paged_backend.engine.core_process import STALL_ENV

    monkeypatch.setenv(STALL_ENV, "2")  # the core inherits it from the front end that starts it
    config = EngineConfig(**_args(engine_core_shared=True, max_model_len=1024))
    a = EngineCoreClient(config)
    stalled = subprocess.Popen([sys.executable, "-c", STALLED_FRONT_END, config.model_dump_json()],
                               stdout=subprocess.PIPE, text=True)
    try:
        aborted_before = a.stats()["num_aborted_total"]
        seen: set[str] = set()
        while seen != {f"s{i}" for i in range(4)}:  # all four stream, then the process stops (not dead)
            seen.add(stalled.stdout.readline().strip())
        stalled.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        # ours streams to the end (its sends do not wait behind the stopped one's) ...
        tokens = asyncio.run(_tokens(a, "ours", PROMPTS[0], OURS))
        assert len(tokens) == OURS.max_tokens
        # ... and the stopped front end is dropped once a send to it has waited 2 s: its requests aborted
        state = a.core_state()
        while state["num_clients"] != 1 and time.monotonic() - t0 < 60:
            time.sleep(0.2)
            state = a.core_state()
        assert state["num_clients"] == 1 and state["num_unfinished"] == 0
        assert state["num_free_blocks"] == state["num_total_usable"]
        assert a.stats()["num_aborted_total"] == aborted_before + 4
        stalled.send_signal(signal.SIGCONT)  # it finds its connection closed: its requests fail, it exits
        assert stalled.wait(60) != 0
        assert len(asyncio.run(_tokens(a, "after", PROMPTS[1], GREEDY))) == GREEDY.max_tokens
    finally:
        stalled.send_signal(signal.SIGCONT)
        stalled.kill()
        stalled.wait()
        a.shutdown()
    assert not _core_processes()
