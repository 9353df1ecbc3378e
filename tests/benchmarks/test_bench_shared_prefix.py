"""``bench shared-prefix``: the workload generator makes D documents of L tokens, each asked Q questions,
in the order it says; the command runs on a tiny random model on the CPU, where a device pool too small
for the documents sends their next questions to the host tier."""

from __future__ import annotations

import json

import pytest
from tiny_llama import write_tiny_llama

from paged_backend.benchmarks.shared_prefix import shared_prefix_prompts
from paged_backend.cli import main


def test_workload_is_d_documents_each_asked_q_questions():
    work = shared_prefix_prompts(3, 20, 2, 5, vocab=1000, seed=7)
    assert [d for d, _ in work] == [0, 1, 2, 0, 1, 2]  # round-robin: question 1 of each document, then 2
    assert all(len(ids) == 25 and all(0 <= t < 1000 for t in ids) for _, ids in work)
    docs = {d: ids[:20] for d, ids in work}
    assert [docs[d][0] for d in range(3)] == [100, 101, 102]  # distinct from the first token on
    for d, ids in work:
        assert ids[:20] == docs[d]
    questions = [tuple(ids[20:]) for _, ids in work]
    assert len(set(questions)) == 6  # every question differs
    assert all(t >= 103 for _, ids in work for t in ids[1:])  # no other document's marker
    by_doc = shared_prefix_prompts(3, 20, 2, 5, vocab=1000, seed=7, order="doc")
    assert [d for d, _ in by_doc] == [0, 0, 1, 1, 2, 2]
    assert sorted(map(tuple, (ids for _, ids in by_doc))) == sorted(map(tuple, (ids for _, ids in work)))
    assert shared_prefix_prompts(3, 20, 2, 5, vocab=1000, seed=8) != work
    with pytest.raises(ValueError, match="order"):
        shared_prefix_prompts(3, 20, 2, 5, vocab=1000, order="random")


def test_command_serves_evicted_documents_from_the_host_tier(tmp_path, tmp_path_factory, capsys):
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    out = tmp_path / "runs.jsonl"
    # 6 documents of 64 tokens (4 blocks each) asked 2 questions, on 15 usable device blocks
    common = ["bench", "shared-prefix", "--model", str(tiny), "--load-format", "dummy", "--dtype", "float32",
              "--device", "cpu", "--num-docs", "6", "--doc-len", "64", "--questions-per-doc", "2",
              "--question-len", "8", "--output-len", "4", "--max-concurrency", "2",
              "--num-gpu-blocks-override", "16", "--block-size", "16", "--json", str(out)]
    assert main(common) == 0
    assert main([*common, "--swap-space", "0.01"]) == 0
    text = capsys.readouterr().out
    assert "ttft_p99_ms" in text and "output_tok_s" in text
    without, with_tier = (json.loads(line) for line in out.read_text().splitlines())
    assert without["requests"] == with_tier["requests"] == 12
    assert without["host_prefix_cache_hits"] == 0 and without["num_host_blocks"] == 0
    # every second question finds its document's 4 blocks on the host (its question's block is new)
    assert with_tier["host_prefix_cache_hits"] == 6 * 4 * 16
    assert with_tier["prefix_cache_hits"] == without["prefix_cache_hits"] == 0
