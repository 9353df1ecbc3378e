"""``paged-backend bench serve``: a load generator for any OpenAI-compatible server.

Works like vLLM's ``vllm bench serve``, so numbers from our ``bentoml serve`` and from a
vLLM server can be compared directly. It uses only HTTP and server-sent events:

* prompts (``--dataset random``): random token ids decoded with a local tokenizer, then
  re-encoded and cut so that each prompt is ``--random-input-len`` tokens long (HTTP text
  APIs take text, not ids). Each request asks for ``--random-output-len`` tokens with
  ``ignore_eos``, so every request produces the same amount of work on any server;
* arrivals: gamma-distributed gaps with mean ``1 / --request-rate`` (``--burstiness 1``
  gives a Poisson process; ``inf`` sends everything at once), and at most
  ``--max-concurrency`` requests are in flight at a time;
* every request streams (``stream_options.include_usage``), timed on the client: TTFT,
  TPOT = (e2e - ttft) / (output tokens - 1) per request, ITL = every gap between text
  chunks, E2E latency; goodput counts the requests that meet every ``--goodput`` SLO.

The modules: ``serve_requests`` (prompts, arrivals, results), ``serve_client`` (the streamed
requests, the server under test), ``serve_report`` (metrics, the table, JSON lines),
``serve_soak`` and ``serve_rss`` (``--duration``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

from paged_backend.benchmarks.serve_client import (
    TIMEOUT_S,
    ServeTarget,
    TargetError,
    resolve_target,
    run_benchmark,
)
from paged_backend.benchmarks.serve_report import (
    METRICS,
    append_json_line,
    compute_metrics,
    format_report,
    parse_goodput,
    rate_field,
    stamp,
)
from paged_backend.benchmarks.serve_requests import sample_from_args
from paged_backend.benchmarks.serve_soak import run_soak_command


def _slo_arg(item: str) -> str:
    try:
        parse_goodput([item])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return item


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _range_ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def _metric_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown metric(s) {bad}: choose from {', '.join(METRICS)}")
    return names

def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (like `vllm bench serve`)")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:3000 (default: from "
                   "--host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="served model name (default: the first id of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer dir for the prompts (default: the served "
                   "model's dir when it is local, else the default model's)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", choices=["random"], default="random")
    p.add_argument("--num-prompts", type=_positive(int), default=1000)
    p.add_argument("--random-input-len", type=_positive(int), default=1024)
    p.add_argument("--random-output-len", type=_positive(int), default=128)
    p.add_argument("--random-range-ratio", type=_range_ratio, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the output length (vLLM's ignore_eos extra field)")
    p.add_argument("--request-rate", type=_positive(float), default=math.inf,
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--burstiness", type=_positive(float), default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=_positive(int), default=None, help="most requests in flight")
    p.add_argument("--goodput", nargs="+", type=_slo_arg, default=None, metavar="NAME:MS",
                   help="SLOs in ms for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    p.add_argument("--percentile-metrics", type=_metric_list, default=list(METRICS),
                   help="metrics to print: comma-separated of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", "--percentiles", dest="percentiles", type=_float_list, default=[99.0],
                   help="comma-separated percentiles to report, e.g. 50,90,99")
    p.add_argument("--timeout", type=_positive(float), default=TIMEOUT_S,
                   help="seconds without data before a request fails")
    p.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    p.add_argument("--save-detailed", action="store_true",
                   help="also put per-request lengths, TTFTs, ITLs and errors into the JSON line")
    p.add_argument("--disable-tqdm", action="store_true")
    soak = p.add_argument_group("soak", "run for a time instead of a number of prompts, one table row per interval")
    soak.add_argument("--duration", type=_positive(float), default=None, metavar="SECONDS",
                      help="keep --max-concurrency streams busy for this long (fresh prompts in batches of "
                      "--num-prompts, seeds --seed, --seed + 1, ...); the in-flight requests then finish")
    soak.add_argument("--interval", type=_positive(float), default=60.0, metavar="SECONDS",
                      help="with --duration: print a row (requests, errors, tok/s, TPOT, TTFT, server RSS) "
                      "every this many seconds")
    soak.add_argument("--server-pid", type=int, default=None, metavar="PID",
                      help="with --duration: the server's pid (e.g. `bentoml serve`'s); RSS is the sum over it "
                      "and its children, the largest child (the worker) shown too. Without it: "
                      "process_resident_memory_bytes from GET /metrics when the server exports it")
    p.set_defaults(func=run_serve)


def _flag_error(args: argparse.Namespace, endpoint: str) -> str | None:
    """What is wrong with the options as given (checked before the server is contacted)."""
    if args.duration is not None and args.max_concurrency is None:
        return "--duration needs --max-concurrency (the number of streams to keep busy)"
    if args.server_pid is not None and args.duration is None:
        return "--server-pid is only used with --duration"
    if not endpoint.endswith("completions"):
        return f"--endpoint {endpoint} is neither /v1/completions nor /v1/chat/completions"
    return None


def run_serve(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    endpoint = "/" + args.endpoint.lstrip("/")
    error = _flag_error(args, endpoint)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    goodput = parse_goodput(args.goodput) if args.goodput else None
    try:
        target = resolve_target(args, endpoint)
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    if args.duration is not None:
        return run_soak_command(args, target, goodput)
    return _run_fixed(args, target, goodput)


def _run_fixed(args: argparse.Namespace, target: ServeTarget, goodput: dict[str, float] | None) -> int:
    """``--num-prompts`` requests at their arrival times, then the table (and a JSON line)."""
    requests = sample_from_args(target.tokenizer, args, args.seed)
    print(f"bench serve: {len(requests)} prompts to {target.api_url} (model {target.model}, tokenizer "
          f"{target.tok_dir}), request rate {args.request_rate}, burstiness {args.burstiness}, max concurrency "
          f"{args.max_concurrency}")
    results, duration = asyncio.run(run_benchmark(
        requests, api_url=target.api_url, make_payload=target.payload_maker(args.temperature, args.ignore_eos),
        chat=target.chat, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, headers=target.headers, timeout_s=args.timeout,
        progress=not args.disable_tqdm))
    metrics = compute_metrics(results, duration, percentiles=args.percentiles, goodput=goodput)
    print(format_report(metrics, percentiles=args.percentiles, metrics=args.percentile_metrics,
                        max_concurrency=args.max_concurrency))
    if args.json:
        row = {"date": stamp(), "backend": target.backend, "base_url": target.base_url, "endpoint": target.endpoint,
               "model_id": target.model, "tokenizer_id": target.tok_dir, "dataset": args.dataset,
               "num_prompts": len(requests), "random_input_len": args.random_input_len,
               "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
               "request_rate": rate_field(args.request_rate), "burstiness": args.burstiness,
               "max_concurrency": args.max_concurrency, "goodput": goodput, **metrics}
        if args.save_detailed:
            row.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_tokens for r in results],
                       ttfts=[r.ttft for r in results], e2els=[r.latency for r in results],
                       itls=[r.itl for r in results], text_chunks=[r.text_chunks for r in results],
                       errors=[r.error for r in results])
        append_json_line(args.json, row)
    return 0 if metrics["completed"] else 1
