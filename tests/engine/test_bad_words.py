"""``bad_words`` on the real SmolLM2: words the greedy output holds are gone once banned, and nothing else moves."""

from __future__ import annotations

import pytest
from smollm2 import PROMPTS, assert_no_leak

from paged_backend import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow


def _greedy(llm, prompt: str, **kw):
    return llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_a_one_token_word_is_never_generated(llm):
    plain = _greedy(llm, PROMPTS[0])
    assert "Paris" in plain.text
    banned = _greedy(llm, PROMPTS[0], bad_words=["Paris"])
    assert "Paris" not in banned.text
    paris = {t for w in ("Paris", " Paris") for t in llm.tokenizer.encode(w, add_special_tokens=False)}
    assert not paris & set(banned.token_ids)
    assert_no_leak(llm.engine)


def test_a_word_of_several_tokens_loses_its_last_token_after_the_rest(llm):
    plain = _greedy(llm, PROMPTS[2])
    assert "Eridus" in plain.text
    word = tuple(llm.tokenizer.encode(" Eridus", add_special_tokens=False))
    assert len(word) > 1
    prep = llm.engine.process_input("bw", PROMPTS[2], SamplingParams(bad_words=["Eridus"]))
    assert word in prep.bad_words_token_ids  # with and without the leading space
    banned = _greedy(llm, PROMPTS[2], bad_words=["Eridus"])
    assert "Eridus" not in banned.text
    ids = banned.token_ids
    assert not any(tuple(ids[i:i + len(word)]) == word for i in range(len(ids)))
    # the output is the plain one up to the word's last token, which is the first to change
    first = next(i for i, (a, b) in enumerate(zip(plain.token_ids, ids, strict=True)) if a != b)
    assert tuple(plain.token_ids[first - len(word) + 1:first + 1]) == word
    # a ban the output never reaches changes nothing; sampled rows obey it as well
    assert _greedy(llm, PROMPTS[2], bad_words=["zebra"]).token_ids == plain.token_ids
    sampled = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=4,
                                                        bad_words=["Paris"]), use_tqdm=False)[0]
    assert all("Paris" not in c.text for c in sampled.outputs)
    assert_no_leak(llm.engine)


def test_bad_words_need_a_tokenizer_and_refuse_beam_search(llm):
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, bad_words=["x"])
    engine = llm.engine
    tok, engine.inputs.tokenizer = engine.inputs.tokenizer, None
    try:
        with pytest.raises(InvalidRequestError) as exc:
            engine.process_input("bw", [1, 2, 3], SamplingParams(bad_words=["x"]))
        assert exc.value.param == "bad_words"
    finally:
        engine.inputs.tokenizer = tok
