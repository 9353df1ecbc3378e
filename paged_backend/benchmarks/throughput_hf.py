"""``bench throughput --hf``: the same prompts through transformers, in the same process after
the engine is freed: padded-batch ``generate`` (``--hf-mode static``), its paged continuous
batching (``continuous``), or one row each (``both``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from paged_backend.benchmarks.throughput_table import result_row


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


def release_device_memory(device, before: str = "transformers") -> None:
    """Collect garbage and return the CUDA caching allocator's free blocks (so transformers sizes
    its cache from memory the freed engine no longer holds); prints what is free on CUDA."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        print(f"{device}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB before {before}")


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


def _cb_configs(target: HFTarget, prompts: list[list[int]], outs_len: list[int], args: argparse.Namespace):
    """(page size, ContinuousBatchingConfig, GenerationConfig, WorkloadHints) for this workload."""
    import math

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

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
    return page, cb_cfg, gen_cfg, hints


def _cb_timed(model, target: HFTarget, prompts: list[list[int]], outs_len: list[int], gen_cfg, cb_cfg
              ) -> tuple[list[int], float]:
    """The timed run on the persistent manager: ``generate_batch`` when every request asks for
    the same length, else one ``max_new_tokens`` per request. (tokens per request, seconds)"""
    from paged_backend.engine.gc_heap import frozen_heap

    _sync(target.device)
    t = time.perf_counter()
    with frozen_heap():  # as the engine's generate()
        if len(set(outs_len)) == 1:
            res = model.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                       persistent_manager=True, max_new_tokens=outs_len[0])
            got = [len(r.generated_tokens) for r in res.values() if r.error is None]
        else:
            with model.continuous_batching_context_manager(
                    generation_config=gen_cfg, continuous_batching_config=cb_cfg, persistent_manager=True) as mgr:
                got = _cb_run(mgr, prompts, outs_len)
        _sync(target.device)
    return got, time.perf_counter() - t


def _hf_continuous(model, target: HFTarget, prompts: list[list[int]], outs_len: list[int],
                   warm: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """transformers' paged continuous batching, greedy, EOS off (``eos_token_id=-1``).

    One manager, sized for this workload (the hints ``generate_batch`` would give it) and kept
    between calls: the untimed warm-up builds its cache, captures its CUDA graphs and runs
    ``warm``; the timed ``generate_batch`` reuses it. Per-request output lengths
    (``--random-range-ratio``) go through the same manager with one ``max_new_tokens`` each,
    as ``generate_batch`` takes one for all.
    """
    page, cb_cfg, gen_cfg, hints = _cb_configs(target, prompts, outs_len, args)
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
        got, dt = _cb_timed(model, target, prompts, outs_len, gen_cfg, cb_cfg)
    finally:
        model.destroy_cached_continuous_batching_manager()
    if got != outs_len:
        short = sum(1 for g, n in zip(got, outs_len, strict=False) if g != n) + len(outs_len) - len(got)
        raise RuntimeError(f"transformers continuous batching: {short} of {len(outs_len)} requests did not get "
                           f"their output length ({sum(got)} of {sum(outs_len)} tokens)")
    uniform = len(set(outs_len)) == 1
    label = "transformers generate_batch (continuous)" if uniform else "transformers continuous batching (per-request lengths)"
    return _hf_row(label, target, prompts, sum(got), dt)
