"""Process hygiene checks for the multi-process tests (tensor and pipeline parallelism): a worker is
gone once it is neither running nor a zombie. Import from tests as ``process_checks``."""

from __future__ import annotations

import time
from pathlib import Path


def running(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_gone(pids: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"worker processes still alive: {alive}")
