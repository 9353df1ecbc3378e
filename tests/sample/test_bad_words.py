"""``bad_words`` in the sampler: the last token of a word is banned right after the rest of it (vLLM's rule)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from paged_backend.sample.metadata import RowSpec, bad_word_bans, fast_greedy_from
from paged_backend.sample.sampler import Sampler, SamplingMetadata
from paged_backend.sampling_params import SamplingParams

EOS = (0,)


def _meta(params: list[SamplingParams], words: list[tuple[tuple[int, ...], ...]],
          outputs: list[list[int]]) -> SamplingMetadata:
    return SamplingMetadata(params=params, generators=[None] * len(params), prompt_token_ids=[[] for _ in params],
                            output_token_ids=outputs, eos_token_ids=EOS,
                            specs=[RowSpec.of(p, EOS, w) for p, w in zip(params, words, strict=True)])


def test_bans_follow_the_output_suffix() -> None:
    words = ((7,), (3, 4), (1, 2, 5))
    assert bad_word_bans(words, []) == [7]  # one-token words always; longer ones need their prefix
    assert bad_word_bans(words, [9, 3]) == [7, 4]
    assert bad_word_bans(words, [3, 9]) == [7]
    assert bad_word_bans(words, [1, 2]) == [7, 5]
    assert bad_word_bans(words, [2]) == [7]  # a partial prefix bans nothing


def test_a_banned_token_is_never_picked_but_raw_logprobs_stay() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]] * 3)
    greedy = SamplingParams(temperature=0.0, logprobs=1, bad_words=["x"])
    words = [((2,),), ((1, 2),), ((3, 2),)]  # row 0: always; row 1: after token 1; row 2: after token 3
    out = Sampler()(logits, _meta([greedy] * 3, words, [[], [1], [4]]))
    assert out.sampled_token_ids == [3, 3, 2]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.sampled_logprobs[0] == pytest.approx(raw[3].item())  # logprobs: the raw distribution
    assert out.logprobs[0][2] == pytest.approx(raw[2].item())


def test_random_rows_never_sample_a_banned_token() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.1, 1.9]] * 64)
    params = [SamplingParams(temperature=1.0, bad_words=["x"])] * 64
    out = Sampler(seed=3)(logits, _meta(params, [((2,), (1,))] * 64, [[] for _ in range(64)]))
    assert set(out.sampled_token_ids) <= {0, 3} and 3 in out.sampled_token_ids


def test_bad_words_leave_the_greedy_fast_path_and_are_validated() -> None:
    assert fast_greedy_from(SamplingParams(temperature=0.0, bad_words=["x"]), EOS) is None
    assert fast_greedy_from(SamplingParams(temperature=0.0, bad_words=[]), EOS) == 0
    for bad in ([""], ["  "], ["a" * 1025], ["w"] * 1025):
        with pytest.raises(ValidationError, match="bad_words|bad word"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValidationError, match="beam search"):
        SamplingParams(use_beam_search=True, bad_words=["x"])
