"""Starting and stopping a real ``bentoml serve`` of bentos/smollm2 for the server tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

BENTO_DIR = Path(__file__).resolve().parents[1] / "bentos" / "smollm2"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.log_text()[-5000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bentoml_env(tmp: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ, BENTOML_DO_NOT_TRACK="true", BENTOML_HOME=str(tmp / "bentoml-home"), **(extra or {}))


def bentoml_exe() -> str:
    exe = Path(sys.executable).with_name("bentoml")
    return str(exe) if exe.exists() else shutil.which("bentoml") or "bentoml"


def start(tmp: Path, args: Mapping[str, object], *, env: Mapping[str, str] | None = None) -> Server:
    """``bentoml serve`` in its own session (process group), logging to ``tmp/serve.log``."""
    port = free_port()
    log = tmp / "serve.log"
    flags = [a for k, v in args.items() for a in ("--arg", f"{k}={v}")]
    with open(log, "wb") as out:
        proc = subprocess.Popen([bentoml_exe(), "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                                cwd=BENTO_DIR, env=bentoml_env(tmp, env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Server(proc, port, log)


def wait_ready(server: Server, timeout: float = 600) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"bentoml serve exited early:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"server not ready in time:\n{server.log_tail()}")


def stop(server: Server, timeout: float = 60) -> bool:
    """SIGTERM, then SIGKILL of the whole group after ``timeout``; True if SIGTERM was enough."""
    if server.proc.poll() is not None:
        return True
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        return False


@contextlib.contextmanager
def serving(tmp: Path, args: Mapping[str, object], *, env: Mapping[str, str] | None = None) -> Iterator[Server]:
    """A ready ``bentoml serve`` for the block's duration, stopped by SIGTERM after it (asserted)."""
    srv = start(tmp, args, env=env)
    try:
        yield wait_ready(srv)
    finally:
        assert stop(srv), "bentoml serve did not stop on SIGTERM"
