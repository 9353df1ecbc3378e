"""Kernel by kernel: one decode CUDA-graph replay after a generate (torch.profiler).

Usage: python scripts/profile_decode_graph.py [SHAPE NUM_PROMPTS INPUT_LEN OUTPUT_LEN KV_DTYPE]
(default: llama-3.1-8b 1000 512 128 auto; random weights of the named shape, greedy, EOS
ignored). The replay runs on the input buffers the last decode step left.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from paged_backend.benchmarks.model_shapes import write_shape_config
from paged_backend.benchmarks.throughput import random_prompts
from paged_backend.engine.llm import LLM
from paged_backend.sampling_params import SamplingParams


def main() -> None:
    args = sys.argv[1:]
    shape = args[0] if args else "llama-3.1-8b"
    n_prompts, n_in, n_out = (int(x) for x in (args[1:4] if len(args) > 3 else (1000, 512, 128)))
    kv = args[4] if len(args) > 4 else "auto"
    llm = LLM(model=write_shape_config(shape), load_format="dummy", max_model_len=2048, disable_log_stats=True,
              kv_cache_dtype=kv)
    eng = llm.engine
    prompts = random_prompts(n_prompts, n_in, eng.info.vocab_size)
    sp = SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True, detokenize=False, temperature=0)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    print(f"{shape}, kv {kv}: {n_prompts} x {n_in} / {n_out}: {time.perf_counter() - t:.2f} s")
    graphs = eng.runner.graphs
    if graphs is None:
        raise SystemExit("no CUDA graphs (CPU, or --enforce-eager)")
    size = graphs.bucket(min(n_prompts, graphs.max_size))
    seq_lens = graphs.inputs.seq_lens[:size].float()
    print(f"replayed rows: {size}, their mean context {seq_lens.mean().item():.0f} tokens")
    for _ in range(3):
        graphs.replay(size)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        graphs.replay(size)
    torch.cuda.synchronize()
    print(f"replay of {size} rows: {(time.perf_counter() - t) * 100:.2f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graphs.replay(size)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
