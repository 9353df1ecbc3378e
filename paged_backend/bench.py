"""``paged-backend bench throughput``: offline throughput on random token-id prompts.

Prompts are drawn exactly like the vLLM peer script (``torch.randint(100, 120000)`` with a
seeded generator, clipped to the vocabulary), every request produces exactly
``--output-len`` tokens (EOS ignored), and the time of one ``generate()`` over all prompts
is measured after a warm-up. ``--hf`` runs the same prompts through transformers'
padded-batch ``generate`` in the same process, for the side-by-side number.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

# model shapes by name (the peer script's W1 / W2 shapes)
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=8192),
}


def write_shape_config(name: str) -> str:
    """A config.json-only model dir for ``--load-format dummy`` runs."""
    d = tempfile.mkdtemp(prefix=f"pb_{name}_")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
               attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
               **MODEL_SHAPES[name])
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


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
    from paged_backend.cli import add_engine_args

    p = sub.add_parser("throughput", help="offline throughput on random prompts")
    add_engine_args(p, model_positional=True)
    p.add_argument("--model-shapes", choices=sorted(MODEL_SHAPES), default=None,
                   help="random weights of these shapes (implies --load-format dummy)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input/output lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--temperatures", default=None,
                   help="comma list, one timed run each (the vLLM peer script uses 0,1,0); default: --temperature once")
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--hf", action="store_true", help="also run transformers' padded-batch generate")
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF batch (default: all prompts at once)")
    p.add_argument("--json", default=None, help="append results as JSON lines to this file")
    p.set_defaults(func=run_throughput)


def run_throughput(args: argparse.Namespace) -> int:
    from paged_backend.cli import engine_config_from_args
    from paged_backend.llm import LLM
    from paged_backend.sampling_params import SamplingParams

    overrides: dict[str, Any] = {}
    if args.model_shapes:
        overrides.update(model=write_shape_config(args.model_shapes), load_format="dummy")
    cfg = engine_config_from_args(args, **overrides)
    llm = LLM(**cfg.model_dump())
    engine = llm.engine
    vocab = engine.info.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, range_ratio=args.random_range_ratio)
    outs_len = output_lens(args.num_prompts, args.output_len, args.random_range_ratio)

    def params(n_out: int, temp: float) -> SamplingParams:
        return SamplingParams(temperature=temp, max_tokens=n_out, min_tokens=n_out,
                              ignore_eos=True, detokenize=False)

    temps = [float(x) for x in args.temperatures.split(",")] if args.temperatures else [args.temperature]
    warm = random_prompts(args.warmup_prompts, args.input_len, vocab, seed=2)
    for temp in sorted(set(temps)):
        llm.generate(warm, params(8, temp), use_tqdm=False)
    n_in = sum(len(p) for p in prompts)
    rows = []
    for temp in temps:
        engine.reset_prefix_cache()
        engine.stats.peak_kv_usage = engine.stats.peak_kv_waste = 0.0
        t = time.perf_counter()
        outs = llm.generate(prompts, [params(n, temp) for n in outs_len], use_tqdm=False)
        dt = time.perf_counter() - t
        n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(dict(engine="paged-backend", device=str(engine.device),
                         dtype=str(engine.dtype).replace("torch.", ""), kv=str(engine.runner.kv_dtype).replace(
                             "torch.", ""), temperature=temp, prompts=len(prompts), input_tokens=n_in,
                         output_tokens=n_gen, elapsed_s=round(dt, 3), req_s=round(len(prompts) / dt, 2),
                         output_tok_s=round(n_gen / dt, 1), total_tok_s=round((n_gen + n_in) / dt, 1),
                         peak_kv_usage=round(engine.stats.peak_kv_usage, 4),
                         kv_waste=round(engine.stats.peak_kv_waste, 4)))
    counts = getattr(engine.runner, "step_counts", None)
    if counts is not None:
        print(f"forward passes: {counts['graph']} CUDA-graph replays, {counts['eager']} eager; "
              f"{engine.num_async_steps} steps sampled async")
    if len(rows) > 1:
        med = sorted(rows, key=lambda r: r["output_tok_s"])[len(rows) // 2]
        rows.append(dict(med, engine="paged-backend (median)", temperature="-"))
    if args.hf:
        rows.append(run_hf(engine, prompts, outs_len, args))
    print_table(rows)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def run_hf(engine, prompts: list[list[int]], outs_len: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """transformers' padded-batch greedy generate on the same prompts (left padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype).to(engine.device)
    model.eval()
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
    bsz = args.hf_batch_size or len(prompts)
    n_gen = 0
    t = time.perf_counter()
    for start in range(0, len(prompts), bsz):
        batch = prompts[start : start + bsz]
        n_out = max(outs_len[start : start + bsz])
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
                                 max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                                 pad_token_id=pad)
        n_gen += sum(outs_len[start : start + bsz])
        assert out.shape[1] - width == n_out
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n_in = sum(len(p) for p in prompts)
    return dict(engine=f"transformers generate (batch {bsz})", device=str(engine.device),
                dtype=str(engine.dtype).replace("torch.", ""), prompts=len(prompts), input_tokens=n_in,
                output_tokens=n_gen, elapsed_s=round(dt, 3), req_s=round(len(prompts) / dt, 2),
                output_tok_s=round(n_gen / dt, 1), total_tok_s=round((n_gen + n_in) / dt, 1),
                peak_kv_usage=None, kv_waste=None)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["engine", "device", "dtype", "kv", "temperature", "prompts", "input_tokens", "output_tokens", "elapsed_s", "req_s",
            "output_tok_s", "total_tok_s", "peak_kv_usage", "kv_waste"]
    widths = {c: max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c)).ljust(widths[c]) for c in cols))
