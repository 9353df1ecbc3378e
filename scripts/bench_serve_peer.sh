#!/bin/bash
# Served throughput against latency, ours beside `vllm serve`, on one GPU, with the same client.
#
# The W1 model shapes (Llama-3.2-1B, random bf16 weights) with a tokenizer padded to their vocabulary,
# 256 random prompt tokens and 256 output tokens (EOS ignored), streamed /v1/completions; one
# `paged-backend bench serve` sweep over CONCURRENCY against each server in turn, spread over
# CLIENTS client processes (one tops out near 12k output tok/s). Writes, under OUT_DIR:
#     vllm.jsonl, ours.jsonl     a JSON line per load point
#     curves.png                 both curves (output tok/s against TPOT p50 and TTFT p99), with matplotlib
#     vllm_serve.log, ours.log   the servers' logs
#
# Needs a CUDA GPU, paged_backend with its `serve` extra (bentoml) importable, vLLM importable
# (VLLM_PYTHONPATH is put in front of PYTHONPATH for `vllm serve` only), and an HF tokenizer dir:
#     bash scripts/bench_serve_peer.sh TOKENIZER_DIR
# Environment: CONCURRENCY (1,16,64,256,512), CLIENTS (4), MAX_NUM_SEQS (512), OUT_DIR (./serve_peer),
# ENGINE_CORE_PROCESS (true), WORKERS (1: BentoML worker processes, front ends of one shared engine core),
# SKIP_VLLM (unset), VLLM_PYTHONPATH.
set -euo pipefail
TOK=$(realpath "${1:?usage: bench_serve_peer.sh TOKENIZER_DIR}")
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONC=${CONCURRENCY:-1,16,64,256,512}
OUT_DIR=$(mkdir -p "${OUT_DIR:-serve_peer}" && realpath "${OUT_DIR:-serve_peer}")
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # its sampler needs the flashinfer package
cd "${TMPDIR:-/tmp}"  # not the checkout: its folders would shadow the installed packages
W1=$(python3 -c "from paged_backend.benchmarks.model_shapes import write_shape_config as w; \
print(w('llama-3.2-1b', tokenizer_from='$TOK'))")

wait_ready() {  # URL PID
  for _ in $(seq 300); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server exited before it was ready" >&2; return 1; }
    sleep 1
  done
  echo "the server was not ready after 300 s" >&2; return 1
}
stop() {  # PID: the server's whole process group, then wait for the GPU to be free
  kill -TERM -- "-$1" 2>/dev/null || true; sleep 5; kill -KILL -- "-$1" 2>/dev/null || true
  for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && return; sleep 2; done
  # a server's own daemon (BentoML's circusd runs in a session of its own) can outlive its group: what
  # still holds the GPU a minute later is left from this server (the script assumes the GPU is its own)
  local left; left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)
  echo "still holding the GPU after the server stopped, killed: $left" >&2
  kill -KILL $left 2>/dev/null || true; sleep 3
}
sweep() {  # PORT LABEL JSONL [extra bench serve args]
  local port=$1 label=$2 json=$3; shift 3
  python3 -m paged_backend.cli bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$W1" \
    --random-input-len 256 --random-output-len 256 --ignore-eos --concurrency "$CONC" --prompts-per-concurrency 4 \
    --num-warmups 64 --num-clients "${CLIENTS:-4}" --percentile-metrics ttft,tpot,itl,e2el \
    --metric-percentiles 50,99 --disable-tqdm --json "$json" --label "$label" "$@"
}

if [ -z "${SKIP_VLLM:-}" ]; then
  PYTHONPATH=${VLLM_PYTHONPATH:+$VLLM_PYTHONPATH:}${PYTHONPATH:-} setsid python3 -c \
    "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()" serve "$W1" \
    --load-format dummy --port 8000 --max-model-len 2048 --max-num-seqs "${MAX_NUM_SEQS:-512}" --dtype bfloat16 \
    > "$OUT_DIR/vllm_serve.log" 2>&1 &
  pid=$!
  wait_ready http://127.0.0.1:8000/v1/models $pid && sweep 8000 "vLLM (vllm serve)" "$OUT_DIR/vllm.jsonl"
  stop $pid
fi

cd "$HERE/bentos/smollm2"
setsid python3 -m bentoml serve . --port 3000 --arg model="$W1" --arg load_format=dummy --arg dtype=bfloat16 \
  --arg max_model_len=2048 --arg max_num_seqs="${MAX_NUM_SEQS:-512}" \
  --arg engine_core_process="${ENGINE_CORE_PROCESS:-true}" --arg workers="${WORKERS:-1}" > "$OUT_DIR/ours.log" 2>&1 &
pid=$!
cd "${TMPDIR:-/tmp}"
plot=()
[ -f "$OUT_DIR/vllm.jsonl" ] && plot=(--plot "$OUT_DIR/curves.png" --compare "$OUT_DIR/vllm.jsonl" --compare-label vLLM)
wait_ready http://127.0.0.1:3000/readyz $pid && sweep 3000 paged-backend "$OUT_DIR/ours.jsonl" "${plot[@]}"
stop $pid
