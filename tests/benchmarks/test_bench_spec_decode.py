"""``bench spec-decode``: the repetitive workload is what it says, and the command runs a baseline and a
speculative engine per batch size on a tiny random model on the CPU, with counters that add up and greedy
outputs equal to the baseline's; a draft with the target's own random weights accepts every draft."""

from __future__ import annotations

import json

import pytest
from tiny_llama import write_tiny_llama

from paged_backend.benchmarks.spec_decode import spec_prompts
from paged_backend.cli import main


def test_repeat_workload_repeats_one_segment_per_prompt():
    rows = spec_prompts(3, 20, vocab=1000, workload="repeat", period=6, seed=4)
    assert len(rows) == 3 and all(len(r) == 20 for r in rows)
    for r in rows:
        assert r[6:12] == r[:6] and r[12:18] == r[:6] and r[18:] == r[:2]
        assert all(100 <= t < 1000 for t in r)
    assert len({tuple(r[:6]) for r in rows}) == 3  # a segment of its own per prompt
    flat = spec_prompts(2, 50, vocab=1000, workload="random", seed=4)
    assert all(len(r) == 50 for r in flat) and flat[0][:6] != flat[0][6:12]
    assert spec_prompts(3, 20, vocab=1000, workload="repeat", period=6, seed=5) != rows
    with pytest.raises(ValueError, match="workload"):
        spec_prompts(1, 8, vocab=1000, workload="copy")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_command_compares_speculation_with_the_baseline(method, tmp_path, tmp_path_factory, capsys):
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    out = tmp_path / "rows.jsonl"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "draft_model":  # the same shapes and seed: the draft's random weights are the target's
        spec = {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 3}
    assert main(["bench", "spec-decode", "--model", str(tiny), "--load-format", "dummy", "--dtype", "float32",
                 "--device", "cpu", "--batch-sizes", "1,3", "--input-len", "24", "--output-len", "12",
                 "--repeat-period", "6", "--speculative-config", json.dumps(spec), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "acceptance_rate" in text and "greedy_equal" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["engine"], r["batch"]) for r in rows] == [
        ("no speculation", 1), (f"speculative ({method})", 1), ("no speculation", 3), (f"speculative ({method})", 3)]
    for base, fast in zip(rows[::2], rows[1::2], strict=True):
        b = base["batch"]
        assert base["output_tokens"] == fast["output_tokens"] == 12 * b
        assert base["drafts"] == base["draft_tokens"] == 0 and base["acceptance_rate"] is None
        assert fast["greedy_equal"] == f"{b}/{b}"  # speculation never changes greedy output
        assert 0 < fast["drafts"] and fast["accepted_tokens"] <= fast["draft_tokens"] <= 3 * fast["drafts"]
        assert fast["speedup"] == round(fast["output_tok_s"] / base["output_tok_s"], 3)
        if method == "draft_model":  # the target's own weights draft: every draft token is accepted
            assert fast["acceptance_rate"] == 1.0
            assert fast["mean_acceptance_length"] == round(1 + fast["accepted_tokens"] / fast["drafts"], 3)


def test_command_reports_the_steps_run_without_drafts(tmp_path, tmp_path_factory, capsys):
    """Over ``disable_by_batch_size`` the rows count the steps that ran without drafts: none at batch 1,
    each of the 11 decode steps at batch 3 (its requests finish together), which then drafts nothing."""
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    out = tmp_path / "rows.jsonl"
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": 2}
    assert main(["bench", "spec-decode", "--model", str(tiny), "--load-format", "dummy", "--dtype", "float32",
                 "--device", "cpu", "--batch-sizes", "1,3", "--input-len", "24", "--output-len", "12",
                 "--repeat-period", "6", "--speculative-config", json.dumps(spec), "--json", str(out)]) == 0
    assert "disabled_steps" in capsys.readouterr().out
    rows = {(r["engine"], r["batch"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert rows[("no speculation", 1)]["disabled_steps"] == rows[("no speculation", 3)]["disabled_steps"] == 0
    assert rows[("speculative (ngram)", 1)]["disabled_steps"] == 0 and rows[("speculative (ngram)", 1)]["drafts"] > 0
    batch3 = rows[("speculative (ngram)", 3)]
    assert batch3["disabled_steps"] == 11 and batch3["drafts"] == 0  # 12 tokens: the prefill step, 11 decode steps
    assert batch3["greedy_equal"] == "3/3"
