"""Write a Triton model repository that serves paged-backend (vllm_backend's layout).

    <repo>/<model_name>/config.pbtxt      backend: "python", decoupled, custom metrics on,
                                          ENABLE_VLLM_HEALTH_CHECK on request
    <repo>/<model_name>/1/model.py        imports paged_backend.adapters.triton_backend
    <repo>/<model_name>/1/model.json      engine arguments, vLLM's names

``python -m paged_backend.adapters.triton_repo OUT --model SmolLM2-135M-Instruct
--engine-arg max_model_len=2048`` writes one; the sample repository shipped in
``adapters/triton_model_repository`` is exactly this command's default output.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .triton_protocol import MODEL_JSON, engine_config_from_model_json

DEFAULT_MODEL_NAME = "paged_llm"
DEFAULT_ENGINE_ARGS: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "max_model_len": 2048,
                                       "gpu_memory_utilization": 0.9}
SAMPLE_REPOSITORY = Path(__file__).with_name("triton_model_repository")

_MODEL_PY = '''"""Triton model: the paged-backend engine behind vllm_backend's inputs and outputs."""

from paged_backend.adapters.triton_backend import TritonPythonModel

__all__ = ["TritonPythonModel"]
'''


def config_pbtxt(*, instance_kind: str = "KIND_MODEL", instance_count: int = 1, report_metrics: bool = True,
                 health_check: bool = False) -> str:
    """The model configuration; inputs and outputs are filled by ``auto_complete_config``.

    ``health_check`` sets vllm_backend's ``ENABLE_VLLM_HEALTH_CHECK``: a dead engine unloads the
    model (Triton reports it not ready; the server needs ``--model-control-mode=explicit``).
    ``instance_count`` > 1: that many model instances, front ends of one shared engine core process."""
    text = (
        'backend: "python"\n'
        "max_batch_size: 0\n"
        "model_transaction_policy {\n  decoupled: true\n}\n"
        f"instance_group [\n  {{\n    count: {instance_count}\n    kind: {instance_kind}\n  }}\n]\n"
        "parameters {\n"
        '  key: "REPORT_CUSTOM_METRICS"\n'
        f'  value: {{ string_value: "{"true" if report_metrics else "false"}" }}\n'
        "}\n"
    )
    if health_check:
        text += 'parameters {\n  key: "ENABLE_VLLM_HEALTH_CHECK"\n  value: { string_value: "true" }\n}\n'
    return text


def write_model_repository(repo: str | Path, *, model_name: str = DEFAULT_MODEL_NAME,
                           engine_args: Mapping[str, Any] | None = None, instance_kind: str = "KIND_MODEL",
                           instance_count: int = 1, report_metrics: bool = True, health_check: bool = False) -> Path:
    """Write (or overwrite) one model into ``repo``; returns the model's directory."""
    args = dict(DEFAULT_ENGINE_ARGS if engine_args is None else engine_args)
    engine_config_from_model_json(args)  # refuse a model.json the backend would refuse
    model_dir = Path(repo) / model_name
    version = model_dir / "1"
    version.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(instance_kind=instance_kind, instance_count=instance_count,
                                                         report_metrics=report_metrics, health_check=health_check))
    (version / "model.py").write_text(_MODEL_PY)
    (version / MODEL_JSON).write_text(json.dumps(args, indent=2) + "\n")
    return model_dir


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_backend.adapters.triton_repo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", help="model repository directory to write into")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="Triton model name")
    p.add_argument("--model", default=DEFAULT_ENGINE_ARGS["model"], help="HF model dir or the default model")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine argument for model.json (vLLM's names), repeatable")
    p.add_argument("--instance-kind", default="KIND_MODEL", choices=["KIND_MODEL", "KIND_GPU", "KIND_CPU"])
    p.add_argument("--instance-count", type=int, default=1,
                   help="model instances (instance_group count); more than 1 share one engine core process")
    p.add_argument("--no-metrics", action="store_true", help="do not publish the vllm:* custom metrics")
    p.add_argument("--health-check", action="store_true",
                   help="ENABLE_VLLM_HEALTH_CHECK: a dead engine unloads the model (needs "
                        "--model-control-mode=explicit on the server)")
    ns = p.parse_args(argv)
    args = dict(DEFAULT_ENGINE_ARGS, model=ns.model)
    for item in ns.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--engine-arg wants KEY=VALUE, got {item!r}")
        args[key.strip()] = _parse_value(value)
    model_dir = write_model_repository(ns.repository, model_name=ns.model_name, engine_args=args,
                                       instance_kind=ns.instance_kind, instance_count=ns.instance_count,
                                       report_metrics=not ns.no_metrics,
                                       health_check=ns.health_check)
    print(model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
