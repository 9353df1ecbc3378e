"""Run a real ``tritonserver`` on this machine from the ``nvidia-pytriton`` wheel (CPU ok).

The wheel carries Triton (``pytriton/tritonserver/bin/tritonserver``), the Python backend
and one backend stub per Python version. ``prepare_runtime`` assembles a backend
directory with the stub of this Python and, because that stub is built against NumPy 1.x,
a Python environment layered over this one with NumPy < 2 first on ``sys.path`` when this
environment has NumPy 2 (the stub finds its Python as ``python3`` on PATH).
``TritonServer`` starts the server on free loopback ports and stops it with SIGTERM.

    python -m paged_backend.adapters.triton_local --model-repository adapters/triton_model_repository
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import venv
from dataclasses import dataclass
from pathlib import Path

from paged_backend.models.default_model import cache_dir

NUMPY1_SPEC = "numpy>=1.21,<2"


@dataclass(frozen=True)
class TritonDist:
    """Where the pytriton wheel put Triton's pieces."""

    server: Path
    python_backend: Path
    stubs: Path
    libs: Path

    @classmethod
    def find(cls) -> TritonDist:
        spec = importlib.util.find_spec("pytriton")  # located, not imported (its deps are not needed)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("tritonserver comes from the nvidia-pytriton wheel: "
                                    "pip install --no-deps nvidia-pytriton==0.7.0")
        root = Path(next(iter(spec.submodule_search_locations)))
        dist = cls(root / "tritonserver/bin/tritonserver", root / "tritonserver/backends/python",
                   root / "tritonserver/python_backend_stubs", root.parent / "nvidia_pytriton.libs")
        if not dist.server.is_file():
            raise FileNotFoundError(f"no tritonserver binary at {dist.server}")
        return dist


@dataclass(frozen=True)
class Runtime:
    """A prepared backend directory and the environment tritonserver runs with."""

    backend_dir: Path
    env: dict[str, str]
    server: Path


def _numpy_major(python: str) -> int:
    out = subprocess.run([python, "-c", "import numpy; print(numpy.__version__)"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{python} cannot import numpy: {out.stderr.strip()}")
    return int(out.stdout.strip().split(".")[0])


def ensure_numpy1(target: Path | None = None) -> Path:
    """A directory holding NumPy 1.x (installed once with pip) for the backend stub."""
    target = target or cache_dir() / "triton-numpy1"
    if (target / "numpy" / "__init__.py").is_file():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp),
                    NUMPY1_SPEC], check=True)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _overlay_env(dest: Path, numpy1: Path) -> Path:
    """A venv whose python3 sees NumPy 1.x first, then this environment's site-packages."""
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(dest)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(dest), "platbase": str(dest)}))
    site.mkdir(parents=True, exist_ok=True)
    (site / "00_numpy1.pth").write_text(f"{numpy1}\n")
    here = sysconfig.get_path("purelib")
    (site / "zz_parent_env.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return dest / "bin"


def prepare_runtime(workdir: str | Path, dist: TritonDist | None = None) -> Runtime:
    """Backend directory + environment for ``tritonserver`` under ``workdir`` (this Python's stub)."""
    dist = dist or TritonDist.find()
    workdir = Path(workdir)
    backend = workdir / "backends" / "python"
    if backend.exists():
        shutil.rmtree(backend)
    shutil.copytree(dist.python_backend, backend, ignore=shutil.ignore_patterns("__pycache__"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist.stubs / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"the pytriton wheel has no Python backend stub for Python {version}")
    shutil.copy2(stub, backend / "triton_python_backend_stub")
    bin_dir = Path(sys.executable).parent
    if _numpy_major(sys.executable) >= 2:
        bin_dir = _overlay_env(workdir / "pyenv", ensure_numpy1())
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(dist.libs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTHONHOME", None)
    return Runtime(workdir / "backends", env, dist.server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """``tritonserver`` on loopback with free ports; a context manager that always stops it."""

    def __init__(self, model_repository: str | Path, *, workdir: str | Path | None = None,
                 log_file: str | Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.model_repository = Path(model_repository)
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="paged-triton-")
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp.name)
        self.log_file = Path(log_file) if log_file is not None else self.workdir / "tritonserver.log"
        self.extra_args = extra_args
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self, runtime: Runtime) -> list[str]:
        return [str(runtime.server), f"--model-repository={self.model_repository}",
                f"--backend-directory={runtime.backend_dir}", "--http-address=127.0.0.1",
                "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1", f"--http-port={self.http_port}",
                f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}", "--allow-gpu-metrics=false",
                *self.extra_args]

    def launch(self) -> TritonServer:
        """Start the process and return at once (the model loads meanwhile; see wait_ready)."""
        runtime = prepare_runtime(self.workdir)
        self._log = open(self.log_file, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.command(runtime), env=runtime.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def start(self, timeout: float = 600.0) -> TritonServer:
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s; log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (Triton unloads models: finalize drains), SIGKILL if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        return self.proc.returncode

    def __enter__(self) -> TritonServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_backend.adapters.triton_local", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", default=str(Path(__file__).with_name("triton_model_repository")))
    p.add_argument("--prepare-only", action="store_true", help="set up the backend directory and exit")
    p.add_argument("--workdir", default=None, help="where the backend directory goes (default: a temp dir)")
    ns = p.parse_args(argv)
    if ns.prepare_only:  # CI's setup step: fetch NumPy 1.x for the stub now, check the wheel's pieces
        if ns.workdir:
            print(prepare_runtime(ns.workdir).backend_dir)
        else:
            with tempfile.TemporaryDirectory(prefix="paged-triton-") as tmp:
                prepare_runtime(tmp)
            print("tritonserver runtime ok")
        return 0
    server = TritonServer(ns.model_repository, workdir=ns.workdir, log_file="/dev/stderr")
    with server:
        print(f"tritonserver ready: http {server.http_url}  grpc {server.grpc_url}  metrics {server.metrics_url}",
              flush=True)
        try:
            server.proc.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
