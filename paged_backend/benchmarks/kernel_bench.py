"""``Bench``: what the kernel benchmarks (``bench kernels``, its ``--variants`` sweep, ``bench
peer``) share: the device, the timing settings, the rows and failed checks so far, and the
attention inputs (random paged K/V caches, decode batches, one causal prefill request).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Protocol

from paged_backend.benchmarks.results import Row, rel_err, report_check
from paged_backend.benchmarks.timing import GIB, copies_to_touch, do_bench_ms, time_graph_ms


class PeerCells(Protocol):
    """What a ``bench peer`` group module uses of ``PeerBench`` (its device, checks, graph timing,
    rows and the ours-against-peer pairs), so such a module need not import ``peer``."""

    torch: Any
    args: argparse.Namespace
    dev: Any

    def check(self, name: str, got, ref, rel_tol: float) -> bool: ...

    def time_graph_ms(self, fns, replays: int = 20) -> float: ...

    def add(self, row: Row) -> Row: ...

    def pair(self, cell: str, ours: float, peer: float, peer_name: str) -> None: ...


class Bench:
    """Holds the device, the timing settings and the rows measured so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.torch = torch
        self.dev = torch.device("cuda")
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.copy_bw = float("nan")

    # -- timing, rows and checks ----------------------------------------------------------

    def time_ms(self, fn) -> float:
        """Median ms of ``triton.testing.do_bench`` at ``--rep``."""
        return do_bench_ms(fn, self.args.rep)

    def time_graph_ms(self, fns, replays: int = 20) -> float:
        """Median time per call of ``fns`` captured back to back in one CUDA graph (no host overhead)."""
        return time_graph_ms(fns, replays)

    def time_sets_ms(self, make, nbytes: float) -> float:
        """GPU time per call (ms) of ``make(i)``'s calls, each on its own input set, captured back to
        back in a CUDA graph: >= 1 GiB per replay (L2 cannot serve a rerun), and no host launch
        overhead (``do_bench`` with Python launches was host-bound for these kernels: a launcher's
        argument checks outlast the L2 flush between runs)."""
        return self.time_graph_ms([make(i) for i in range(copies_to_touch(nbytes, GIB, 16, least=2))])

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        flag = "" if row.ok is None else (" ok" if row.ok else " BELOW")
        print(f"  {row.group:<11} {row.name:<44} {row.ms:9.4f} ms {row.value:9.1f} {row.metric:<7} "
              f"{row.target}{flag}", flush=True)
        return row

    def check(self, name: str, got, ref, rel_tol: float) -> bool:
        return report_check(name, rel_err(got, ref), rel_tol, self.failures)

    # -- attention inputs -----------------------------------------------------------------

    def kv_cache(self, num_blocks: int, fp8: bool):
        """Random K/V cache; fp8 filled chunk by chunk from bf16 normals."""
        torch = self.torch
        a = self.args
        shape = (2, num_blocks, a.block_size, a.kv_heads, a.head_dim)
        if not fp8:
            return torch.empty(shape, dtype=torch.bfloat16, device=self.dev).normal_()
        from paged_backend.kernels.cache_write_ref import FP8_DTYPE

        cache = torch.empty(shape, dtype=FP8_DTYPE, device=self.dev)
        step = max(1, (GIB // 2) // (a.block_size * a.kv_heads * a.head_dim))
        for i in range(0, num_blocks, step):
            chunk = torch.empty_like(cache[:, i : i + step], dtype=torch.bfloat16).normal_()
            cache[:, i : i + step] = chunk.to(FP8_DTYPE)
        return cache

    def decode_inputs(self, batch: int, ctx: int, perm, copy: int = 0):
        """q, block tables, seq_lens, query_start_loc of ``batch`` decode requests at context ``ctx``.
        Batch ``copy`` uses its own disjoint blocks (copies rotate so L2 cannot serve a rerun)."""
        torch = self.torch
        a = self.args
        nblk = math.ceil(ctx / a.block_size)
        n = batch * nblk
        bt = perm[copy * n : (copy + 1) * n].view(batch, nblk).to(torch.int32)
        q = torch.randn((batch, a.heads, a.head_dim), dtype=torch.bfloat16, device=self.dev)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=self.dev)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=self.dev)
        return q, bt, sl, qsl

    def prefill_inputs(self, n: int, seed: int = 1):
        """One causal request of ``n`` new tokens: q, k, v [n, heads, head_dim] (bf16), a bf16 cache
        holding k / v in pages shuffled by ``seed``, its block table, seq_lens and query_start_loc."""
        torch = self.torch
        from paged_backend.kernels.cache_write import write_kv_cache

        a = self.args
        h, hkv, d, bs = a.heads, a.kv_heads, a.head_dim, a.block_size
        one = torch.ones((), device=self.dev)
        nblk = math.ceil(n / bs)
        cache = torch.empty((2, nblk + 1, bs, hkv, d), dtype=torch.bfloat16, device=self.dev).normal_()
        g = torch.Generator(device=self.dev).manual_seed(seed)
        bt = (torch.randperm(nblk, device=self.dev, generator=g) + 1).to(torch.int32)[None]
        q = torch.randn((n, h, d), dtype=torch.bfloat16, device=self.dev)
        k = torch.randn((n, hkv, d), dtype=torch.bfloat16, device=self.dev)
        v = torch.randn((n, hkv, d), dtype=torch.bfloat16, device=self.dev)
        pos = torch.arange(n, device=self.dev)
        write_kv_cache(k, v, cache, (bt[0].long()[pos // bs] * bs + pos % bs).contiguous(), one, one)
        sl = torch.tensor([n], dtype=torch.int32, device=self.dev)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=self.dev)
        return q, k, v, cache, bt, sl, qsl

    # -- output ---------------------------------------------------------------------------

    def summary(self) -> None:
        print("\n| group | case | ms | rate | target |")
        print("| --- | --- | ---: | ---: | --- |")
        for r in self.rows:
            if r.group.endswith("-variant"):  # --variants prints its own tables
                continue
            flag = "" if r.ok is None else (" ok" if r.ok else " **below**")
            print(f"| {r.group} | {r.name} | {r.ms:.4f} | {r.value:.1f} {r.metric} | {r.target}{flag} |")
        if self.failures:
            print(f"\nCHECKS FAILED: {', '.join(self.failures)}")


def add_attention_grid_args(p: argparse.ArgumentParser) -> None:
    """The paged-attention grid's flags, shared by ``bench kernels`` and ``bench peer``."""
    p.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    p.add_argument("--contexts", default="512,4096,32768", help="decode context lengths")
    p.add_argument("--prefill-lens", default="2048,8192", help="causal prefill lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--peak-bw", type=float, default=4.2e12, help="bandwidth the decode target is 80%% of")
