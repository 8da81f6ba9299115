#!/usr/bin/env bash
# Order-independence check: every test file on its own, then all files in one run in reverse order.
# A test that passes only after another file ran (shared state, a hypothesis draw that depends on what
# ran before) fails here. Slow (one interpreter per file); not part of `make test`.
#   bash tests/run_isolated.sh [--device cpu|cuda|npu]      (PY=... picks the interpreter, default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
files=(tests/*/test_*.py)
failed=()
for f in "${files[@]}"; do
    echo "== $f"
    "$PY" -m pytest -q -p no:cacheprovider "$@" "$f" || failed+=("$f")
done
reversed=()
for ((i = ${#files[@]} - 1; i >= 0; i--)); do reversed+=("${files[i]}"); done
echo "== all files, reverse order"
"$PY" -m pytest -q -p no:cacheprovider "$@" "${reversed[@]}" || failed+=("(reverse order run)")
if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "every file passes on its own and in reverse order"
