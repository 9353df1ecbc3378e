"""``paged-backend bench shared-prefix``: D distinct documents of L tokens, each asked Q questions.

The workload of a prefix cache with a host tier: every prompt is one document's L tokens followed by
a question of ``--question-len`` tokens (random ids, ``--workload-seed``; each document starts with a
marker token of its own, so no two share even their first block). The
requests go in rounds (``--order round-robin``: question 1 of every document, then question 2 ...), so
with more documents than the device KV cache holds a document's blocks are evicted before its next
question comes: without a host tier the document is recomputed, with ``--swap-space`` it is copied
back from the host. ``--order doc`` asks each document's questions back to back (the device cache
alone serves them). A closed loop keeps ``--max-concurrency`` requests in the engine; TTFT is the
time from adding a request to its first token. Run it twice, with and without ``--swap-space``, on
the same ``--num-gpu-blocks-override`` to see what the tier buys.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from typing import Any

from paged_backend.benchmarks.model_shapes import add_model_shapes_args, model_shapes_overrides


def shared_prefix_prompts(num_docs: int, doc_len: int, questions: int, question_len: int, vocab: int,
                          seed: int = 0, order: str = "round-robin") -> list[tuple[int, list[int]]]:
    """(document index, prompt ids) for every question: ``num_docs`` documents of ``doc_len`` random
    token ids, each followed by ``questions`` different questions of ``question_len`` ids. Document i
    starts with token ``100 + i`` (then random ids in [100 + num_docs, vocab)), so no two documents
    share a first block. ``order``: ``round-robin`` (question j of every document, then j + 1) or
    ``doc`` (each document's questions together)."""
    import torch

    if order not in ("round-robin", "doc"):
        raise ValueError(f"order must be 'round-robin' or 'doc', got {order!r}")
    lo = 100 + num_docs
    if doc_len < 1 or question_len < 1 or lo >= vocab:
        raise ValueError("doc_len and question_len must be >= 1 and the vocabulary larger than 100 + num_docs")
    g = torch.Generator().manual_seed(seed)
    docs = torch.randint(lo, vocab, (num_docs, doc_len), generator=g)
    docs[:, 0] = torch.arange(100, 100 + num_docs)
    qs = torch.randint(lo, vocab, (num_docs, questions, question_len), generator=g).tolist()
    doc_ids = docs.tolist()
    pairs = ([(d, q) for q in range(questions) for d in range(num_docs)] if order == "round-robin"
             else [(d, q) for d in range(num_docs) for q in range(questions)])
    return [(d, doc_ids[d] + qs[d][q]) for d, q in pairs]


def add_shared_prefix_parser(sub) -> None:
    from paged_backend.engine_args import add_engine_args

    p = sub.add_parser("shared-prefix", help="D documents of L tokens, each asked Q questions: TTFT and throughput "
                                             "of the prefix cache (with or without --swap-space)")
    add_engine_args(p, model_positional=True)
    add_model_shapes_args(p, tokenizer=False)
    p.add_argument("--num-docs", type=int, default=64, help="distinct documents (D)")
    p.add_argument("--doc-len", type=int, default=2048, help="tokens per document (L)")
    p.add_argument("--questions-per-doc", type=int, default=4, help="questions asked of each document (Q)")
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per question (EOS ignored)")
    p.add_argument("--order", choices=("round-robin", "doc"), default="round-robin",
                   help="round-robin: question j of every document, then j + 1; doc: each document's together")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in the engine at once")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random documents and questions")
    p.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    p.set_defaults(func=run_shared_prefix)


def run_closed_loop(engine, prompts: list[list[int]], output_len: int, concurrency: int) -> dict[str, Any]:
    """Keep ``concurrency`` requests in ``engine`` until every prompt has run; per-request TTFT (s)
    from being added to its first token, and the wall time."""
    from paged_backend.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    todo = deque(enumerate(prompts))
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    n_out = 0
    live = 0
    t0 = time.perf_counter()
    while todo or live:
        while todo and live < concurrency:
            i, ids = todo.popleft()
            rid = f"q{i}"
            added[rid] = time.perf_counter()
            engine.add_request(rid, ids, params)
            live += 1
        for out in engine.step():
            now = time.perf_counter()
            new = len(out.outputs[0].token_ids) if out.outputs else 0  # deltas
            if new and out.request_id not in ttft:
                ttft[out.request_id] = now - added[out.request_id]
            n_out += new
            live -= out.finished
    return {"elapsed_s": time.perf_counter() - t0, "ttft_s": [ttft[r] for r in added], "output_tokens": n_out}


def _pct(values: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(values, p))


def run_shared_prefix(args: argparse.Namespace) -> int:
    from paged_backend.engine.llm import LLM
    from paged_backend.engine_args import engine_config_from_args

    cfg = engine_config_from_args(args, **model_shapes_overrides(args))
    llm = LLM(**cfg.model_dump())
    engine = llm.engine
    work = shared_prefix_prompts(args.num_docs, args.doc_len, args.questions_per_doc, args.question_len,
                                 engine.info.vocab_size, args.workload_seed, args.order)
    prompts = [ids for _, ids in work]
    # warm-up: kernels compiled outside the timed loop, on prompts sharing nothing with the workload
    warm = shared_prefix_prompts(2, args.doc_len, 1, args.question_len, engine.info.vocab_size,
                                 args.workload_seed + 1)
    run_closed_loop(engine, [ids for _, ids in warm], 4, args.max_concurrency)
    engine.reset_prefix_cache()
    before = engine.get_stats()
    res = run_closed_loop(engine, prompts, args.output_len, args.max_concurrency)
    stats = engine.get_stats()
    dt, ttft = res["elapsed_s"], res["ttft_s"]
    n_in = sum(len(p) for p in prompts)
    row = {
        "num_docs": args.num_docs, "doc_len": args.doc_len, "questions_per_doc": args.questions_per_doc,
        "question_len": args.question_len, "output_len": args.output_len, "order": args.order,
        "max_concurrency": args.max_concurrency, "swap_space_gib": cfg.swap_space,
        "num_gpu_blocks": engine.kv.block_pool.num_blocks,
        "num_host_blocks": engine.swap.pool.num_blocks if engine.swap is not None else 0,
        "requests": len(prompts), "elapsed_s": round(dt, 3), "req_s": round(len(prompts) / dt, 2),
        "output_tok_s": round(res["output_tokens"] / dt, 1), "total_tok_s": round((n_in + res["output_tokens"]) / dt, 1),
        "ttft_p50_ms": round(1e3 * _pct(ttft, 50), 2), "ttft_p99_ms": round(1e3 * _pct(ttft, 99), 2),
    }
    for key in ("prefix_cache_queries", "prefix_cache_hits", "host_prefix_cache_hits", "num_preemptions"):
        row[key] = stats[key] - before[key]
    row["device_hit_rate"] = round(row["prefix_cache_hits"] / max(row["prefix_cache_queries"], 1), 4)
    row["host_hit_rate"] = round(row["host_prefix_cache_hits"] / max(row["prefix_cache_queries"], 1), 4)
    for k, v in row.items():
        print(f"{k:>24}: {v}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    llm.shutdown()
    return 0
