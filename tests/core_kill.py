"""Killing an engine core process under running requests (the engine core process tests)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from paged_backend.adapters.api import AdapterError, EngineAdapter

from paged_backend import SamplingParams


async def _consume(adapter: EngineAdapter, rid: str, prompt: str, params: SamplingParams) -> AdapterError | None:
    try:
        async for _ in adapter.generate(prompt, params, request_id=rid):
            pass
    except AdapterError as exc:
        return exc
    return None


async def kill_core_under(requests: list[tuple[EngineAdapter, str, str]], pid: int,
                          params: SamplingParams) -> tuple[list[AdapterError | None], float]:
    """Start each (adapter, request id, prompt), SIGKILL the core ``pid`` once all run there: what each request
    ended with (its AdapterError, None if it finished) and the seconds from the kill to the last end."""
    tasks = [asyncio.create_task(_consume(ad, rid, prompt, params)) for ad, rid, prompt in requests]
    while requests[0][0].stats().get("num_running", 0) < len(requests):  # the core's counts, in every front end
        await asyncio.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    errors = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return errors, time.monotonic() - t0
