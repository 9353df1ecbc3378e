"""The sampler against hand-computed examples, simple references and sampling statistics.

Runs on the CPU; the same tests also run on CUDA where a GPU is present (plus a check
that the device pass makes no host sync).
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_backend.core.request import Request
from paged_backend.sample import (
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    token_counts,
)
from paged_backend.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    fast_greedy_from,
    seeded_generator,
)
from paged_backend.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = 0


def meta_for(
    params: list[SamplingParams],
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: tuple[int, ...] = (EOS,),
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata(
        params=params,
        generators=generators if generators is not None else [None] * n,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        eos_token_ids=eos,
    )


def random_logits(rows: int, vocab: int, seed: int, device: str = "cpu", scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    for r in range(rows):  # the reference comparisons below assume no ties
        assert len(set(x[r].tolist())) == vocab
    return x.to(device)


# -- independent references: python loops over sorted float64 probabilities ---------------


def softmax64(values: list[float]) -> list[float]:
    m = max(values)
    e = [math.exp(v - m) for v in values]
    z = sum(e)
    return [v / z for v in e]


def ref_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    """top-k (k <= 0: off), then the smallest descending prefix with mass >= p."""
    order = sorted(range(len(row)), key=lambda i: row[i], reverse=True)
    if 0 < k < len(row):
        order = order[:k]
    if p >= 1.0:
        return set(order)
    probs = softmax64([row[i] for i in order])
    for m in range(1, len(order) + 1):
        if sum(probs[:m]) >= p:
            return set(order[:m])
    return set(order)


def ref_min_p(row: list[float], min_p: float) -> set[int]:
    probs = softmax64(row)
    return {i for i, pr in enumerate(probs) if pr >= min_p * max(probs)}


def kept(masked_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked_row).nonzero().flatten().tolist())


# -- masks ---------------------------------------------------------------------------------

KS = [-1, 1, 5, 64]
PS = [1.0, 0.9, 0.5, 1e-6]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("p", PS)
def test_top_k_top_p_matches_reference(device: str, k: int, p: float) -> None:
    logits = random_logits(6, 64, seed=(k + 2) * 1000 + int(p * 1000), device=device)
    kt = torch.full((6,), k, device=device)
    pt = torch.full((6,), p, device=device)
    out = apply_top_k_top_p(logits, kt, pt)
    for r in range(6):
        row = logits[r].tolist()
        assert kept(out[r]) == ref_top_k_top_p(row, k, p)
        keep = torch.isfinite(out[r])
        assert torch.equal(out[r][keep], logits[r][keep])  # kept logits are untouched
    if p == 1.0:  # top-k alone: the topk-based path must keep the same set
        only_k = apply_top_k(logits, kt, max_k=k if 0 < k < 64 else 64)
        assert torch.equal(only_k, out)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_rows_top_k_top_p_min_p_match_reference(device: str) -> None:
    """One call, a different (k, p) and min_p on every row: row-vectorized masks."""
    combos = [(k, p) for k in KS for p in PS]
    logits = random_logits(len(combos), 64, seed=11, device=device)
    kt = torch.tensor([k for k, _ in combos], device=device)
    pt = torch.tensor([p for _, p in combos], device=device)
    out = apply_top_k_top_p(logits, kt, pt)
    max_k = max(k for k, _ in combos if 0 < k < 64)
    only_k = apply_top_k(logits, kt, max_k=max_k)
    min_ps = [0.0, 0.01, 0.1, 0.3, 0.7, 1.0]
    mp = torch.tensor([min_ps[i % len(min_ps)] for i in range(len(combos))], device=device)
    by_min_p = apply_min_p(logits, mp)
    for r, (k, p) in enumerate(combos):
        row = logits[r].tolist()
        assert kept(out[r]) == ref_top_k_top_p(row, k, p), (k, p)
        assert kept(only_k[r]) == ref_top_k_top_p(row, k, 1.0), k
        assert kept(by_min_p[r]) == ref_min_p(row, mp[r].item()), mp[r].item()


def test_ties_at_kth_value_are_kept() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [3.0, 3.0, 1.0, 0.0]])
    k = torch.tensor([2, 1])
    for out in (apply_top_k_top_p(logits, k, None), apply_top_k(logits, k, max_k=2)):
        assert kept(out[0]) == {1, 2}
        assert kept(out[1]) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    p = lambda v: torch.tensor([v])  # noqa: E731
    assert kept(apply_top_k_top_p(logits, None, p(0.45))[0]) == {0}
    assert kept(apply_top_k_top_p(logits, None, p(0.51))[0]) == {0, 1}
    assert kept(apply_top_k_top_p(logits, None, p(0.81))[0]) == {0, 1, 2}
    assert kept(apply_top_k_top_p(logits, None, p(0.96))[0]) == {0, 1, 2, 3}
    assert kept(apply_top_k_top_p(logits, None, p(1.0))[0]) == {0, 1, 2, 3}
    # top-p after top-k is over the renormalized top-2 (.625, .375)
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), p(0.6))[0]) == {0}
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), p(0.7))[0]) == {0, 1}


# -- penalties and min_tokens ---------------------------------------------------------------


def test_repetition_penalty_hand_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt = token_counts([[0, 0]], 5, torch.device("cpu"))
    output = token_counts([[1]], 5, torch.device("cpu"))
    one = torch.tensor([1.0])
    zero = torch.tensor([0.0])
    out = apply_penalties(logits, prompt, output, torch.tensor([2.0]), zero, zero)
    # seen tokens 0 (prompt) and 1 (output): positive logits divided, negative multiplied
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, -2.0]]
    out = apply_penalties(logits, prompt, output, torch.tensor([0.5]), zero, zero)
    assert out.tolist() == [[4.0, -0.5, 0.5, 3.0, -2.0]]
    assert apply_penalties(logits, prompt, output, one, zero, zero).tolist() == logits.tolist()


def test_frequency_and_presence_penalties_hand_example() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    dev = torch.device("cpu")
    prompt = token_counts([[3, 3, 3]], 4, dev)  # the prompt does not count for these two
    output = token_counts([[2, 2, 1]], 4, dev)
    assert output.tolist() == [[0.0, 1.0, 2.0, 0.0]]
    out = apply_penalties(logits, prompt, output, torch.tensor([1.0]), torch.tensor([0.5]),
                          torch.tensor([1.0]))
    # token 1: 1 - 0.5*1 - 1 = -0.5; token 2: 1 - 0.5*2 - 1 = -1
    assert out.tolist() == [[1.0, -0.5, -1.0, 1.0]]
    negative = apply_penalties(logits, prompt, output, torch.tensor([1.0]), torch.tensor([-1.0]),
                               torch.tensor([0.0]))
    assert negative.tolist() == [[1.0, 2.0, 3.0, 1.0]]


def test_penalties_through_the_sampler_change_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 5.0, 4.0, 3.0]] * 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 5 -> 2.5 (token 1 in prompt)
        SamplingParams(temperature=0.0, frequency_penalty=1.0),  # output has 2,2: 4 -> 2
        SamplingParams(temperature=0.0, presence_penalty=2.0),  # 5 -> 3 (token 1 in output)
    ]
    meta = meta_for(params, prompts=[[1], [1], [1], [2]], outputs=[[1], [3], [2, 2, 1], [1]])
    out = Sampler()(logits, meta)
    # row 2: token1 5-1-0=4 vs token2 4-2=2 vs token3 3 -> 1; row 3: 3 vs 4 -> 2
    assert out.sampled_token_ids == [1, 2, 1, 2]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    # EOS (0) is the favourite, then stop id 1, then token 2
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]] * 5)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),  # 1 output: banned
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),  # 3 outputs: free
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3),  # only EOS banned
        SamplingParams(temperature=0.0, min_tokens=0, stop_token_ids=[1]),
    ]
    outputs = [[5], [5, 5, 5], [], [], []]
    out = Sampler()(logits, meta_for(params, outputs=outputs, eos=(EOS, 3)))
    assert out.sampled_token_ids == [2, 0, 0, 1, 0]
    # bans apply to the sampling distribution only, never to the reported raw logprobs
    raw = torch.log_softmax(logits[0], -1)
    assert out.sampled_logprobs[0] == pytest.approx(raw[2].item(), abs=1e-6)


def test_logit_bias_and_allowed_token_ids_change_the_choice_not_the_raw_logprobs() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]] * 5)
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 9.0}),  # 1 + 9 = 10 beats 9
        SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: -2.0}),  # 7 beats 6
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 3]),
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 2], logit_bias={3: 7.0}, logprobs=1),  # 8 beats 7
        SamplingParams(temperature=0.0),  # a neighbour without either: unchanged
    ]
    out = Sampler()(logits, meta_for(params))
    assert out.sampled_token_ids == [3, 2, 1, 3, 0]
    raw = torch.log_softmax(logits[3], -1)
    assert out.sampled_logprobs[3] == pytest.approx(raw[3].item(), abs=1e-6)
    assert list(out.logprobs[3]) == [0, 3]  # the raw top-1, then the sampled token


def test_allowed_token_ids_hold_on_every_random_draw() -> None:
    logits = torch.zeros(2000, 6)
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[1, 4], logit_bias={4: -1.0})] * 2000
    out = Sampler(seed=5)(logits, meta_for(params))
    counts = [out.sampled_token_ids.count(t) for t in (1, 4)]
    assert sum(counts) == 2000 and counts[0] > counts[1] > 0  # 1 : e^-1 odds


def test_bad_logit_bias_and_allowed_ids_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="non-negative"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, beam_width=2, logit_bias={1: 1.0})


def test_min_tokens_random_rows_never_sample_banned() -> None:
    logits = torch.zeros(2000, 4)  # uniform: bans must hold on every draw
    params = [SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[2])] * 2000
    out = Sampler(seed=3)(logits, meta_for(params))
    assert set(out.sampled_token_ids) == {1, 3}


def test_token_counts_rejects_out_of_vocab_ids() -> None:
    assert token_counts([[], [2, 2]], 3, torch.device("cpu")).tolist() == [[0, 0, 0], [0, 0, 2]]
    with pytest.raises(ValueError, match="token ids"):
        token_counts([[1], [3]], 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="token ids"):
        token_counts([[-1]], 3, torch.device("cpu"))


def test_apply_min_tokens_is_out_of_place() -> None:
    logits = torch.zeros(2, 3)
    out = apply_min_tokens(logits, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1]))
    assert torch.isinf(out).tolist() == [[False, False, True], [True, True, False]]
    assert torch.equal(logits, torch.zeros(2, 3))


# -- greedy, seeding, distributions ---------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = random_logits(5, 100, seed=1, device=device)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5)] * 5
    out = Sampler()(logits, meta_for(params))
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    expected = torch.log_softmax(logits, -1).max(-1).values.tolist()
    assert out.sampled_logprobs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_fast_path_equals_the_full_sampler(device: str, dtype: torch.dtype) -> None:
    logits = random_logits(7, 300, seed=3, device=device).to(dtype)
    logits[2, 10] = logits[2, 200] = logits[2].max() + 1  # a tie: both take the first index
    params = [SamplingParams(temperature=0.0, top_k=3)] * 7
    fast = Sampler.greedy(logits)
    assert fast == Sampler()(logits, meta_for(params)).sampled_token_ids
    assert fast == logits.float().argmax(-1).tolist() and fast[2] == 10
    assert all(isinstance(t, int) for t in fast)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 0.0}, 0),
        ({"temperature": 0.0, "top_p": 0.5, "top_k": 3, "seed": 1}, 0),  # no effect on greedy rows
        ({"temperature": 0.7}, None),
        ({"temperature": 0.0, "logprobs": 0}, None),
        ({"temperature": 0.0, "repetition_penalty": 1.1}, None),
        ({"temperature": 0.0, "presence_penalty": 0.5}, None),
        ({"temperature": 0.0, "min_tokens": 4}, 4),  # bans EOS until then
        ({"temperature": 0.0, "min_tokens": 4, "ignore_eos": True}, 0),  # bans nothing
        ({"temperature": 0.0, "min_tokens": 4, "ignore_eos": True, "stop_token_ids": [7]}, 4),
        ({"temperature": 0.0, "logit_bias": {3: 1.0}}, None),  # the bias changes the argmax
        ({"temperature": 0.0, "allowed_token_ids": [3]}, None),
    ],
)
def test_fast_greedy_from(kwargs: dict, expected: int | None) -> None:
    assert fast_greedy_from(SamplingParams(**kwargs), (EOS,)) == expected


def test_fast_greedy_rows_match_the_full_sampler_once_min_tokens_is_reached() -> None:
    """Where ``fast_greedy_from`` allows the fast path, the full sampler's token is the argmax."""
    logits = random_logits(4, 50, seed=8)
    eos = int(logits[0].argmax())  # the argmax is an EOS id: banned while min_tokens is not reached
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 4
    outputs = [[], [5], [5, 6], [5, 6, 7]]
    full = Sampler()(logits, meta_for(params, outputs=outputs, eos=(eos,))).sampled_token_ids
    start = fast_greedy_from(params[0], (eos,))
    assert start == 2
    for row, out in enumerate(outputs):
        argmax = int(logits[row].argmax())
        if len(out) >= start:
            assert full[row] == argmax
        elif row == 0:
            assert full[row] != argmax  # still banned: the fast path would have been wrong


def _other_rows() -> list[SamplingParams]:
    """Seven neighbours with other settings, seeded and not, greedy and random."""
    return [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5, seed=99),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=2.0, min_p=0.2, seed=5),
        SamplingParams(temperature=0.9, frequency_penalty=0.5, min_tokens=10, stop_token_ids=[3]),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.95, presence_penalty=1.0),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "target_kwargs",
    [
        {"temperature": 1.5, "top_k": 30, "top_p": 0.95, "presence_penalty": 0.5},
        # alone: the top-k-only path; in the batch (a neighbour has top_p): the sort path
        {"temperature": 1.2, "top_k": 10, "min_p": 0.05},
    ],
)
def test_seeded_row_same_tokens_alone_and_in_any_batch(device: str, target_kwargs: dict) -> None:
    vocab, steps = 50, 20
    target = SamplingParams(seed=1234, **target_kwargs)
    step_logits = random_logits(steps, vocab, seed=7, device=device, scale=1.0)

    def run(in_batch: bool) -> list[int]:
        gen = seeded_generator(1234, device)
        sampler = Sampler(seed=int(in_batch))  # different unseeded streams
        produced: list[int] = []
        for step in range(steps):
            row = step_logits[step : step + 1]
            if not in_batch:
                meta = meta_for([target], prompts=[[1, 2]], outputs=[list(produced)], generators=[gen])
                produced.append(sampler(row, meta).sampled_token_ids[0])
                continue
            params = _other_rows()
            gens = [seeded_generator(p.seed + step, device) if p.seed is not None else None
                    for p in params]
            pos = step % 8
            params.insert(pos, target)
            gens.insert(pos, gen)
            others = random_logits(7, vocab, seed=1000 + step, device=device)
            batch = torch.cat([others[:pos], row, others[pos:]])
            outputs = [[3, 3, 4] for _ in range(8)]
            outputs[pos] = list(produced)
            prompts = [[1, 2] for _ in range(8)]
            meta = meta_for(params, prompts=prompts, outputs=outputs, generators=gens)
            produced.append(sampler(batch, meta).sampled_token_ids[pos])
        return produced

    alone = run(in_batch=False)
    assert run(in_batch=True) == alone
    assert len(set(alone)) >= 5  # the row really samples (else the test could not fail)


def test_seeds_decide_the_stream() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(temperature=1.0, seed=1)]

    def draw(seed: int) -> list[int]:
        gen = seeded_generator(seed, "cpu")
        return [Sampler(seed=42)(logits, meta_for(params, generators=[gen])).sampled_token_ids[0]
                for _ in range(10)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    # unseeded rows: reproducible per sampler seed
    many = torch.zeros(64, 1000)
    unseeded = [SamplingParams(temperature=1.0)] * 64
    a = Sampler(seed=7)(many, meta_for(unseeded)).sampled_token_ids
    assert Sampler(seed=7)(many, meta_for(unseeded)).sampled_token_ids == a
    assert Sampler(seed=8)(many, meta_for(unseeded)).sampled_token_ids != a


def _assert_frequencies(tokens: list[int], expected: list[float]) -> None:
    n = len(tokens)
    counts = [tokens.count(i) for i in range(len(expected))]
    assert sum(counts) == n
    for c, p in zip(counts, expected, strict=True):
        std = math.sqrt(n * p * (1 - p))
        assert abs(c - n * p) <= 5 * std + 1e-9, (counts, [n * q for q in expected])


BASE = [2.0, 1.5, 1.0, 0.0, -1.0, -3.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 1.0}, softmax64(BASE)),
        ({"temperature": 0.5}, softmax64([v / 0.5 for v in BASE])),
        ({"temperature": 2.0}, softmax64([v / 2.0 for v in BASE])),
        ({"temperature": 1.0, "top_k": 3}, softmax64(BASE[:3]) + [0.0] * 3),
        # softmax(BASE) = .46 .28 .17 .06 .02 .003: top_p .6 keeps two, renormalized
        ({"temperature": 1.0, "top_p": 0.6}, softmax64(BASE[:2]) + [0.0] * 4),
        # min_p .3: keeps probs >= .3 * .46 = .14 -> three tokens
        ({"temperature": 1.0, "min_p": 0.3}, softmax64(BASE[:3]) + [0.0] * 3),
    ],
)
def test_empirical_distribution_matches(device: str, kwargs: dict, expected: list[float]) -> None:
    n = 20_000
    logits = torch.tensor([BASE], device=device).expand(n, -1)
    out = Sampler(seed=0)(logits, meta_for([SamplingParams(**kwargs)] * n))
    _assert_frequencies(out.sampled_token_ids, expected)


def test_seeded_rows_sample_the_right_distribution() -> None:
    """The per-row generator path, not only the shared one, draws from softmax."""
    n = 4000
    logits = torch.tensor([BASE]).expand(n, -1)
    gens = [seeded_generator(i, "cpu") for i in range(n)]
    out = Sampler()(logits, meta_for([SamplingParams(seed=0)] * n, generators=gens))
    _assert_frequencies(out.sampled_token_ids, softmax64(BASE))


@pytest.mark.parametrize("device", DEVICES)
def test_untruncated_rows_race_on_logits_like_the_softmax_race(device: str) -> None:
    """Plain temperature rows skip the softmax: argmax(x / T - log q) == argmax(softmax(x / T) / q).

    min_p = 1e-30 truncates nothing but takes the softmax path; the same seed gives the same q.
    """
    n, vocab = 64, 500
    logits = random_logits(n, vocab, seed=3, device=device)
    gens = [seeded_generator(100 + i, device) if i % 3 == 0 else None for i in range(n)]
    plain = [SamplingParams(temperature=0.3 + 0.1 * (i % 9)) for i in range(n)]
    via_softmax = [SamplingParams(temperature=p.temperature, min_p=1e-30) for p in plain]
    a = Sampler(seed=7)(logits, meta_for(plain, generators=gens)).sampled_token_ids
    gens = [seeded_generator(100 + i, device) if i % 3 == 0 else None for i in range(n)]
    b = Sampler(seed=7)(logits, meta_for(via_softmax, generators=gens)).sampled_token_ids
    assert a == b
    assert len(set(a)) > n // 2  # a real draw, not each row's argmax
    assert a != logits.argmax(-1).tolist()


def test_sampled_logprobs_only_when_asked() -> None:
    logits = random_logits(4, 50, seed=2)
    plain = [SamplingParams(temperature=1.0)] * 2 + [SamplingParams(temperature=0.0)] * 2
    sampler = Sampler()
    d = sampler.sample_tensors(logits, meta_for(plain), sampled_logprobs=False)
    assert d.sampled_logprobs is None and d.top_ids is None
    out = Sampler.unpack(d, Sampler.pack(d).tolist())
    assert out.sampled_logprobs is None and out.logprobs == [None] * 4
    assert out.sampled_token_ids[2:] == logits[2:].argmax(-1).tolist()
    # one row asking for logprobs: every row's sampled logprob is there, as with the default
    asking = [*plain[:3], SamplingParams(temperature=0.0, logprobs=2)]
    out = Sampler.to_output(sampler.sample_tensors(logits, meta_for(asking), sampled_logprobs=False))
    raw = torch.log_softmax(logits, -1)
    assert out.sampled_logprobs is not None
    assert out.sampled_logprobs == pytest.approx(
        [raw[r, t].item() for r, t in enumerate(out.sampled_token_ids)], abs=1e-5)
    assert out.logprobs[3] is not None and out.logprobs[:3] == [None] * 3


def test_lower_temperature_is_sharper() -> None:
    n = 5_000
    logits = torch.tensor([BASE]).expand(n, -1)
    top_share = []
    for t in (2.0, 1.0, 0.5, 0.05):
        toks = Sampler()(logits, meta_for([SamplingParams(temperature=t)] * n)).sampled_token_ids
        top_share.append(toks.count(0) / n)
    assert top_share == sorted(top_share) and top_share[-1] > 0.99


# -- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_top_n_sorted_and_include_sampled(device: str) -> None:
    vocab = 30
    logits = random_logits(4, vocab, seed=5, device=device)
    # row 3: raw favourites 0, 1, 2; the repetition penalty pushes greedy to token 3
    logits[3] = torch.arange(vocab, 0, -1, dtype=torch.float32, device=device) / 5
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=10.0, logprobs=3),
    ]
    out = Sampler()(logits, meta_for(params, prompts=[[], [], [], [0, 1, 2]]))
    raw = torch.log_softmax(logits.float().cpu(), -1)
    assert out.sampled_token_ids[3] == 3
    assert out.logprobs[2] is None
    for r, n in ((0, 5), (1, 0), (3, 3)):
        lp = out.logprobs[r]
        assert lp is not None
        tok = out.sampled_token_ids[r]
        top = raw[r].topk(n)
        assert list(lp)[:n] == top.indices.tolist()
        assert list(lp.values())[:n] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert list(lp.values())[:n] == sorted(list(lp.values())[:n], reverse=True)
        assert lp[tok] == pytest.approx(raw[r, tok].item(), abs=1e-5)
        assert len(lp) == (n if tok in top.indices.tolist() else n + 1)
        assert out.sampled_logprobs[r] == lp[tok]
    assert list(out.logprobs[3]) == [0, 1, 2, 3]
    assert list(out.logprobs[1]) == [out.sampled_token_ids[1]]


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs(device: str) -> None:
    logits = random_logits(5, 20, seed=9, device=device)
    targets = [3, 7, 7, 19]  # the last row has no next prompt token
    raw = torch.log_softmax(logits.cpu(), -1)
    got = compute_prompt_logprobs(logits, targets, 2)
    assert len(got) == 4
    for i, (d, t) in enumerate(zip(got, targets, strict=True)):
        top = raw[i].topk(2)
        assert list(d)[:2] == top.indices.tolist()
        assert d[t] == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert all(d[j] == pytest.approx(raw[i, j].item(), abs=1e-5) for j in d)
    assert compute_prompt_logprobs(logits, targets, 0) == [
        {t: pytest.approx(raw[i, t].item(), abs=1e-5)} for i, t in enumerate(targets)
    ]
    assert compute_prompt_logprobs(logits, [], 3) == []
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, [1] * 6, 1)


# -- the whole sampler -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_runs_and_respects_each_row(device: str) -> None:
    vocab = 100
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=3),
        SamplingParams(temperature=1.0, min_p=1.0, logprobs=20),
        SamplingParams(temperature=1.2, top_k=10, top_p=0.9, min_p=0.05, seed=8),
        SamplingParams(temperature=0.5, presence_penalty=1.5, frequency_penalty=-0.5, logprobs=1),
        SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[5, 6]),
        SamplingParams(temperature=3.0, top_k=vocab + 50),
        SamplingParams(temperature=1.0, top_p=0.3, repetition_penalty=0.7),
        SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True),
    ]
    n = len(params)
    logits = random_logits(n, vocab, seed=21, device=device)
    logits[7, [EOS, 5, 6]] = 50.0  # banned favourites
    logits[10, EOS] = 50.0  # ignore_eos: EOS not banned
    gens = [seeded_generator(p.seed, device) if p.seed is not None else None for p in params]
    outputs = [[1, 2, 3] for _ in range(n)]
    before = logits.clone()
    out = Sampler()(logits, meta_for(params, outputs=outputs, prompts=[[4]] * n, generators=gens))
    assert isinstance(out, SamplerOutput)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    toks = out.sampled_token_ids
    assert len(toks) == len(out.sampled_logprobs) == len(out.logprobs) == n
    assert all(0 <= t < vocab for t in toks)
    argmax = logits.argmax(-1).tolist()
    assert toks[0] == argmax[0] and toks[2] == argmax[2] and toks[3] == argmax[3]
    assert toks[4] == argmax[4] and toks[10] == EOS
    assert toks[7] not in (EOS, 5, 6)
    assert [d is not None for d in out.logprobs] == [p.logprobs is not None for p in params]
    assert len(out.logprobs[4]) in (20, 21)
    raw = torch.log_softmax(logits.float().cpu(), -1)
    for r, t in enumerate(toks):
        assert out.sampled_logprobs[r] == pytest.approx(raw[r, t].item(), abs=1e-5)


def test_metadata_build_from_requests_and_length_check() -> None:
    params = SamplingParams(temperature=1.0, seed=4)
    reqs = [Request(f"r{i}", [1, 2, i], params, max_tokens=8, eos_token_ids=(EOS,)) for i in range(3)]
    reqs[1].output_token_ids.extend([5, 6])
    gen = seeded_generator(4, "cpu")
    meta = SamplingMetadata.build(reqs, {"r2": gen})
    assert meta.generators == [None, None, gen]
    assert meta.prompt_token_ids[2] == [1, 2, 2] and meta.output_token_ids[1] == [5, 6]
    assert meta.eos_token_ids == (EOS,)
    with pytest.raises(ValueError, match="length"):
        SamplingMetadata([params], [], [[]], [[]], ())


def test_fast_path_bf16_and_empty_batch() -> None:
    assert Sampler()(torch.zeros(0, 10), meta_for([])) == SamplerOutput([], [], [])
    logits = random_logits(3, 40, seed=2).to(torch.bfloat16)
    out = Sampler()(logits, meta_for([SamplingParams(temperature=0.0)] * 3))
    assert out.sampled_token_ids == logits.float().argmax(-1).tolist()
    with pytest.raises(ValueError):
        Sampler()(logits, meta_for([SamplingParams()] * 2))


@pytest.mark.cuda
def test_cuda_device_pass_makes_no_host_sync() -> None:
    vocab = 32_000
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=1),
        SamplingParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.3, logprobs=2),
        SamplingParams(temperature=0.7, top_k=20, min_tokens=5, stop_token_ids=[7]),
    ]
    logits = torch.randn(4, vocab, device="cuda")
    gens = [None, seeded_generator(1, "cuda"), None, None]
    meta = meta_for(params, prompts=[[1, 2, 3]] * 4, outputs=[[4, 4]] * 4, generators=gens)
    sampler = Sampler()
    sampler(logits, meta)  # warm up (lazy CUDA init, generator creation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = sampler.sample_tensors(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert dev.token_ids.shape == (4,) and dev.token_ids.is_cuda
