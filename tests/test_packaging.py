"""The generic top-level names ``kernels`` and ``adapters`` are installed under the
engine's namespace, and nothing shadows anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json, sys
import paged_backend.kernels as k, paged_backend.adapters as a
import paged_backend.core.scheduler, paged_backend.core.kv_cache_manager, paged_backend.core.block_pool
print(json.dumps({
    "kernels": k.__file__, "adapters": a.__file__,
    "top_kernels": getattr(importlib.util.find_spec("kernels"), "origin", None),
    "top_adapters": getattr(importlib.util.find_spec("adapters"), "origin", None),
    "torch_loaded_by_scheduler": "torch" in sys.modules,
}))
"""


def test_kernels_and_adapters_live_under_paged_backend(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert Path(info["kernels"]).resolve() == ROOT / "paged_backend" / "kernels" / "__init__.py"
    assert Path(info["adapters"]).resolve() == ROOT / "adapters" / "__init__.py"
    # a top-level "kernels"/"adapters", if any, is somebody else's package, never ours
    for name in ("top_kernels", "top_adapters"):
        assert not _ours(info[name])
    assert info["torch_loaded_by_scheduler"] is False


def test_no_kernels_folder_shadows_hugging_faces_from_the_repository_root():
    """transformers imports Hugging Face's ``kernels`` package where it is installed: run from the repository
    root (the root on sys.path), ``import kernels`` must not find a folder of ours."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert not _ours(json.loads(out.stdout)["top_kernels"])


def test_every_subpackage_is_in_the_wheel():
    """The wheel's package list is explicit (``adapters`` maps from outside the package's folder): every
    folder with an ``__init__.py`` under ``paged_backend/`` must be in it, or an installed engine fails to
    import (the editable install of the tests would not notice)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "paged_backend").rglob("__init__.py")}
    assert found - listed == set()
    assert "paged_backend.adapters" in listed


def _ours(origin: str | None) -> bool:
    """Whether a module file is of this repository's sources (an installed package, even in a venv inside
    the checkout, is not)."""
    if origin is None:
        return False
    path = Path(origin).resolve()
    return path.is_relative_to(ROOT) and "site-packages" not in path.parts


def test_console_script_help():
    exe = Path(sys.executable).with_name("paged-backend")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    assert "generate" in out.stdout and "bench" in out.stdout
