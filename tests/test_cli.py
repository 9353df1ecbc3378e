"""The ``paged-backend`` command as a user runs it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXE = str(Path(sys.executable).with_name("paged-backend"))


def test_generate_answers_a_question():
    out = subprocess.run([EXE, "generate", "What is the capital of France?", "--max-tokens", "24",
                          "--kv-cache-memory-bytes", str(64 << 20), "--log-stats-interval", "0"],
                         capture_output=True, text=True, timeout=600, check=True)
    assert "Paris" in out.stdout
    assert "KV cache:" in out.stderr and "max concurrency" in out.stderr


def test_help_is_plain_text_and_every_generate_flag_says_what_it_does_and_its_default():
    from paged_backend.cli import build_parser

    parser = build_parser()
    top = parser.format_help()
    assert "``" not in top and "generate" in top and "bench" in top
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"generate", "bench"}
    generate = sub.choices["generate"]
    for action in generate._actions:
        assert action.help, action.option_strings or action.dest
        plain_switch = action.nargs == 0 and (action.const is False or action.dest in ("help", "raw"))
        if action.option_strings and not plain_switch:
            assert "default" in action.help, action.option_strings


def test_bench_throughput_reports_low_kv_waste(tmp_path):
    res = tmp_path / "bench.jsonl"
    out = subprocess.run([EXE, "bench", "throughput", "--dtype", "float32", "--num-prompts", "12",
                          "--input-len", "240", "--output-len", "8", "--random-range-ratio", "0.5",
                          "--warmup-prompts", "2", "--kv-cache-memory-bytes", str(256 << 20),
                          "--json", str(res), "--log-stats-interval", "0"],
                         capture_output=True, text=True, timeout=900, check=True)
    assert "output_tok_s" in out.stdout  # the printed table
    row = json.loads(res.read_text().splitlines()[0])
    assert row["prompts"] == 12 and row["output_tokens"] >= 12 * 4
    assert 0 < row["peak_kv_usage"] <= 1
    assert row["preemptions"] == 0  # 256 MiB holds every request
    # only the last partial block of each request may be empty
    assert row["kv_waste"] < 0.04


def test_bench_kernels_passes_every_argument_to_its_own_parser(capsys):
    """``bench kernels`` hands what follows it to the kernel benchmark's parser (``--help`` too);
    any other subcommand still refuses an argument it does not know."""
    from paged_backend.cli import main

    with pytest.raises(SystemExit) as done:
        main(["bench", "kernels", "--help"])
    assert done.value.code == 0
    assert "usage: paged-backend bench kernels" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["generate", "hello", "--no-such-flag"])
    assert refused.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
