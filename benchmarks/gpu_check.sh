#!/usr/bin/env bash
# The GPU check: one prepared script for a CUDA machine. It installs nothing.
#   1. the tests marked gpu            (python -m pytest -m gpu -q)
#   2. the engine, and vLLM where it imports (benchmarks/gpu_check_engine.py)
#   3. the KV transports               (benchmarks/gpu_check_transfer.py)
# Each step runs under its own time limit (about 11 minutes in all) and a failed
# step does not stop the next. All output goes to stdout and, when $OUT is set,
# to $OUT/gpu_check.log. Exit status: 0 when every step passed, else 1.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; PYTHON=... picks the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

# The project's virtual environment when there is one, else the machine's python3.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

failed=()

# step NAME LIMIT_S COMMAND...: one bounded step; a failure is remembered.
step() {
  local name=$1 limit=$2
  shift 2
  echo
  echo "=== $name (limit ${limit} s) ==="
  local start=$SECONDS rc=0
  timeout --kill-after=15 "$limit" "$@" || rc=$?
  if [ "$rc" -eq 124 ]; then echo "$name: timed out after ${limit} s"; fi
  echo "=== $name: exit $rc after $((SECONDS - start)) s ==="
  if [ "$rc" -ne 0 ]; then failed+=("$name (exit $rc)"); fi
}

check() {
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname); $("$PY" --version 2>&1) ($PY)"
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi: not available"

  # Where disagg is not installed, map the package folders into the disagg
  # namespace through links in a scratch folder (what the editable install does).
  if ! "$PY" -c "import disagg.workers.engine" 2>/dev/null; then
    shim=$(mktemp -d)
    trap 'rm -rf "$shim"' EXIT
    mkdir "$shim/disagg"
    for part in workers operator proto testing; do ln -s "$PWD/$part" "$shim/disagg/$part"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
    echo "disagg is not installed for $PY: importing it from $PWD through $shim"
  fi

  # NOTE: --continue-on-collection-errors, so that a test folder whose imports this
  # machine lacks (the operator's, say) does not keep the GPU tests from running.
  # The root tests/conftest.py (the control plane's fixtures) needs the kubernetes
  # client; where it cannot load, each folder holding GPU tests runs alone, with
  # its own conftest only (--confcutdir).
  if "$PY" -c "import runpy; runpy.run_path('tests/conftest.py')" 2>/dev/null; then
    step "pytest -m gpu" 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors
  else
    echo "tests/conftest.py does not import here: the folders with GPU tests run one by one without it"
    local dir
    for dir in $(grep -rl --include='test_*.py' 'mark.gpu' tests | xargs -n1 dirname | sort -u); do
      step "pytest -m gpu $dir" 75 "$PY" -m pytest -m gpu -q -p no:cacheprovider --confcutdir="$dir" "$dir"
    done
  fi
  step "engine" 420 "$PY" benchmarks/gpu_check_engine.py --vllm-timeout-s 180
  step "transfer" 90 "$PY" benchmarks/gpu_check_transfer.py

  echo
  if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu_check: every step passed"
    return 0
  fi
  echo "gpu_check: failed: ${failed[*]}"
  return 1
}

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  check 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
check
