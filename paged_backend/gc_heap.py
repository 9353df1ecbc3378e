"""Keep the garbage collector off the startup heap while the engine loop runs.

A full (oldest-generation) collection walks every tracked object in the process: with
torch and transformers imported that is millions of objects and a pause of hundreds of
milliseconds, and the engine's per-step allocations trigger one every few seconds.
``gc.freeze()`` moves everything alive now into a permanent generation that collections
skip (an O(1) list splice, no collection); objects made during the loop are collected as
usual. vLLM's engine core does the same after start-up.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the current heap for the duration; unfreeze after unless someone else had frozen
    objects already (then theirs and ours stay frozen, as the application chose)."""
    ours = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()
