"""``paged-backend bench throughput``: offline throughput on random token-id prompts.

Prompts are drawn exactly like the vLLM peer script (``torch.randint(100, 120000)`` with a
seeded generator, clipped to the vocabulary), every request produces exactly
``--output-len`` tokens (EOS ignored), and the time of one ``generate()`` over all prompts
is measured after a warm-up. ``--hf`` runs the same prompts through transformers in the same
process, after the engine is freed, for the side-by-side number: ``--hf-mode static`` (the
default) padded-batch ``generate``, ``continuous`` its paged continuous batching
(``generate_batch``), ``both`` one row each.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
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


def write_shape_config(name: str, tokenizer_from: str | os.PathLike[str] | None = None) -> str:
    """A model dir for ``--load-format dummy`` runs: config.json, and a tokenizer if asked for.

    ``tokenizer_from`` is an HF tokenizer dir (byte-level BPE) copied in with its vocabulary
    padded to the shapes' vocab size (:func:`pad_tokenizer`), so that text prompts work and
    every sampled id detokenizes; without it the engine takes token-id prompts only.
    """
    d = tempfile.mkdtemp(prefix=f"pb_{name}_")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
               attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
               **MODEL_SHAPES[name])
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    if tokenizer_from is not None:
        pad_tokenizer(tokenizer_from, d, MODEL_SHAPES[name]["vocab_size"])
    return d


TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
_PAD_PREFIX = "\u0120"  # byte-level BPE's character for the space byte


def _pad_codes(taken: set[str], n: int) -> list[str]:
    """``n`` strings 'Ġ' + lower-case letters (3 of them, then 4, ...) that are not in ``taken``."""
    import itertools
    import string

    out: list[str] = []
    if n <= 0:
        return out
    for length in itertools.count(3):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            piece = _PAD_PREFIX + "".join(letters)
            if piece not in taken:
                out.append(piece)
                if len(out) == n:
                    return out
    raise AssertionError("unreachable")


def pad_tokenizer(src: str | os.PathLike[str], dst: str | os.PathLike[str], vocab_size: int) -> int:
    """Copy the HF tokenizer in ``src`` to ``dst`` with ids up to ``vocab_size`` - 1 in its vocabulary.

    A random-weights model of a real model's shapes samples any id below its vocab size;
    a smaller tokenizer (SmolLM2's 49152 for Llama-3's 128256) pads its byte-level BPE
    vocabulary with entries 'Ġ' + a letter code (ids the tokenizer has neither in its
    vocabulary nor as added tokens). BPE merges only build strings that are already in the
    vocabulary, so encoding any text gives the same ids as before, and each new id decodes
    to a space and its letters. Copies tokenizer.json and the files in ``TOKENIZER_FILES``
    that exist; returns the number of entries added.
    """
    import shutil
    from pathlib import Path

    src, dst = Path(src), Path(dst)
    with open(src / "tokenizer.json", encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    decoder = (spec.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        raise ValueError(f"{src}: only byte-level BPE tokenizers can be padded "
                         f"(model {model.get('type')!r}, decoder {decoder!r})")
    vocab: dict[str, int] = model["vocab"]
    used = set(vocab.values()) | {int(t["id"]) for t in spec.get("added_tokens") or []}
    if max(used) >= vocab_size:
        raise ValueError(f"{src}: the tokenizer has id {max(used)}, not below vocab_size {vocab_size}")
    free = [i for i in range(vocab_size) if i not in used]
    vocab.update(zip(_pad_codes(set(vocab), len(free)), free, strict=True))
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    with open(dst / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    return len(free)


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
    p.set_defaults(func=run_throughput)


def run_throughput(args: argparse.Namespace) -> int:
    from paged_backend.engine.llm import LLM
    from paged_backend.engine_args import engine_config_from_args
    from paged_backend.kernels._launch import compiled_variants
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
    variants = sum(compiled_variants().values())
    rows = []
    for temp in temps:
        engine.reset_prefix_cache()
        engine.stats.peak_kv_usage = engine.stats.peak_kv_waste = 0.0
        t = time.perf_counter()
        outs = llm.generate(prompts, [params(n, temp) for n in outs_len], use_tqdm=False)
        dt = time.perf_counter() - t
        n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
        now = sum(compiled_variants().values())
        if now > variants:  # compiles inside the timed window: the run is not steady-state
            print(f"run {len(rows) + 1}: {now - variants} Triton kernel variants compiled during the run")
        variants = now
        rows.append(result_row("paged-backend", engine.device, engine.dtype, engine.runner.kv_dtype, temp, prompts,
                               n_gen, dt, peak_kv_usage=round(engine.stats.peak_kv_usage, 4),
                               kv_waste=round(engine.stats.peak_kv_waste, 4)))
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
    return 0


@dataclass(frozen=True)
class HFTarget:
    """What transformers needs from the engine, taken before the engine is freed for the HF runs."""

    model_dir: str
    dummy: bool  # load_format="dummy": config.json only, random weights
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    pad_token_id: int

    @classmethod
    def of(cls, engine) -> HFTarget:
        tok = engine.tokenizer  # None for a dummy model dir without a tokenizer
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
        return cls(model_dir=str(engine.model_dir), dummy=engine.config.load_format == "dummy", dtype=engine.dtype,
                   device=engine.device, pad_token_id=pad)


def release_device_memory(device) -> None:
    """Collect garbage and return the CUDA caching allocator's free blocks (so transformers sizes
    its cache from memory the freed engine no longer holds); prints what is free on CUDA."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        print(f"{device}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB before transformers")


def run_hf(target: HFTarget, prompts: list[list[int]], outs_len: list[int], warm: list[list[int]],
           args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same prompts through transformers, greedy, every request exactly its output length.

    ``--hf-mode static``: padded-batch ``generate`` (left padding, ``--hf-batch-size`` prompts
    per call); ``continuous``: transformers' paged continuous batching (``generate_batch``);
    ``both``: one row each. A dummy model is built with ``from_config`` (random weights, as
    the engine's) on the engine's device and dtype. Each mode runs ``warm`` first, untimed.
    """
    model = hf_model(target)
    rows = []
    if args.hf_mode in ("static", "both"):
        rows.append(_hf_static(model, target, prompts, outs_len, warm, args.hf_batch_size or len(prompts)))
        release_device_memory(target.device)
    if args.hf_mode in ("continuous", "both"):
        rows.append(_hf_continuous(model, target, prompts, outs_len, warm, args))
    return rows


def hf_model(target: HFTarget):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if target.dummy:
        cfg = AutoConfig.from_pretrained(target.model_dir)
        with torch.device(target.device):  # random init straight on the device
            model = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=target.dtype).to(target.device)
    return model.eval()


def result_row(label: str, device, dtype, kv_dtype, temperature: float, prompts: list[list[int]], n_gen: int,
               dt: float, peak_kv_usage: float | None = None, kv_waste: float | None = None) -> dict[str, Any]:
    """One row of the table: a timed run of ``prompts`` that generated ``n_gen`` tokens in ``dt`` s."""
    n_in = sum(len(p) for p in prompts)
    return dict(engine=label, device=str(device), dtype=str(dtype).replace("torch.", ""),
                kv=str(kv_dtype).replace("torch.", ""), temperature=temperature, prompts=len(prompts),
                input_tokens=n_in, output_tokens=n_gen, elapsed_s=round(dt, 3), req_s=round(len(prompts) / dt, 2),
                output_tok_s=round(n_gen / dt, 1), total_tok_s=round((n_gen + n_in) / dt, 1),
                peak_kv_usage=peak_kv_usage, kv_waste=kv_waste)


def _hf_row(label: str, target: HFTarget, prompts: list[list[int]], n_gen: int, dt: float) -> dict[str, Any]:
    return result_row(label, target.device, target.dtype, target.dtype, 0.0, prompts, n_gen, dt)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_static(model, target: HFTarget, prompts: list[list[int]], outs_len: list[int], warm: list[list[int]],
               bsz: int) -> dict[str, Any]:
    """Padded batches of ``bsz`` prompts; each batch runs to its longest output, only the
    requested tokens are counted."""
    import torch

    from paged_backend.engine.gc_heap import frozen_heap

    def generate(batch: list[list[int]], n_out: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), target.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                 max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                                 pad_token_id=target.pad_token_id)
        if out.shape[1] - width != n_out:
            raise RuntimeError(f"transformers generate gave {out.shape[1] - width} new tokens, not {n_out}")

    for start in range(0, len(warm), bsz):
        generate(warm[start : start + bsz], 8)
    _sync(target.device)
    n_gen = 0
    t = time.perf_counter()
    with frozen_heap():  # as the engine's generate()
        for start in range(0, len(prompts), bsz):
            generate(prompts[start : start + bsz], max(outs_len[start : start + bsz]))
            n_gen += sum(outs_len[start : start + bsz])
        _sync(target.device)
    dt = time.perf_counter() - t
    return _hf_row(f"transformers generate (batch {bsz})", target, prompts, n_gen, dt)


def _cb_run(manager, prompts: list[list[int]], outs_len: list[int]) -> list[int]:
    """Submit every prompt with its own max_new_tokens to a started continuous-batching manager;
    wait for all; return the generated-token counts in prompt order."""
    ids = []
    for p, n in zip(prompts, outs_len, strict=True):
        rid = manager.add_request(p, max_new_tokens=n)
        if rid is None:
            raise RuntimeError("transformers' continuous batching manager refused a request")
        ids.append(rid)
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        res = manager.get_result(timeout=1)
        if res is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' continuous batching loop stopped with {len(done)} of "
                                   f"{len(ids)} requests finished")
        elif res.is_finished():
            done[res.request_id] = res
    failed = [r for r in done.values() if r.error is not None]
    if failed:
        raise RuntimeError(f"transformers continuous batching: {len(failed)} requests failed: {failed[0].error}")
    return [len(done[rid].generated_tokens) for rid in ids]


def _hf_continuous(model, target: HFTarget, prompts: list[list[int]], outs_len: list[int],
                   warm: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """transformers' paged continuous batching, greedy, EOS off (``eos_token_id=-1``).

    One manager, sized for this workload (the hints ``generate_batch`` would give it) and kept
    between calls: the untimed warm-up builds its cache, captures its CUDA graphs and runs
    ``warm``; the timed ``generate_batch`` reuses it. Per-request output lengths
    (``--random-range-ratio``) go through the same manager with one ``max_new_tokens`` each,
    as ``generate_batch`` takes one for all.
    """
    import math

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from paged_backend.engine.gc_heap import frozen_heap

    # page_size (transformers >= 5.17's name; block_size before, a deprecated alias after)
    page = getattr(ContinuousBatchingConfig(), "page_size", None) or ContinuousBatchingConfig().block_size
    num_blocks = args.hf_num_blocks
    if num_blocks is None and target.device.type != "cuda":
        # transformers would size a CPU cache from 60% of the host's RAM: take what the workload needs
        num_blocks = sum(math.ceil((len(p) + n) / page) for p, n in zip(prompts, outs_len, strict=True)) + 1
    cb_cfg = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=args.hf_max_batch_tokens)
    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=target.pad_token_id,
                               max_new_tokens=max(outs_len))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(outs_len),
                          num_requests=len(prompts))
    uniform = len(set(outs_len)) == 1
    try:
        with model.continuous_batching_context_manager(generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                                       persistent_manager=True, workload_hints=hints) as manager:
            got = _cb_run(manager, warm, [8] * len(warm))
            if got != [8] * len(warm):
                raise RuntimeError(f"transformers continuous batching warm-up gave {got} tokens, not 8 each")
            attn = model.config._attn_implementation
        cfg = manager.continuous_batching_config
        print(f"transformers continuous batching: attention {attn}, {cfg.num_blocks} blocks of {page} tokens, "
              f"max_batch_tokens {cfg.max_batch_tokens}, max_requests_per_batch {cfg.max_requests_per_batch}, "
              f"CUDA graphs {cfg.use_cuda_graph}")
        _sync(target.device)
        t = time.perf_counter()
        with frozen_heap():  # as the engine's generate()
            if uniform:
                res = model.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                           persistent_manager=True, max_new_tokens=outs_len[0])
                got = [len(r.generated_tokens) for r in res.values() if r.error is None]
            else:
                with model.continuous_batching_context_manager(
                        generation_config=gen_cfg, continuous_batching_config=cb_cfg, persistent_manager=True) as mgr:
                    got = _cb_run(mgr, prompts, outs_len)
            _sync(target.device)
        dt = time.perf_counter() - t
    finally:
        model.destroy_cached_continuous_batching_manager()
    if got != outs_len:
        short = sum(1 for g, n in zip(got, outs_len, strict=False) if g != n) + len(outs_len) - len(got)
        raise RuntimeError(f"transformers continuous batching: {short} of {len(outs_len)} requests did not get "
                           f"their output length ({sum(got)} of {sum(outs_len)} tokens)")
    label = "transformers generate_batch (continuous)" if uniform else "transformers continuous batching (per-request lengths)"
    return _hf_row(label, target, prompts, sum(got), dt)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["engine", "device", "dtype", "kv", "temperature", "prompts", "input_tokens", "output_tokens", "elapsed_s", "req_s",
            "output_tok_s", "total_tok_s", "peak_kv_usage", "kv_waste"]
    widths = {c: max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c)).ljust(widths[c]) for c in cols))
