"""``paged-backend bench throughput``: offline throughput on random token-id prompts.

Prompts are random token ids (``torch.randint(100, 120000)`` with a seeded generator, modulo
the vocabulary; the vLLM runs it is compared with draw them the same way), every request produces exactly
``--output-len`` tokens (EOS ignored), and the time of one ``generate()`` over all prompts
is measured after a warm-up. ``--hf`` runs the same prompts through transformers in the same
process, after the engine is freed, for the side-by-side number: ``--hf-mode static`` (the
default) padded-batch ``generate``, ``continuous`` its paged continuous batching
(``generate_batch``), ``both`` one row each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

from paged_backend.benchmarks.bench_plot import plot_args_error
from paged_backend.benchmarks.model_shapes import add_model_shapes_args, model_shapes_overrides
from paged_backend.benchmarks.throughput_hf import HFTarget, release_device_memory, run_hf
from paged_backend.benchmarks.throughput_plot import (
    KVUsageTrace,
    add_throughput_plot_args,
    write_throughput_plot,
)
from paged_backend.benchmarks.throughput_table import print_table, result_row


def random_prompts(n: int, input_len: int, vocab: int, seed: int = 1, range_ratio: float = 0.0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 120000, (n, input_len), generator=g) % vocab
    if range_ratio <= 0:
        return ids.tolist()
    lo, hi = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    big = torch.randint(100, 120000, (n, hi), generator=g) % vocab
    return [big[i, :length].tolist() for i, length in enumerate(lens)]


def output_lens(n: int, output_len: int, range_ratio: float, seed: int = 3) -> list[int]:
    import torch

    if range_ratio <= 0:
        return [output_len] * n
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def add_throughput_parser(sub) -> None:
    from paged_backend.engine_args import add_engine_args

    p = sub.add_parser("throughput", help="offline throughput on random prompts")
    add_engine_args(p, model_positional=True)
    add_model_shapes_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input/output lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--temperatures", default=None,
                   help="comma list, one timed run each (the vLLM comparison runs use 0,1,0); default: --temperature once")
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--structured-outputs", default=None, metavar="JSON",
                   help='every timed request constrained, e.g. \'{"json": {"type": "object", ...}}\' '
                        "(SamplingParams.structured_outputs); a grammar that completes leaves the rest of the "
                        "request unconstrained (EOS is ignored): pick one longer than --output-len")
    p.add_argument("--hf", action="store_true", help="also run the prompts through transformers (--hf-mode)")
    p.add_argument("--hf-mode", choices=("static", "continuous", "both"), default="static",
                   help="static: padded-batch generate; continuous: transformers' paged continuous batching "
                        "(generate_batch); both: one row each")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="static HF batch (default: all prompts at once)")
    p.add_argument("--hf-num-blocks", type=int, default=None,
                   help="continuous: KV cache blocks (transformers' page_size tokens each); default: transformers "
                        "sizes it from free GPU memory, on CPU the blocks the whole workload needs")
    p.add_argument("--hf-max-batch-tokens", type=int, default=None,
                   help="continuous: tokens per forward pass (default: transformers')")
    p.add_argument("--json", default=None, help="append results as JSON lines to this file")
    add_throughput_plot_args(p)
    p.set_defaults(func=run_throughput)


def _params(n_out: int, temp: float, structured: dict[str, Any] | None = None):
    """Exactly ``n_out`` tokens, EOS ignored, no detokenization."""
    from paged_backend.sampling_params import SamplingParams

    return SamplingParams(temperature=temp, max_tokens=n_out, min_tokens=n_out, ignore_eos=True, detokenize=False,
                          structured_outputs=structured)


def _timed_runs(llm, prompts: list[list[int]], outs_len: list[int], temps: list[float],
                structured: dict[str, Any] | None = None,
                kv_traces: list[tuple[str, list[tuple[float, float]]]] | None = None) -> list[dict[str, Any]]:
    """One timed ``generate`` over all prompts per temperature (the prefix cache reset before
    each), a row each; says so when kernels compiled inside a timed run. With ``kv_traces`` each
    run's KV-cache usage per step is added to it."""
    from paged_backend.kernels._launch import compiled_variants

    engine = llm.engine
    variants = sum(compiled_variants().values())
    rows = []
    for temp in temps:
        engine.reset_prefix_cache()
        engine.stats.peak_kv_usage = engine.stats.peak_kv_waste = 0.0
        params = [_params(n, temp, structured) for n in outs_len]
        preempted = engine.get_stats()["num_preemptions"]
        with KVUsageTrace(engine) if kv_traces is not None else contextlib.nullcontext() as trace:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
        if trace is not None:
            kv_traces.append((f"run {len(rows) + 1} (T={temp})", trace.samples))
        n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
        now = sum(compiled_variants().values())
        if now > variants:  # compiles inside the timed window: the run is not steady-state
            print(f"run {len(rows) + 1}: {now - variants} Triton kernel variants compiled during the run")
        variants = now
        rows.append(result_row("paged-backend", engine.device, engine.dtype, engine.runner.kv_dtype, temp, prompts,
                               n_gen, dt, peak_kv_usage=round(engine.stats.peak_kv_usage, 4),
                               kv_waste=round(engine.stats.peak_kv_waste, 4)))
        rows[-1]["preemptions"] = engine.get_stats()["num_preemptions"] - preempted
    return rows


def run_throughput(args: argparse.Namespace) -> int:
    from paged_backend.engine.llm import LLM
    from paged_backend.engine_args import engine_config_from_args

    error = plot_args_error(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    cfg = engine_config_from_args(args, **model_shapes_overrides(args))
    llm = LLM(**cfg.model_dump())
    engine = llm.engine
    vocab = engine.info.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, range_ratio=args.random_range_ratio)
    outs_len = output_lens(args.num_prompts, args.output_len, args.random_range_ratio)
    temps = [float(x) for x in args.temperatures.split(",")] if args.temperatures else [args.temperature]
    warm = random_prompts(args.warmup_prompts, args.input_len, vocab, seed=2)
    structured = json.loads(args.structured_outputs) if args.structured_outputs else None
    for temp in sorted(set(temps)):
        llm.generate(warm, _params(8, temp, structured), use_tqdm=False)
    kv_traces: list[tuple[str, list[tuple[float, float]]]] | None = [] if args.plot else None
    rows = _timed_runs(llm, prompts, outs_len, temps, structured, kv_traces)
    counts = getattr(engine.runner, "step_counts", None)
    if counts is not None:
        print(f"forward passes: {counts['graph']} CUDA-graph replays, {counts['eager']} eager; "
              f"{engine.num_async_steps} steps sampled async")
    if len(rows) > 1:
        med = sorted(rows, key=lambda r: r["output_tok_s"])[len(rows) // 2]
        rows.append(dict(med, engine="paged-backend (median)", temperature="-"))
    if args.hf:
        target = HFTarget.of(engine)
        llm.shutdown()
        del llm, engine  # transformers gets the device to itself (and sizes its paged cache from it)
        release_device_memory(target.device)
        rows.extend(run_hf(target, prompts, outs_len, warm, args))
    print_table(rows)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if args.plot and not write_throughput_plot(args, rows, kv_traces or []):
        return 1
    return 0
