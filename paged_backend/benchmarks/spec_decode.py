"""``paged-backend bench spec-decode``: decode speed with and without speculation, per batch size.

For each batch size B of ``--batch-sizes``, B prompts of ``--input-len`` tokens are generated
together (``--output-len`` tokens each, EOS ignored) by two engines built one after the other from
the same arguments: the baseline (no speculation, the engine's default scheduling) and the one with
``--speculative-config``. A row per engine and batch size gives output tok/s, the speed-up over the
baseline, the draft counters (drafts, draft tokens, accepted tokens, acceptance rate, mean
acceptance length: tokens emitted per verified draft sequence; steps run without drafts because more
requests than ``disable_by_batch_size`` were in the scheduler) and, under greedy sampling, how many
of the B outputs equal the baseline's token for token (speculation must not change greedy output;
in bf16 a verification pass over several query tokens may round differently from one-token decode
steps, so a rare divergence late in a sequence is numerics, not a wrong acceptance).

``--workload repeat`` makes each prompt a random segment of ``--repeat-period`` tokens repeated to
the input length: text an n-gram proposer can look up, as in "repeat this text" prompts. Whether the
model continues the pattern is the model's: with random weights (``--model-shapes``) acceptance
measures the random model's own repetitions, not a real model's; a draft model with the target's
random weights (the same shapes and seed) accepts nearly everything and shows the ceiling, one with
other weights nearly nothing and shows the cost of drafting.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from paged_backend.benchmarks.model_shapes import add_model_shapes_args, model_shapes_overrides

SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
             "spec_decode_num_disabled_steps")


def spec_prompts(batch: int, input_len: int, vocab: int, workload: str = "random", period: int = 32,
                 seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``input_len`` token ids in [100, vocab): ``random``, or ``repeat`` (a random
    segment of ``period`` ids repeated to ``input_len``, a different segment per prompt)."""
    import torch

    if workload not in ("random", "repeat"):
        raise ValueError(f"workload must be 'random' or 'repeat', got {workload!r}")
    if input_len < 1 or period < 1 or vocab <= 100:
        raise ValueError("input_len and period must be >= 1 and the vocabulary larger than 100")
    g = torch.Generator().manual_seed(seed)
    if workload == "random":
        return torch.randint(100, vocab, (batch, input_len), generator=g).tolist()
    seg = torch.randint(100, vocab, (batch, period), generator=g)
    reps = -(-input_len // period)
    return seg.repeat(1, reps)[:, :input_len].tolist()


def add_spec_decode_parser(sub) -> None:
    from paged_backend.engine_args import add_engine_args

    p = sub.add_parser("spec-decode", help="decode tok/s with and without --speculative-config per batch size, "
                                           "with acceptance and a greedy-equality check")
    add_engine_args(p, model_positional=True)
    add_model_shapes_args(p)
    p.add_argument("--batch-sizes", default="1,4,16,64", help="requests generated together, comma-separated")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per request (EOS ignored)")
    p.add_argument("--workload", choices=("random", "repeat"), default="repeat",
                   help="repeat: each prompt a random segment repeated (n-gram lookup finds it); random: random ids")
    p.add_argument("--repeat-period", type=int, default=32, help="segment length of --workload repeat")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append every row as a JSON line to this file")
    p.set_defaults(func=run_spec_decode)


def _rows_for(llm, label: str, batches: list[int], args: argparse.Namespace) -> tuple[list[dict[str, Any]],
                                                                                   list[list[list[int]]]]:
    """One timed ``generate`` of B prompts per batch size B (after an untimed one of the same shapes):
    a row each, and the outputs' token ids, a list per batch."""
    from paged_backend.benchmarks.throughput import _params

    engine = llm.engine
    vocab = engine.info.vocab_size
    rows: list[dict[str, Any]] = []
    outputs: list[list[list[int]]] = []
    for b in batches:
        prompts = spec_prompts(b, args.input_len, vocab, args.workload, args.repeat_period, args.workload_seed + b)
        warm = spec_prompts(b, args.input_len, vocab, args.workload, args.repeat_period, args.workload_seed + 10**6 + b)
        params = _params(args.output_len, args.temperature)
        llm.generate(warm, _params(min(args.output_len, 32), args.temperature), use_tqdm=False)
        engine.reset_prefix_cache()
        before = engine.get_stats()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        after = engine.get_stats()
        outputs.append([list(o.outputs[0].token_ids) for o in outs])
        n_out = sum(len(ids) for ids in outputs[-1])
        row: dict[str, Any] = {"engine": label, "batch": b, "output_tokens": n_out, "elapsed_s": round(dt, 3),
                               "output_tok_s": round(n_out / dt, 1)}
        d = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_KEYS}
        drafts, draft_tokens, accepted, disabled = (d[k] for k in SPEC_KEYS)
        row.update(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted, disabled_steps=disabled,
                   acceptance_rate=round(accepted / draft_tokens, 4) if draft_tokens else None,
                   mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else None)
        rows.append(row)
    return rows, outputs


def _build(args: argparse.Namespace, speculative: bool):
    from paged_backend.engine.llm import LLM
    from paged_backend.engine_args import engine_config_from_args

    if not speculative:
        args = argparse.Namespace(**{**vars(args), "speculative_config": None})
    cfg = engine_config_from_args(args, **model_shapes_overrides(args))
    return LLM(**cfg.model_dump())


def print_spec_table(rows: list[dict[str, Any]]) -> None:
    cols = ("engine", "batch", "output_tok_s", "speedup", "acceptance_rate", "mean_acceptance_length",
            "disabled_steps", "greedy_equal")
    table = [[str(r.get(c, "") if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths, strict=True)))


def run_spec_decode(args: argparse.Namespace) -> int:
    from paged_backend.benchmarks.throughput_hf import release_device_memory

    if not args.speculative_config:
        print("error: bench spec-decode needs --speculative-config", flush=True)
        return 2
    batches = [int(x) for x in args.batch_sizes.split(",")]
    if args.max_num_seqs is None or args.max_num_seqs < max(batches):
        args.max_num_seqs = max(batches)
    results: list[tuple[list[dict[str, Any]], list[list[list[int]]]]] = []
    for speculative in (False, True):
        llm = _build(args, speculative)
        device = llm.engine.device
        method = llm.engine.config.speculative_config.method if speculative else None
        results.append(_rows_for(llm, f"speculative ({method})" if speculative else "no speculation", batches, args))
        llm.shutdown()
        del llm
        release_device_memory(device, before="the next engine")
    (base_rows, base_out), (spec_rows, spec_out) = results
    rows = []
    for i, (base, spec) in enumerate(zip(base_rows, spec_rows, strict=True)):
        b = base["batch"]
        spec["speedup"] = round(spec["output_tok_s"] / base["output_tok_s"], 3)
        if args.temperature == 0:
            same = sum(x == y for x, y in zip(base_out[i], spec_out[i], strict=True))
            spec["greedy_equal"] = f"{same}/{b}"
        rows += [base, spec]
    print_spec_table(rows)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0
