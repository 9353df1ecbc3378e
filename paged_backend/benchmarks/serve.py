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
``serve_sweep`` (one or several load points, their table and plot), ``serve_multi``
(``--num-clients``), ``serve_soak`` and ``serve_rss`` (``--duration``).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

from paged_backend.benchmarks.bench_plot import add_plot_args, plot_args_error
from paged_backend.benchmarks.serve_client import TIMEOUT_S, TargetError, resolve_target
from paged_backend.benchmarks.serve_report import METRICS, parse_goodput
from paged_backend.benchmarks.serve_soak import run_soak_command
from paged_backend.benchmarks.serve_sweep import run_fixed_points


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


def _positive_list(kind: type) -> Callable[[str], list[Any]]:
    """A comma list of values > 0, e.g. ``1,4,16`` (``inf`` too for floats)."""
    parse = _positive(kind)

    def parse_list(text: str) -> list[Any]:
        values = [parse(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s > 0, got {text!r}")
        return values

    return parse_list


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
    p.add_argument("--request-rate", dest="request_rates", type=_positive_list(float), default=[math.inf],
                   help="requests per second, Poisson arrivals (inf: all at once); a comma list runs one point "
                   "per rate, e.g. 2,8,32,inf")
    p.add_argument("--burstiness", type=_positive(float), default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=_positive(int), default=None, help="most requests in flight")
    p.add_argument("--num-clients", type=_positive(int), default=1,
                   help="client processes sharing the load (one Python client tops out near 12k output tok/s): "
                   "each sends every N-th request with its share of the concurrency and rate; the metrics are "
                   "computed over all requests")
    sweep = p.add_argument_group("sweep", "one run per load point against the same server, a row per point")
    sweep.add_argument("--concurrency", type=_positive_list(int), default=None, metavar="C1,C2,...",
                       help="max concurrencies, one run each (with every --request-rate), e.g. 1,4,16,64,256")
    sweep.add_argument("--prompts-per-concurrency", type=_positive(int), default=None, metavar="K",
                       help="send K x C prompts at concurrency C (default: --num-prompts at every point)")
    sweep.add_argument("--num-warmups", type=int, default=0, metavar="N",
                       help="N requests at the first point's concurrency before it, not counted")
    add_plot_args(sweep, plot_help="draw output tok/s against TPOT p50 and TTFT p99, each point labelled with "
                  "its concurrency or rate", compare_help="overlay the runs saved in this --json file (e.g. a vLLM "
                  "server measured with this client)")
    sweep.add_argument("--label", default=None, help="this run's name on the plot (default: model and URL)")
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
    sweep = [flag for flag, on in (("--concurrency", args.concurrency), ("a --request-rate list",
                                                                        len(args.request_rates) > 1),
                                   ("--num-clients", args.num_clients > 1), ("--plot", args.plot),
                                   ("--num-warmups", args.num_warmups)) if on]
    if args.duration is not None and sweep:
        return f"--duration runs one soak: {', '.join(sweep)} not taken with it"
    if args.concurrency and args.max_concurrency is not None:
        return "--concurrency (a list) and --max-concurrency (one value) exclude each other"
    if plot_args_error(args):
        return plot_args_error(args)
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
        args.request_rate = args.request_rates[0]
        return run_soak_command(args, target, goodput)
    return run_fixed_points(args, target, goodput)

