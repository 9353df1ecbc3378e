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
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Objects some Python builds freeze before any user code runs (375 on the H200 image's
# Python 3.12, 0 on this project's CI): not an application's choice to keep a heap frozen.
_STARTUP_FROZEN = gc.get_freeze_count()


# frozen_heap sections open now (engine loop threads, engine core readers; they may overlap in any order), and
# whether the first of them found nothing frozen by the application: the last to end then unfreezes
_lock = threading.Lock()
_open = 0
_ours = False


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the current heap for the duration; unfreeze after unless the application had frozen
    objects since start-up (then theirs and ours stay frozen, as it chose).

    Sections may overlap (two engines in one process, each loop or reader thread in one): the heap is
    unfrozen when the last of them ends, whichever order they end in.

    Objects frozen at interpreter start-up are unfrozen with ours (Python has no per-object
    unfreeze): keeping them would keep everything frozen for good, and with it every engine
    a process deletes (its reference cycles are never collected).
    """
    global _open, _ours
    with _lock:
        if _open == 0:
            _ours = gc.get_freeze_count() <= _STARTUP_FROZEN
        _open += 1
        gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0 and _ours:
                gc.unfreeze()
