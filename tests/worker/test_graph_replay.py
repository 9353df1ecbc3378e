"""The graph path of the model runner on the CPU: uniform steps (decode, and speculative decoding's
verifications of 1 + k tokens a request) padded to a bucket and run over the inputs the "capture" saw, as a
CUDA graph replays them (the step buffers never move; the metadata's host fields are the capture's: max_query_len
= q, max_seq_len = max_model_len). A stand-in for ``DecodeGraphs`` runs the captured forward eagerly on those
inputs, with the Triton attention kernel (interpreted), so the padding rows and the capture-time metadata are
checked here, and so are verification steps in which some requests have fewer drafts (spread over the graph's
rows, filler rows after their tokens); tests/engine/test_spec_decode_cuda.py replays real graphs on a GPU."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import write_tiny_llama

from paged_backend import LLM, SamplingParams
from paged_backend.worker.cuda_graphs import DecodeGraphs

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)  # the last drafts capped: 1 a request
# a pattern each prompt repeats: the n-gram proposer finds k drafts at once, so the first steps are verifications
PROMPTS = [[100 + i, 205, 310 + 7 * i, 415] * 6 for i in range(3)]


class EagerReplay(DecodeGraphs):
    """``DecodeGraphs`` whose "graphs" are the capture's padded inputs, replayed by the eager forward."""

    def capture(self, sliding_window: int | None) -> None:
        self.steps = {}
        for q, sizes in self.sizes_by_q.items():
            for size in sizes:
                self.steps[q, size] = self._dummy_inputs(size, q, sliding_window)
                self.graphs[q, size] = None

    def replay(self, size: int, q: int = 1) -> torch.Tensor:
        step = self.steps[q, size]
        step.meta.step_cache.clear()
        self.replays[q] += 1
        return self.forward(step.input_ids, step.positions, step.meta)


def _emulate_graphs(runner) -> EagerReplay:
    """The stand-in graphs on ``runner``; ``graphs.spread`` counts the replayed steps whose requests had fewer new
    tokens than the graph's rows per request (spread over them)."""
    lim = runner.limits
    graphs = runner.graphs = EagerReplay(runner._graph_forward, runner.inputs, lim.max_num_seqs, lim.max_model_len,
                                         runner.graph_query_lens())
    graphs.capture(None)
    graphs.spread = 0
    build = runner.inputs.build

    def counting_build(*args, **kw):
        step = build(*args, **kw)
        graphs.spread += step.row_index is not None
        return step

    runner.inputs.build = counting_build
    return graphs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


def _llm(model: str, **kw) -> LLM:
    return LLM(model, load_format="dummy", dtype="float32", device="cpu", attention_backend="triton",
               max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=16 << 20, log_stats_interval=0,
               seed=0, **kw)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_tokens(tiny):
    return _tokens(_llm(tiny))


def _recording(runner) -> list[torch.Tensor]:
    """Every step's logits rows of ``runner`` from now on."""
    logits: list[torch.Tensor] = []
    execute = runner.execute

    def recording_execute(*args, **kw):
        out = execute(*args, **kw)
        logits.append(out.logits.clone())
        return out

    runner.execute = recording_execute
    return logits


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verification_steps_replay_padded_graph_inputs_with_the_eager_logits(tiny, plain_tokens, method):
    """The tiny random model mostly repeats its input, so the tokens alone say little: every step's logits rows
    (the target's, and the draft model's passes) equal the eager engine's."""
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": tiny, "num_speculative_tokens": K}
    eager = _llm(tiny, speculative_config=spec)
    llm = _llm(tiny, speculative_config=spec)
    runner = llm.engine.runner
    assert runner.graph_query_lens() == (1, 1 + K)
    graphs = [_emulate_graphs(runner)]
    pairs = [(_recording(eager.engine.runner), _recording(runner))]
    if method == "draft_model":
        draft = llm.engine.spec.draft.runner
        assert draft.graph_query_lens() == (1, 1 + K)  # it observes the target's verification steps
        graphs.append(_emulate_graphs(draft))
        pairs.append((_recording(eager.engine.spec.draft.runner), _recording(draft)))
    assert _tokens(eager) == plain_tokens
    assert _tokens(llm) == plain_tokens
    for want, got in pairs:
        assert len(want) == len(got)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    for g in graphs:
        assert g.replays[1 + K] > 0  # verification steps (3 requests, padded to 4 rows) replayed
        assert g.spread > 0  # some with fewer drafts for a request (capped near max_tokens, or none found)
    if method == "draft_model":
        assert graphs[1].replays[1] > 0  # the draft's one-token passes too
    assert runner.step_counts["graph"] >= graphs[0].replays[1 + K]
