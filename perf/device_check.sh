#!/usr/bin/env bash
# The prepared GPU check: one device call of at most 9 minutes (the step limits below sum to 540 s). Uses the
# machine's own python3 (torch, triton, transformers); nothing is installed or carried beyond the tree. Every
# step runs under its own `timeout` and a failed or cut step does not stop the next. Writes to $OUT (default
# perf/results/device/): device_check.log (every step's output), device_check.json (each step's exit and
# seconds, every JSON below, the suites' summary and failure lines), env.json, attention_bench.json,
# measure.json, <gpu>-measured-llama8b.json (a serving cost the policy lab loads), replay.json, demo.json.
#   usage: bash perf/device_check.sh          (from the repository root, on a CUDA machine)
#          bash perf/device_check.sh --dry    (any CPU: the same steps on a tiny model, the suites only collected)
#          SKIP="attention_bench demo" bash perf/device_check.sh   (a rerun that leaves out the named steps)
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-perf/results/device}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
LOG="$OUT/device_check.log"
STATUS=$(mktemp)
: > "$LOG"
if [ $DRY -eq 1 ]; then
  DEV=cpu
  export TRITON_INTERPRET=1
  RUN=(--collect-only -q)
  BENCH=(--shapes 1,2,64 3,4,40 --q-heads 4 --kv-heads 2 --head-dim 16 --dtype float32 --repeats 2 --kv-splits 2)
  MEASURE=(--tiny --layers 1 --drafter ngram --batch-sizes 1 --tokens 4)
  REPLAY=(--batch-sizes 1 --min-requests 2)
else
  DEV=cuda
  unset TRITON_INTERPRET
  export DSPARK_HYPOTHESIS_EXAMPLES=5   # the suite's hypothesis profile (tests/conftest.py), fewer examples
  RUN=(-p no:cacheprovider -v -rfE --durations=10)
  $PY -c "import xdist" 2>/dev/null && RUN+=(-n 4)
  $PY -c "import pytest_timeout" 2>/dev/null && RUN+=(--timeout 60)
  # Llama-8B heads (32 q / 8 kv, 128); small B first; 64 x 32k context: one cache over 2^31 elements
  BENCH=(--shapes 1,2,32768 1,8,32768 8,4,4096 32,4,4096 32,8,512 128,4,512 256,4,512 256,8,2048 64,4,32768
         --repeats 20 --kv-splits 32 64)  # more kv chunks: the B = 1 / 32k rows ran 1.4-1.5x FlexAttention
  MEASURE=(--layers 4)
  REPLAY=()
fi
step() {  # step NAME SECONDS CMD...: run with a time limit, append to the log, record `name rc seconds`
  local name=$1 limit=$2; shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "== $name: skipped (SKIP)" | tee -a "$LOG"; return; fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  echo "$name $rc $((SECONDS - t0))" >> "$STATUS"
}
step env 15 $PY perf/device_check.py env --device $DEV --out "$OUT/env.json"
# the device suite (every test that takes --device; cpu_only ones run in CI): kernels and verify first
step suite_kernels_verify 110 $PY -m pytest --device $DEV -m "not cpu_only" "${RUN[@]}" tests/kernels tests/verify
step suite_graphs_compile 60 env TORCH_LOGS=recompiles,graph_breaks $PY -m pytest --device $DEV -m "not cpu_only" \
  "${RUN[@]}" tests/serve/test_engine_graphs.py tests/serve/test_engine_compile.py tests/package/test_compile_public.py
step suite_rest 100 $PY -m pytest --device $DEV -m "not cpu_only" "${RUN[@]}" tests --ignore=tests/kernels \
  --ignore=tests/verify --ignore=tests/serve/test_engine_graphs.py --ignore=tests/serve/test_engine_compile.py \
  --ignore=tests/package/test_compile_public.py
step attention_bench 40 $PY perf/attention_bench.py --device $DEV "${BENCH[@]}" --out "$OUT/attention_bench.json"
step measure 145 $PY perf/device_check.py measure --device $DEV "${MEASURE[@]}" --out "$OUT/measure.json" \
  --cost-dir "$OUT"
step replay 55 $PY perf/device_check.py replay --measure "$OUT/measure.json" "${REPLAY[@]}" --out "$OUT/replay.json"
step demo 5 $PY perf/device_check.py demo --device $DEV --out "$OUT/demo.json"
INPUTS=()
for n in env attention_bench measure replay demo; do [[ " ${SKIP:-} " == *" $n "* ]] || INPUTS+=("$OUT/$n.json"); done
step collect 10 $PY perf/device_check.py collect --status "$STATUS" --log "$LOG" --out "$OUT/device_check.json" \
  --inputs "${INPUTS[@]}"
rm -f "$STATUS"
echo "wrote $LOG and $OUT/device_check.json"
$PY -c "import json, sys; r = json.load(open(sys.argv[1])); sys.exit(0 if r['passed'] else 1)" "$OUT/device_check.json"
