"""``bench kv-swap`` is a ``paged-backend bench`` subcommand; on the CPU (small shapes) it times the batched
and the per-run copies both ways and checks every block they move."""

from __future__ import annotations

import json

from paged_backend.benchmarks import kv_swap
from paged_backend.cli import build_parser, main


def test_bench_kv_swap_is_a_bench_subcommand() -> None:
    args = build_parser().parse_args(["bench", "kv-swap", "--model-shapes", "llama-3.1-8b", "--blocks", "256"])
    assert (args.model_shapes, args.blocks, args.num_blocks, args.staging_mib) == ("llama-3.1-8b", "256", 2048, 256)
    assert args.func is kv_swap.run
    specs = kv_swap.kv_specs(args)
    assert len(specs) == 32 and specs[0].bytes_per_block == 16 * 2 * 8 * 128 * 2  # 64 KiB a layer


def test_bench_kv_swap_runs_on_the_cpu(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert main(["bench", "kv-swap", "--device", "cpu", "--num-blocks", "64", "--blocks", "8,20", "--reps", "1",
                 "--staging-mib", "0", "--json", str(out)]) == 0  # staging: one block, a chunk per block
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # counts x host orders x paths x directions
    assert all(r["ok"] and r["ms"] > 0 and r["gib_s"] > 0 for r in rows)
    batched = {(r["direction"], r["host_ids"], r["blocks"]): r["copies"] for r in rows if r["path"] == "batched"}
    assert batched[("out", "consecutive", 20)] == 20  # one copy per staging chunk of one block
    assert "per-run" in capsys.readouterr().out


def test_bench_kv_swap_latent_fp8_without_reference(tmp_path) -> None:
    out = tmp_path / "rows.json"
    assert main(["bench", "kv-swap", "--device", "cpu", "--model-shapes", "deepseek-v2-lite", "--kv-cache-dtype",
                 "fp8", "--num-blocks", "40", "--blocks", "16", "--reps", "1", "--no-reference",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["path"] for r in rows} == {"batched"} and all(r["ok"] for r in rows)
    consecutive = [r for r in rows if r["host_ids"] == "consecutive"]
    assert all(r["copies"] == 1 for r in consecutive)  # 16 consecutive host blocks: one copy
