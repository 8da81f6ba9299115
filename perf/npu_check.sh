#!/usr/bin/env bash
# The prepared Ascend 910C check, for the owner of a 910C with `pip install dspark[npu]` (torch_npu +
# triton-ascend, CANN): the bring-up ladder (single rank eager, single rank graph, TP, DP with idle ranks),
# the device suite on --device npu (every test that takes the device), and the metadata / graph / kernel
# benchmarks. Writes one log and one JSON to $OUT (default perf/results/npu/): npu_check.log, npu_check.json
# (every step's exit code, seconds and JSON output, plus the suite's "tests ran on the device" line).
#   usage: bash perf/npu_check.sh          (from the repository root, on a 910C)
#          bash perf/npu_check.sh --dry    (any CPU: the same steps on CPU tensors, Triton interpreted,
#                                           gloo groups, eager graphs; the suite only collected)
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-perf/results/npu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
LOG="$OUT/npu_check.log"
STATUS="$OUT/steps.tsv"
: > "$LOG"
: > "$STATUS"
if [ $DRY -eq 1 ]; then
  DEV=cpu
  export TRITON_INTERPRET=1
  SUITE=(--device cpu --collect-only -q -m "not cpu_only" tests)
  REPEATS=2
else
  DEV=npu
  unset TRITON_INTERPRET
  SUITE=(--device npu -q -p no:cacheprovider -m "not cpu_only" tests)   # cpu_only tests run in CI
  REPEATS=20
fi
step() {  # step NAME SECONDS CMD...: run with a time limit, append to the log, record `name rc seconds`
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  echo "$name $rc $((SECONDS - t0))" >> "$STATUS"
}
step env 60 $PY perf/npu_check.py env --device $DEV --out "$OUT/env.json"
step ladder_single_rank 300 $PY perf/ascend_bringup.py --device $DEV --out "$OUT/ascend_bringup.json" \
  --capability "$OUT/npu_capability.json"
step ladder_tp_dp 300 $PY perf/npu_check.py ranks --device $DEV --world 3 --out "$OUT/ranks.json"
step suite 1800 $PY -m pytest "${SUITE[@]}"
step metadata_bench 300 $PY perf/ascend_metadata_bench.py --device $DEV --repeats $REPEATS --batches 1 8 64 \
  --out "$OUT/ascend_metadata_bench.json"
step graph_kernel_bench 600 $PY perf/npu_check.py bench --device $DEV --repeats $REPEATS --out "$OUT/bench.json"
$PY perf/npu_check.py collect --status "$STATUS" --log "$LOG" --out "$OUT/npu_check.json" --inputs \
  "$OUT/env.json" "$OUT/ascend_bringup.json" "$OUT/ranks.json" "$OUT/ascend_metadata_bench.json" "$OUT/bench.json" \
  > /dev/null
rc=$?
echo "wrote $LOG and $OUT/npu_check.json (exit $rc)"
exit $rc
