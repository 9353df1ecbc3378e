"""``paged-backend bench serve``: the metric math, the arrival process, and real runs.

The real runs drive our OpenAI app (uvicorn in a thread, SmolLM2 on the CPU) through the
command line, and check a dead server fails every request quickly with a clear message.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import numpy as np
import pytest

from paged_backend.benchmarks.serve_client import StreamTracker, send_request, sse_lines
from paged_backend.benchmarks.serve_report import compute_metrics, parse_goodput, peak_concurrency
from paged_backend.benchmarks.serve_requests import (
    PromptStream,
    RequestResult,
    SampleRequest,
    arrival_times,
    sample_random_requests,
)
from paged_backend.benchmarks.serve_rss import format_rss_summary, metrics_rss, process_tree_rss, rss_flatness
from paged_backend.benchmarks.serve_soak import aggregate_interval, format_interval_row, run_soak
from paged_backend.cli import main

ENGINE_ARGS = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu", "max_model_len": 512,
               "num_gpu_blocks_override": 128, "log_stats_interval": 0}


# -- pure math ---------------------------------------------------------------------------

def _result(ttft: float, latency: float, out: int, itl: list[float], prompt_len: int = 10,
            start: float = 0.0) -> RequestResult:
    return RequestResult(prompt_len=prompt_len, success=True, start=start, end=start + latency, ttft=ttft,
                         latency=latency, itl=itl, output_tokens=out, text_chunks=len(itl) + 1)


def test_metrics_match_hand_computed_values():
    results = [
        _result(0.1, 1.1, 11, [0.1] * 10, start=0.0),  # tpot (1.1-0.1)/10 = 0.1
        _result(0.2, 0.6, 5, [0.1, 0.1, 0.1, 0.1], start=0.5),  # tpot 0.1
        _result(0.3, 0.3, 1, [], start=2.0),  # one token: no tpot sample
        _result(0.4, 2.4, 5, [0.5, 0.5, 0.5, 0.5], start=2.1),  # tpot 0.5; overlaps the failed one
        RequestResult(prompt_len=10, error="HTTP 400 from x: too long", start=3.0, end=3.1),
    ]
    m = compute_metrics(results, duration=4.0, percentiles=[50, 99, 99.9], goodput={"ttft": 250, "tpot": 200})
    assert m["completed"] == 4 and m["failed"] == 1 and m["first_error"] == "HTTP 400 from x: too long"
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 22
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(22 / 4)
    assert m["total_token_throughput"] == pytest.approx(62 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["p50_ttft_ms"] == pytest.approx(250.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 * (1 + 3 * 0.99))  # linear between the 3rd and 4th value
    assert m["p99.9_ttft_ms"] == pytest.approx(100 * (1 + 3 * 0.999))
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300, 400]))
    assert m["mean_tpot_ms"] == pytest.approx((100 + 100 + 500) / 3)
    assert m["median_tpot_ms"] == pytest.approx(100.0)
    assert m["num_itls"] == 18 and m["mean_itl_ms"] == pytest.approx((1.0 + 0.4 + 2.0) / 18 * 1000)
    assert m["mean_e2el_ms"] == pytest.approx(1100.0)
    # ttft <= 250 ms: the first two; tpot <= 200 ms holds for them (and the 1-token one, ttft 300: out)
    assert m["request_goodput"] == pytest.approx(2 / 4)
    assert m["max_concurrent_requests"] == 2  # [0, 1.1] with [0.5, 1.1]; [2.1, 4.5] with [2.0, 2.3], [3.0, 3.1]


def test_metrics_without_slos_or_successes():
    m = compute_metrics([RequestResult(error="boom", start=0.0, end=0.1)] * 3, duration=0.5)
    assert m["completed"] == 0 and m["failed"] == 3 and m["first_error"] == "boom"
    assert "request_goodput" not in m
    assert m["request_throughput"] == 0 and m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0
    assert compute_metrics([], duration=0.0)["request_throughput"] == 0


def test_goodput_counts_each_slo():
    r = [_result(0.1, 1.0, 10, [0.1] * 9), _result(0.6, 1.5, 10, [0.1] * 9), _result(0.1, 3.0, 10, [0.3] * 9)]
    assert compute_metrics(r, 1.0, goodput={"ttft": 500})["request_goodput"] == 2
    assert compute_metrics(r, 1.0, goodput={"e2el": 2000})["request_goodput"] == 2
    assert compute_metrics(r, 1.0, goodput={"tpot": 150})["request_goodput"] == 2  # 0.1, 0.1, 0.32 s
    assert compute_metrics(r, 1.0, goodput={"ttft": 500, "e2el": 2000})["request_goodput"] == 1
    assert compute_metrics(r, 2.0, goodput={"ttft": 1e9})["request_goodput"] == 1.5


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2500.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2500.5}
    for bad, words in [("ttft", "NAME:MILLISECONDS"), ("itl:5", "must be one of"), ("ttft:fast", "not a number"),
                       ("ttft:-1", ">= 0"), ("tpot:inf", "finite")]:
        with pytest.raises(ValueError, match=words):
            parse_goodput([bad])


def test_bad_goodput_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["bench", "serve", "--goodput", "ttft:500", "latency:3", "--model", "m"])
    assert ei.value.code == 2
    assert "invalid SLO metric 'latency'" in capsys.readouterr().err


def test_poisson_arrivals_have_the_requested_rate():
    times = arrival_times(20000, request_rate=50.0, seed=7)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps
    assert arrival_times(100, 50.0, seed=7) == times[:100]  # seeded: the same schedule every run
    assert arrival_times(100, 50.0, seed=8) != times[:100]


def test_burstiness_keeps_the_mean_and_changes_the_spread():
    regular = np.diff(arrival_times(20000, 10.0, burstiness=4.0, seed=1))
    bursty = np.diff(arrival_times(20000, 10.0, burstiness=0.25, seed=1))
    assert regular.mean() == pytest.approx(0.1, rel=0.03) and bursty.mean() == pytest.approx(0.1, rel=0.06)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.05)  # gamma: cv = 1/sqrt(shape)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 1.0) == []
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0)


def test_peak_concurrency_does_not_count_back_to_back_requests():
    rs = [RequestResult(start=0, end=1), RequestResult(start=1, end=2), RequestResult(start=1.5, end=3)]
    assert peak_concurrency(rs) == 2
    assert peak_concurrency([]) == 0


def test_stream_tracker_times_text_chunks_and_prefers_usage():
    t = StreamTracker(start=10.0, chat=False)
    t.feed('{"choices": [{"index": 0, "text": "Hel"}], "usage": null}', 10.25)
    t.feed('{"choices": [{"index": 0, "text": "lo"}], "usage": null}', 10.5)
    t.feed('{"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": null}', 10.55)
    t.feed('{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}', 10.6)
    t.feed("[DONE]", 10.6)
    r = t.result(prompt_len=3, end=11.0)
    assert r.success and r.generated_text == "Hello"
    assert r.ttft == pytest.approx(0.25) and r.latency == pytest.approx(1.0) and r.itl == [pytest.approx(0.25)]
    assert r.output_tokens == 3  # the usage chunk, not the 2 text chunks

    chat = StreamTracker(start=0.0, chat=True)
    chat.feed('{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}', 0.1)
    for i, word in enumerate(["a", "b", "c"]):
        chat.feed(json.dumps({"choices": [{"index": 0, "delta": {"content": word}}]}), 0.2 + i)
    r = chat.result(prompt_len=1, end=3.0)
    assert r.ttft == pytest.approx(0.2) and r.itl == [pytest.approx(1.0)] * 2
    assert r.output_tokens == 3 and r.text_chunks == 3  # no usage chunk: the text chunks count

    empty = StreamTracker(start=0.0, chat=True).result(prompt_len=1, end=1.0)
    assert not empty.success and "without any text" in empty.error


def test_sse_lines_split_only_at_cr_and_lf():
    """U+2028 / U+0085 in a generated text stay inside their event (JSON leaves them unescaped)."""
    import asyncio

    event = json.dumps({"choices": [{"text": "a\u2028b\x85c\u2029"}]}, ensure_ascii=False).encode()
    stream = b"data: " + event + b"\n\ndata: x\r\ndata: y\rdata: z\n\ndata: [DONE]"
    at = stream.index("\u2028".encode()) + 1
    # chunks cut inside U+2028's bytes, and between the CR and the LF of "data: x\r\n"
    cuts = [0, 5, at, len(event) + 8, len(event) + 16, len(event) + 17, len(stream)]
    assert stream[len(event) + 15:len(event) + 17] == b"\r\n"

    async def chunks():
        for a, b in zip(cuts, cuts[1:], strict=False):
            yield stream[a:b]

    async def lines() -> list[str]:
        return [line async for line in sse_lines(chunks())]

    got = asyncio.run(lines())
    assert got == ["data: " + event.decode(), "", "data: x", "data: y", "data: z", "", "data: [DONE]"]
    assert json.loads(got[0][6:])["choices"][0]["text"] == "a\u2028b\x85c\u2029"


def test_random_prompts_have_the_requested_lengths():
    from smollm2 import model_dir, tokenizer

    tok = tokenizer()
    reqs = sample_random_requests(tok, 20, input_len=64, output_len=32, range_ratio=0.5, seed=3)
    assert len(reqs) == 20
    assert all(16 <= r.output_len <= 48 for r in reqs) and len({r.output_len for r in reqs}) > 1
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert 30 <= r.prompt_len <= 98  # within the range, give or take a merge at the cut
    again = sample_random_requests(tok, 20, input_len=64, output_len=32, range_ratio=0.5, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    fixed = sample_random_requests(tok, 8, input_len=16, output_len=8, seed=0)
    assert all(abs(r.prompt_len - 16) <= 1 and r.output_len == 8 for r in fixed)
    assert model_dir()  # the tokenizer above is the default model's


# -- against a real server ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    """Our OpenAI app on the real SmolLM2, served by uvicorn in a thread of this process."""
    import uvicorn
    from paged_backend.adapters.api import EngineAdapter
    from paged_backend.adapters.openai_server import create_openai_app

    adapter = EngineAdapter(ENGINE_ARGS, metrics=None)
    adapter.start()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_openai_app(adapter, prefix="/v1"), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
    adapter.shutdown()


def _bench(tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "serve.jsonl"
    rc = main(["bench", "serve", "--seed", "0", "--disable-tqdm", "--save-detailed", "--json", str(out), *flags])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    return rc, rows[0]


@pytest.mark.slow
def test_bench_serve_completions_against_our_server(server_url, tmp_path, capsys):
    rc, m = _bench(tmp_path, "--base-url", server_url, "--num-prompts", "8", "--random-input-len", "16",
                   "--random-output-len", "8", "--request-rate", "inf", "--max-concurrency", "4",
                   "--goodput", "ttft:60000", "tpot:1", "--metric-percentiles", "50,99")
    assert rc == 0
    assert m["model_id"] == "SmolLM2-135M-Instruct" and m["request_rate"] == "inf"  # model from /v1/models
    assert m["completed"] == 8 and m["failed"] == 0 and m["first_error"] is None
    assert m["total_output_tokens"] == 8 * 8 and m["output_lens"] == [8] * 8
    assert m["total_input_tokens"] == sum(m["input_lens"]) and all(15 <= n <= 17 for n in m["input_lens"])
    for ttft, e2el, itl, chunks in zip(m["ttfts"], m["e2els"], m["itls"], m["text_chunks"], strict=True):
        assert 0 < ttft <= e2el
        assert len(itl) == chunks - 1 and 1 <= chunks <= 8  # one gap per text chunk after the first
        assert ttft + sum(itl) <= e2el
    assert m["num_itls"] == sum(len(x) for x in m["itls"]) > 0
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["p50_ttft_ms"] <= m["p99_ttft_ms"]
    assert m["request_throughput"] == pytest.approx(8 / m["duration"])
    assert m["output_throughput"] == pytest.approx(64 / m["duration"])
    assert 0 <= m["request_goodput"] <= m["request_throughput"]  # tpot <= 1 ms: hardly any request on a CPU
    assert 1 <= m["max_concurrent_requests"] <= 4
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Successful requests:" in table and "P99 TPOT (ms):" in table
    assert "Request goodput (req/s):" in table


@pytest.mark.slow
def test_bench_serve_chat_endpoint(server_url, tmp_path):
    rc, m = _bench(tmp_path, "--base-url", server_url, "--endpoint", "/v1/chat/completions",
                   "--model", "SmolLM2-135M-Instruct", "--num-prompts", "2", "--random-input-len", "12",
                   "--random-output-len", "3")
    assert rc == 0 and m["backend"] == "openai-chat"
    assert m["completed"] == 2 and m["failed"] == 0 and m["total_output_tokens"] == 6
    assert all(0 < t <= e for t, e in zip(m["ttfts"], m["e2els"], strict=True))


@pytest.mark.slow
def test_bench_serve_reports_server_errors(server_url, tmp_path):
    rc, m = _bench(tmp_path, "--base-url", server_url, "--model", "no-such-model", "--tokenizer",
                   "SmolLM2-135M-Instruct", "--num-prompts", "2", "--random-input-len", "8",
                   "--random-output-len", "2")
    assert rc == 1 and m["completed"] == 0 and m["failed"] == 2
    assert "HTTP 404" in m["first_error"] and "no-such-model" in m["first_error"]


def test_dead_server_fails_every_request_quickly(tmp_path, capsys):
    port = _free_port()  # nothing listens there
    t = time.monotonic()
    rc, m = _bench(tmp_path, "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer",
                   "SmolLM2-135M-Instruct", "--num-prompts", "5", "--random-input-len", "8",
                   "--random-output-len", "4", "--max-concurrency", "2")
    assert time.monotonic() - t < 30
    assert rc == 1 and m["completed"] == 0 and m["failed"] == 5 and m["errors"].count("") == 0
    assert "ConnectorError" in m["first_error"] and f"127.0.0.1:{port}/v1/completions" in m["first_error"]
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "ConnectorError" in out


def test_dead_server_without_model_is_a_clear_error(capsys):
    port = _free_port()
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert f"cannot list the models at http://127.0.0.1:{port}/v1/models" in err and "--model" in err


async def _reset_then_answer(reset_first: int, reset_after_headers: bool = False):
    """A raw HTTP/1.1 server on a free port: its first ``reset_first`` connections read the
    request and close without answering (or, with ``reset_after_headers``, after the response
    headers); later ones stream two text chunks. Returns (server, connection counter)."""
    import asyncio

    seen = [0]

    async def handle(reader, writer):
        seen[0] += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(v for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:] if b":" in ln)
                          if k.strip().lower() == b"content-length"))
        await reader.readexactly(length)
        if seen[0] <= reset_first and not reset_after_headers:
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        if seen[0] <= reset_first:
            await writer.drain()
            writer.close()
            return
        for event in (b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
                      b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


@pytest.mark.parametrize("resets,after_headers,ok", [(0, False, True), (1, False, True), (2, False, False),
                                                     (1, True, False)])
def test_connection_lost_before_a_response_is_retried_once(resets, after_headers, ok):
    """A connection closed before any response byte (the server never answered) is retried once,
    counted in the result; a second loss, or a loss after the response began, is a failure."""
    import asyncio

    import aiohttp

    async def run():
        server, seen = await _reset_then_answer(resets, after_headers)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        async with server, aiohttp.ClientSession() as client:
            r = await send_request(client, url, {"prompt": "x", "stream": True}, prompt_len=1, chat=False)
        return r, seen[0]

    r, connections = asyncio.run(run())
    assert r.success is ok and r.retried is (resets > 0 and not after_headers)
    assert connections == (1 if resets == 0 or after_headers else 2)
    if ok:
        assert r.generated_text == "ab" and r.text_chunks == 2
        m = compute_metrics([r], duration=1.0)
        assert m["retried"] == int(resets > 0) and m["failed"] == 0
    else:
        assert r.error and "cannot reach" in r.error


# -- soak (--duration) -------------------------------------------------------------------

MIB = 1024 * 1024


def test_interval_row_aggregates_the_completed_requests():
    done = [
        _result(0.2, 1.2, 11, [0.1] * 10),  # tpot 100 ms
        _result(0.4, 2.4, 5, [0.5] * 4),  # tpot 500 ms
        _result(0.6, 0.6, 1, []),  # one token: a TTFT, no TPOT
        RequestResult(error="HTTP 500 from x: boom"),
    ]
    row = aggregate_interval(3, elapsed=180.5, seconds=60.5, results=done, rss=700 * MIB, worker_rss=600 * MIB)
    assert row["interval"] == 3 and row["elapsed_s"] == 180.5 and row["seconds"] == 60.5
    assert row["completed"] == 3 and row["errors"] == 1 and row["first_error"] == "HTTP 500 from x: boom"
    assert row["output_tokens"] == 17 and row["output_throughput"] == pytest.approx(17 / 60.5)
    assert row["p50_tpot_ms"] == pytest.approx(300.0) and row["p99_tpot_ms"] == pytest.approx(100 + 400 * 0.99)
    assert row["p50_ttft_ms"] == pytest.approx(400.0)
    assert row["rss_bytes"] == 700 * MIB and row["worker_rss_bytes"] == 600 * MIB
    line = format_interval_row(row)
    assert line.split() == ["3", "180.5", "3", "1", "0.3", "300.00", "496.00", "400.0", "700.0", "600.0"]


def test_empty_interval_row_has_no_latencies_and_no_rss():
    row = aggregate_interval(1, elapsed=60.0, seconds=60.0, results=[RequestResult(error="x")] * 2)
    assert row["completed"] == 0 and row["errors"] == 2 and row["output_throughput"] == 0
    assert row["p50_tpot_ms"] is None and row["p99_tpot_ms"] is None and row["p50_ttft_ms"] is None
    assert format_interval_row(row).split() == ["1", "60.0", "0", "2", "0.0", "-", "-", "-", "-", "-"]
    assert aggregate_interval(1, 0.0, 0.0, [])["output_throughput"] == 0  # no division by a zero length


def _rows(rss_mib: list[float | None], interval: float = 60.0) -> list[dict]:
    return [{"elapsed_s": (i + 1) * interval, "rss_bytes": None if v is None else int(v * MIB)}
            for i, v in enumerate(rss_mib)]


def test_rss_verdict_uses_the_last_20_minutes():
    # 30 rows of 60 s: the window is 1,200 s, the samples at 600 ... 1,800 s (21 rows); the
    # warm-up growth of the first ten minutes does not count
    rss = [500 + 30 * i for i in range(9)] + [800.0] * 10 + [810, 820, 830, 820, 810, 805, 800, 812, 815, 820, 825]
    v = rss_flatness(_rows(rss))
    assert v["window_s"] == 1200 and v["intervals"] == 21
    assert v["first"] == 800 * MIB and v["last"] == 825 * MIB and v["min"] == 800 * MIB and v["max"] == 830 * MIB
    assert v["growth"] == pytest.approx(830 / 800 - 1) and v["flat"] is True
    assert "max/min - 1 = 3.75%: flat" in format_rss_summary(v)

    leak = rss_flatness(_rows([800 + 3 * i for i in range(30)]))  # 3 MiB a minute
    assert leak["intervals"] == 21 and leak["growth"] == pytest.approx(887 / 827 - 1) and leak["flat"] is False
    assert "NOT flat" in format_rss_summary(leak) and "within 5%: no" in format_rss_summary(leak)


def test_rss_verdict_of_a_short_run_takes_its_last_two_thirds():
    v = rss_flatness(_rows([100, 200, 300, 104, 100, 103], interval=10.0))  # 60 s: samples at 20 ... 60 s
    assert v["window_s"] == pytest.approx(40.0) and v["intervals"] == 5
    assert v["max"] == 300 * MIB and v["flat"] is False
    assert rss_flatness(_rows([100, 200, 300, 104, 100, 103], interval=10.0), tolerance=2.0)["flat"] is True
    # a longer last row (the requests in flight at the end finish in it) ends the window
    rows = _rows([100] * 20 + [104]) + [{"elapsed_s": 1265.0, "rss_bytes": 103 * MIB}]
    assert rss_flatness(rows)["window_s"] == pytest.approx(1265 * 2 / 3)


def test_rss_verdict_without_enough_samples():
    assert rss_flatness([])["flat"] is None and rss_flatness([])["intervals"] == 0
    none = rss_flatness(_rows([None] * 5))
    assert none["intervals"] == 0 and none["flat"] is None and "not measured" in format_rss_summary(none)
    one = rss_flatness(_rows([None, None, None, 100.0]))
    assert one["intervals"] == 1 and one["flat"] is None and "too few samples" in format_rss_summary(one)
    gaps = rss_flatness(_rows([100, None, 102, None, 101, None]))  # rows without a sample are skipped
    assert gaps["intervals"] == 2 and gaps["min"] == 101 * MIB and gaps["flat"] is True
    worker = rss_flatness([{"elapsed_s": 1.0, "rss_bytes": 9, "worker_rss_bytes": 100},
                           {"elapsed_s": 2.0, "rss_bytes": 1, "worker_rss_bytes": 104}], key="worker_rss_bytes")
    assert worker["intervals"] == 2 and worker["growth"] == pytest.approx(0.04) and worker["flat"] is True


def test_metrics_rss_reads_the_prometheus_gauge():
    page = ("# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
            "# TYPE process_resident_memory_bytes gauge\n"
            "process_resident_memory_bytes 1.2345678e+08\n"
            "process_virtual_memory_bytes 9e9\n")
    assert metrics_rss(page) == 123456780
    assert metrics_rss('process_resident_memory_bytes{pid="1"} 100\nprocess_resident_memory_bytes{pid="2"} 50\n') == 150
    assert metrics_rss("vllm:num_requests_running 3\n") is None
    assert metrics_rss("") is None


def test_process_tree_rss_sums_the_children():
    import os
    import subprocess
    import sys

    alone, _ = process_tree_rss(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        total, largest = process_tree_rss(os.getpid())
        assert largest is not None and largest > 0 and total is not None and total >= largest
        assert total > largest  # this process counts too
        own, kid = process_tree_rss(child.pid)
        assert own is not None and own > 0 and kid is None
    finally:
        child.communicate(b"")
    assert alone is not None and alone > 0
    assert process_tree_rss(child.pid) == (None, None)  # gone


def test_prompt_stream_draws_fresh_batches():
    import asyncio

    seeds = []

    def make(seed: int) -> list[SampleRequest]:
        seeds.append(seed)
        return [SampleRequest(prompt=f"{seed}-{i}", prompt_len=1, output_len=1) for i in range(4)]

    async def draw(n: int) -> list[str]:
        stream = PromptStream(make, seed=7)
        return [(await stream.next()).prompt for _ in range(n)]

    got = asyncio.run(draw(10))
    assert got == ["7-0", "7-1", "7-2", "7-3", "8-0", "8-1", "8-2", "8-3", "9-0", "9-1"]
    assert seeds == [7, 8, 9]  # the next batch is made once the current one is half used


def test_soak_rows_account_for_every_request():
    """A short soak against a fake streaming server: every request is in exactly one row, the
    last row waits for the requests in flight; no assertion depends on the timing."""
    import asyncio

    async def run():
        server, seen = await _reset_then_answer(0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        stream = PromptStream(lambda seed: [SampleRequest(prompt="x", prompt_len=3, output_len=2)] * 8, seed=0)
        got_rows = []
        async with server:
            results, wall, rows = await run_soak(
                stream, api_url=url, make_payload=lambda r: {"prompt": r.prompt, "stream": True}, chat=False,
                duration_s=0.6, interval_s=0.25, max_concurrency=3, server_pid=None, metrics_url=None,
                on_row=got_rows.append)
        return results, wall, rows, got_rows, seen[0]

    results, wall, rows, got_rows, connections = asyncio.run(run())
    assert got_rows == rows and [r["interval"] for r in rows] == [1, 2, 3]  # ticks at 0.25, 0.5, then the end
    assert len(results) == connections > 0 and all(r.success for r in results)
    assert sum(r["completed"] for r in rows) == len(results) and sum(r["errors"] for r in rows) == 0
    assert sum(r["output_tokens"] for r in rows) == 2 * len(results)  # two text chunks, no usage chunk
    assert rows[-1]["elapsed_s"] >= 0.6 and wall >= rows[-1]["elapsed_s"]
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)
    assert sum(r["seconds"] for r in rows) == pytest.approx(rows[-1]["elapsed_s"])
    assert all(r["rss_bytes"] is None and r["worker_rss_bytes"] is None for r in rows)
    assert peak_concurrency(results) <= 3


def test_soak_flags_are_checked(capsys):
    assert main(["bench", "serve", "--duration", "10", "--model", "m"]) == 2
    assert "--duration needs --max-concurrency" in capsys.readouterr().err
    assert main(["bench", "serve", "--server-pid", "1", "--model", "m"]) == 2
    assert "--server-pid is only used with --duration" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["bench", "serve", "--duration", "10", "--interval", "0", "--model", "m"])
    assert ei.value.code == 2
