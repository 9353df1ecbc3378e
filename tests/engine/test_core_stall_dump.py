"""A stalled engine core loop writes every thread's stack to its stderr, once; a loop that only waits for
commands writes nothing."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import pytest
from smollm2 import model_dir

from paged_backend import EngineConfig, SamplingParams
from paged_backend.engine import core_process
from paged_backend.engine.core_process import CoreOutputs, CoreStarted, EngineCore
from paged_backend.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def _stall() -> None:
    time.sleep(1.5)  # three times the dump's limit


def test_a_step_that_hangs_dumps_the_stacks_and_waiting_does_not(monkeypatch, capfd):
    monkeypatch.setenv(core_process.STALL_DUMP_ENV, "0.5")
    engine = LLMEngine(EngineConfig(model=model_dir(), dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
                                    log_stats_interval=0))
    step = engine.step
    calls = []

    def slow_step():
        calls.append(1)
        if len(calls) == 2:
            _stall()
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    core = EngineCore(engine)
    ours, theirs = Pipe()
    core.adopt(theirs)
    assert isinstance(ours.recv(), CoreStarted)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    time.sleep(1.0)  # idle: the loop waits for commands, which is no stall
    assert "Timeout" not in capfd.readouterr().err

    prep = engine.inputs.process("r", "The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    ours.send([("add", prep)])
    done = False
    while not done:
        msg: CoreOutputs = ours.recv()
        done = any(core_process.unpack_output(o).finished for o in msg.outputs)
    err = capfd.readouterr().err
    dumps = err.split("Timeout (0:00:00.500000)!")[1:]
    # one dump for the stall (a slow first step may add one of its own), the stack down to the core's loop
    stalled = [d for d in dumps if "in _stall" in d]
    assert len(stalled) == 1 and "in slow_step" in stalled[0] and "core_process.py" in stalled[0], err
    time.sleep(1.0)  # idle again: nothing more is written
    assert "Timeout" not in capfd.readouterr().err
    ours.send([("shutdown", None)])
    loop.join(10)
    assert not loop.is_alive()
    engine.shutdown()
