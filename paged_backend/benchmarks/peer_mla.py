"""``bench peer --only mla``: latent-attention decode, ours beside vLLM's MLA decode kernels.

One query token per request over a bf16 latent cache of 576 values a token (kv_lora_rank 512 + rope 64,
``paged_backend/kernels/mla_attention.py``'s layout), at each of ``--batches`` x ``--mla-contexts`` x ``--mla-heads``:

    ours         ``mla_attention`` (the engine's kernel) at block size 16 (the engine's default) and 64
    FlashMLA     vLLM's FLASHMLA backend kernel (block size 64 only; its scheduling metadata made
                 on the first call, outside the timing, as vLLM does once per step)
    FA3-MLA      vLLM's FLASH_ATTN_MLA backend: FlashAttention-3 with the rope part as q / k and the
                 latent as q_v / v (AOT scheduler metadata, at most 32 splits, as under its CUDA graphs)
    Triton-MLA   vLLM's TRITON_MLA backend kernel (``decode_attention_fwd``, its split count rule)

fp8 cells (``--mla-fp8``) time ours (the default: int16 word pairs up to 32-head blocks; and the cache read as
bytes) and Triton-MLA over an e4m3 cache (scale 1). Every kernel is
checked against ``mla_attention_ref`` on the first requests, then timed as CUDA-graph replays over
rotating block tables (L2 cannot serve a rerun). The bandwidth counts the latents read plus q and out.
"""

from __future__ import annotations

import math

from paged_backend.benchmarks.kernel_bench import PeerCells
from paged_backend.benchmarks.results import Row, parse_ints
from paged_backend.benchmarks.timing import GIB, copies_to_touch

KV_LORA, ROPE = 512, 64
LATENT = KV_LORA + ROPE
SCALE = 192**-0.5  # DeepSeek's softmax scale (qk_nope 128 + rope 64), no YaRN factor
TOL = 2e-2


def add_arguments(p) -> None:
    p.add_argument("--mla-heads", default="16,128", help="mla: query heads (DeepSeek-V2-Lite 16, V3 128)")
    p.add_argument("--mla-contexts", default="1024,8192,32768", help="mla: decode context lengths")
    p.add_argument("--mla-fp8", action="store_true", help="mla: also time an e4m3 latent cache")


def run(bench: PeerCells) -> None:
    torch = bench.torch
    a = bench.args
    batches, contexts = parse_ints(a.batches), parse_ints(a.mla_contexts)
    most = max(b * c for b in batches for c in contexts)
    kinds = ("bf16", "fp8") if a.mla_fp8 else ("bf16",)
    for kind in kinds:
        caches = {bs: _cache(torch, bench.dev, most // bs + 1, bs, kind == "fp8") for bs in (16, 64)}
        for h in parse_ints(a.mla_heads):
            for b in batches:
                for c in contexts:
                    _cell(bench, kind, h, b, c, caches)
        del caches
        torch.cuda.empty_cache()


def _cache(torch, dev, num_blocks: int, bs: int, fp8: bool):
    cache = torch.empty((num_blocks, bs, LATENT), dtype=torch.bfloat16, device=dev).normal_()
    if fp8:
        from paged_backend.kernels.fp8_types import FP8_DTYPE

        cache = cache.to(FP8_DTYPE)
    return cache


def _inputs(torch, dev, b: int, c: int, h: int, bs: int, perm, copy: int):
    nblk = math.ceil(c / bs)
    bt = perm[copy * b * nblk : (copy + 1) * b * nblk].view(b, nblk).to(torch.int32)
    q = torch.randn((b, h, LATENT), dtype=torch.bfloat16, device=dev)
    sl = torch.full((b,), c, dtype=torch.int32, device=dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    return q, bt, sl, qsl


def _cell(bench: PeerCells, kind: str, h: int, b: int, c: int, caches: dict) -> None:
    torch = bench.torch
    from paged_backend.kernels.mla_attention import mla_attention, row_positions
    from paged_backend.kernels.mla_attention_ref import mla_attention_ref

    a = bench.args
    fp8 = kind == "fp8"
    one = torch.ones((), device=bench.dev)
    kv_bytes = b * c * LATENT * caches[16].element_size()
    io_bytes = b * h * (LATENT + KV_LORA) * 2
    cell = f"mla {kind} heads {h} batch {b} ctx {c}"
    times: dict[str, float] = {}
    for bs, cache in caches.items():
        perm = torch.randperm(cache.shape[0] - 1, device=bench.dev) + 1
        nblk = math.ceil(c / bs)
        copies = max(1, min(copies_to_touch(kv_bytes, GIB, 16), len(perm) // (b * nblk)))
        sets = [_inputs(torch, bench.dev, b, c, h, bs, perm, i) for i in range(copies)]
        rows = row_positions(sets[0][2], sets[0][3], b)
        q, bt, sl, qsl = sets[0]
        n = min(b, 4)  # the reference on the first requests only
        ref = mla_attention_ref(q[:n], cache, bt[:n], sl[:n], qsl[: n + 1], SCALE, KV_LORA, one)
        calls = {f"ours bs{bs}": lambda s, cache=cache, rows=rows: mla_attention(
            s[0], cache, s[1], s[2], s[3], SCALE, KV_LORA, one, max_seq_len=c, rows=rows)}
        if fp8:  # the e4m3 cache read as bytes (head blocks up to 32 read word pairs by default: reads_pairs)
            calls[f"ours bs{bs} bytes"] = lambda s, cache=cache, rows=rows: mla_attention(
                s[0], cache, s[1], s[2], s[3], SCALE, KV_LORA, one, max_seq_len=c, rows=rows, fp8_pairs=False)
        calls.update(_peers(torch, cache, bs, fp8, c, h, sets, one))
        for who, fn in calls.items():
            try:
                ok = bench.check(f"{cell} {who}", fn(sets[0])[:n].reshape(ref.shape), ref, TOL)
            except Exception as exc:  # a peer kernel this vLLM build lacks: reported, not timed
                print(f"    {cell} {who}: not run ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
                continue
            if ok:
                times[who] = bench.time_graph_ms([lambda s=s, fn=fn: fn(s) for s in sets], a.replays)
    for who, ms in times.items():
        bw = (kv_bytes + io_bytes) / (ms * 1e-3)
        bench.add(Row("mla", f"{kind} h{h:>3} b{b:>3} ctx {c:>5} {who}", ms, "GB/s", bw / 1e9,
                      f"{100 * bw / a.peak_bw:5.1f}% of {a.peak_bw / 1e12:.1f} TB/s"))
    ours = {k: v for k, v in times.items() if k.startswith("ours")}
    peers = {k: v for k, v in times.items() if not k.startswith("ours")}
    if ours and peers:
        best_ours, best_peer = min(ours, key=ours.get), min(peers, key=peers.get)
        bench.pair(cell, ours[best_ours], peers[best_peer], f"vLLM {best_peer}")


def _peers(torch, cache, bs: int, fp8: bool, c: int, h: int, sets, one) -> dict:
    """vLLM's MLA decode kernels for this cache (those its build and this block size allow)."""
    calls = {}
    b = sets[0][0].shape[0]
    if not fp8 and bs == 64:
        from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

        metas = [get_mla_metadata()[0] for _ in sets]  # one per input set (made on its first call)
        outs = [torch.empty((b, 1, h, KV_LORA), dtype=torch.bfloat16, device=cache.device) for _ in sets]
        index = {id(s[0]): i for i, s in enumerate(sets)}

        def flashmla(s):
            i = index[id(s[0])]
            return flash_mla_with_kvcache(s[0].view(b, 1, h, LATENT), cache.unsqueeze(-2), s[1], s[2], KV_LORA,
                                          metas[i], softmax_scale=SCALE, causal=True, out=outs[i])[0]

        for s in sets:  # the scheduling metadata, outside any capture
            flashmla(s)
        calls["FlashMLA"] = flashmla

        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        meta = get_scheduler_metadata(batch_size=b, max_seqlen_q=1, max_seqlen_k=c, num_heads_q=h, num_heads_kv=1,
                                      headdim=ROPE, cache_seqlens=sets[0][2], qkv_dtype=cache.dtype,
                                      headdim_v=KV_LORA, page_size=bs, cu_seqlens_q=sets[0][3], causal=True,
                                      num_splits=32)
        parts = {id(s[0]): (s[0][..., KV_LORA:].contiguous(), s[0][..., :KV_LORA].contiguous()) for s in sets}

        def fa3(s):
            q_pe, q_nope = parts[id(s[0])]
            return flash_attn_varlen_func(q=q_pe, k=cache[..., KV_LORA:].unsqueeze(-2),
                                          v=cache[..., :KV_LORA].unsqueeze(-2), q_v=q_nope, max_seqlen_q=1,
                                          cu_seqlens_q=s[3], max_seqlen_k=c, seqused_k=s[2], block_table=s[1],
                                          softmax_scale=SCALE, causal=True, fa_version=3,
                                          scheduler_metadata=meta, num_splits=32)

        calls["FA3-MLA"] = fa3
    if bs == 64 or fp8:
        import triton
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

        splits = min(triton.next_power_of_2(max(1, c // 512)), 2 * torch.cuda.get_device_properties(
            cache.device).multi_processor_count)  # TRITON_MLA's rule
        logits = torch.empty((b, h, splits, KV_LORA + 1), dtype=torch.float32, device=cache.device)
        o = torch.empty((b, h, KV_LORA), dtype=torch.bfloat16, device=cache.device)
        lse = torch.empty((b, h), dtype=torch.bfloat16, device=cache.device)

        def triton_mla(s):
            k = cache.unsqueeze(2)
            decode_attention_fwd(s[0], k, k[..., :KV_LORA], o, lse, s[1], s[2], logits, splits, SCALE, bs,
                                 k_scale=one, v_scale=one, is_mla=True)
            return o

        calls["Triton-MLA"] = triton_mla
    return calls
