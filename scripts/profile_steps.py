"""Where an engine step goes on CUDA: step wall time, the model runner's host time, a bare graph replay.

Usage: python scripts/profile_steps.py [SHAPE NUM_PROMPTS INPUT_LEN OUTPUT_LEN]
(default: llama-3.2-1b 512 256 48; random weights of the named shape, greedy, EOS ignored).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from paged_backend.bench import random_prompts, write_shape_config
from paged_backend.llm import LLM
from paged_backend.sampling_params import SamplingParams


def timed(fn, n: int = 20) -> float:
    """Milliseconds per call of fn, GPU work included."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    n_prompts, n_in, n_out = (int(x) for x in (sys.argv[2:5] if len(sys.argv) > 4 else (512, 256, 48)))
    llm = LLM(model=write_shape_config(shape), load_format="dummy", max_model_len=2048, disable_log_stats=True)
    eng = llm.engine
    prompts = random_prompts(n_prompts, n_in, eng.info.vocab_size)
    sp = SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True, detokenize=False, temperature=0)
    llm.generate(prompts[:16], sp, use_tqdm=False)

    steps: list[tuple[float, float, int, int]] = []  # (step s, execute s, requests, tokens)
    cur: dict[str, float] = {}
    run_step, run_execute = eng.step, eng.runner.execute

    def execute(sched):
        t = time.perf_counter()
        out = run_execute(sched)
        cur.update(exec=time.perf_counter() - t, n=len(sched.scheduled),
                   tok=sum(s.num_new_tokens for s in sched.scheduled))
        return out

    def step():
        t = time.perf_counter()
        out = run_step()
        steps.append((time.perf_counter() - t, cur.get("exec", 0.0), int(cur.get("n", 0)), int(cur.get("tok", 0))))
        return out

    eng.runner.execute, eng.step = execute, step
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    total = time.perf_counter() - t
    dec = [r for r in steps if r[2] == r[3] and r[2] > 0]
    pre = [r for r in steps if r[3] > r[2]]
    print(f"{shape}: {n_prompts} x {n_in} in / {n_out} out: {total:.2f} s, {len(steps)} steps")
    if dec:
        print(f"decode: {len(dec)} steps, {sum(r[0] for r in dec):.2f} s; median step "
              f"{statistics.median(r[0] for r in dec) * 1e3:.2f} ms, runner host (inputs + launch) "
              f"{statistics.median(r[1] for r in dec) * 1e3:.2f} ms, batch {statistics.median(r[2] for r in dec)}")
    if pre:
        print(f"steps with prompt tokens: {len(pre)}, {sum(r[0] for r in pre):.2f} s; median "
              f"{statistics.median(r[0] for r in pre) * 1e3:.1f} ms at {statistics.median(r[3] for r in pre)} tokens")
    graphs = eng.runner.graphs
    if graphs is not None:
        size = graphs.bucket(min(n_prompts, graphs.max_size))
        print(f"bare graph replay of {size} rows: {timed(lambda: graphs.replay(size)):.2f} ms")
        hidden = graphs.outputs[size]
        ms = timed(lambda: eng.runner.model.compute_logits(hidden).argmax(-1).tolist())
        print(f"logits + argmax + copy to host for {size} rows: {ms:.2f} ms")
    print("forward passes:", eng.runner.step_counts)


if __name__ == "__main__":
    main()
