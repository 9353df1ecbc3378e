"""``paged-backend`` command line: ``generate`` and ``bench {throughput,serve,kernels,quant,peer,moe,shared-prefix,
spec-decode,kv-swap}``.

Engine flags use vLLM's names (``--max-num-seqs``, ``--kv-cache-dtype fp8`` ...); each
maps one to one onto an :class:`EngineConfig` field.
"""

from __future__ import annotations

import argparse
import logging
import sys

from paged_backend.engine_args import add_engine_args, engine_config_from_args

DESCRIPTION = ("paged-backend: a paged-KV LLM inference engine. Subcommands: generate (offline answers for "
               "prompts) and bench (throughput, serve, kernels, quant, peer, moe, shared-prefix, spec-decode, kv-swap). "
               "The OpenAI API is served by "
               "bentoml serve in bentos/smollm2, or through Triton Inference Server (see README.md).")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per answer (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (default: -1, off)")
    p.add_argument("--seed-sample", dest="sample_seed", type=int, default=None,
                   help="per-request sampling seed (default: none, the engine's generator)")
    p.add_argument("--n", type=int, default=1, help="answers per prompt (default: 1)")


def _cmd_generate(args: argparse.Namespace) -> int:
    from paged_backend.engine.llm import LLM
    from paged_backend.sampling_params import SamplingParams

    cfg = engine_config_from_args(args)
    llm = LLM(**cfg.model_dump())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, n=args.n)
    if args.raw:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs, strict=True):
        if len(outs) > 1:
            print(f"### {prompt}")
        for c in out.outputs:
            print(c.text.strip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-backend", description=DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate answers for prompts (chat template unless --raw)")
    g.add_argument("prompts", nargs="+", help="one or more prompts (quote each)")
    g.add_argument("--raw", action="store_true", help="complete the prompt text as is, no chat template")
    add_engine_args(g, model_positional=True)
    _sampling_args(g)
    g.set_defaults(func=_cmd_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    from paged_backend.benchmarks.kv_swap import add_kv_swap_parser
    from paged_backend.benchmarks.moe import add_moe_parser
    from paged_backend.benchmarks.peer import add_peer_parser
    from paged_backend.benchmarks.quant import add_quant_parser
    from paged_backend.benchmarks.serve import add_serve_parser
    from paged_backend.benchmarks.shared_prefix import add_shared_prefix_parser
    from paged_backend.benchmarks.spec_decode import add_spec_decode_parser
    from paged_backend.benchmarks.throughput import add_throughput_parser

    add_throughput_parser(bsub)
    add_quant_parser(bsub)
    add_peer_parser(bsub)
    add_serve_parser(bsub)
    add_moe_parser(bsub)
    add_shared_prefix_parser(bsub)
    add_spec_decode_parser(bsub)
    add_kv_swap_parser(bsub)
    # its own parser takes every argument after it (--help too)
    k = bsub.add_parser("kernels", help="check, then time the Triton kernels (CUDA)", add_help=False)
    k.set_defaults(func=_cmd_bench_kernels, passthrough=True)
    return p


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    from paged_backend.benchmarks import kernels as bench_kernels

    return int(bench_kernels.main(args.rest) or 0)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
