#!/usr/bin/env bash
# One command that checks pulsediff on a machine with an NVIDIA GPU: the GPU-relevant tests on
# the real device (NUMBA_ENABLE_CUDASIM=0), scripts/bench_gpu.py (copy bandwidth, every CUDA
# kernel's bandwidth, the 7B-shaped live apply), and the CLI on a 1 GB pair under each --device.
# It ends with a short summary; full logs go to $OUT (default ./gpu-check-out).
#
# It installs nothing from the internet. It runs from a copy of the repository with the project
# on PYTHONPATH, on the machine's own torch, numba and numba-cuda. What that machine lacks travels
# as wheels in .whl/ (git-ignored), fetched beforehand on a machine that reaches PyPI:
#
#     scripts/gpu_check.sh --fetch-wheels      # zstandard, pytest-timeout, and numpy < 2.5 (numba-cuda
#                                              # 0.30, in maintenance mode, fails to compile on numpy 2.5)
#     scripts/gpu_check.sh [PHASE] [--quick]   # on the GPU machine
#
# PHASE is all (default), or one of, in the order `all` runs them (issue 32: bench first):
#   bench   (~5 min on the 7B shape: it makes a 7B patch twice, from host copies and from CUDA
#            state dicts, each tens of seconds today);
#   threads (~2 min: make and apply of a 1 GB pair at PULSEDIFF_THREADS 1 2 4 8 16, alternating);
#   tests   (~1 min with pytest-xdist, 8 workers; ~3 min without);
#   cli     (~2 min).
# Each phase is cut off after its limit (seconds: BENCH_LIMIT 330, THREADS_LIMIT 150, TESTS_LIMIT
# 150, CLI_LIMIT 120), so `all` ends within about 12.5 minutes and a slow phase leaves the rest
# their turn; a cut-off phase reports "exit 124". Where one command may run 10 minutes, run the
# phases as separate commands, or `all` with smaller limits.
# --quick: a 16M-element kernel bench without the 7B model, and 0.25 GB CLI and threads pairs.
#
# Environment: GPU_PYTHON (default python3), GPU_PY_VERSION for --fetch-wheels (default 3.12).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${GPU_PYTHON:-python3}

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${GPU_PY_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "zstandard>=0.22" "numpy>=2.0,<2.5" "pytest-timeout>=2.3"
fi
QUICK=0
PHASE=all
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        all|tests|bench|threads|cli) PHASE=$arg ;;
        *) echo "usage: $0 [all|bench|threads|tests|cli] [--quick] | --fetch-wheels" >&2; exit 2 ;;
    esac
done
want() { [ "$PHASE" = all ] || [ "$PHASE" = "$1" ]; }
TESTS_RC=skipped BENCH_RC=skipped THREADS_RC=skipped CLI_RC=skipped
# A phase past its limit is killed (SIGTERM, then SIGKILL 10 s later): exit 124 or 137.
limited() { local limit=$1; shift; timeout -k 10 "$limit" "$@"; }

OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT"
SITE=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$OUT/numba-cache}

echo "== stack"
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/stack.txt"
import importlib, sys
for name in ("numpy", "numba", "numba_cuda", "torch", "zstandard", "xxhash", "safetensors"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as exc:
        print(f"{name} MISSING ({exc.__class__.__name__}: {exc})")
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.0f} GiB, driver CUDA {torch.version.cuda}")
from pulsediff.kernels import cuda_usable
print("pulsediff CUDA kernels usable:", cuda_usable())
PYEOF

if want bench; then
    echo "== kernels and the 7B shape"
    if [ $QUICK = 1 ]; then BENCH_ARGS="--elements 16777216 --model none --repeats 3"
    else BENCH_ARGS="--live --make --repeats 3"; fi
    # shellcheck disable=SC2086
    limited "${BENCH_LIMIT:-330}" "$PY" scripts/bench_gpu.py $BENCH_ARGS > "$OUT/bench_gpu.md" 2>&1
    BENCH_RC=$?
    cat "$OUT/bench_gpu.md"
fi

if want threads; then
    echo "== make and apply from 1 to 16 threads (the device machine's cores)"
    if [ $QUICK = 1 ]; then GB=0.25; else GB=1.0; fi
    limited "${THREADS_LIMIT:-150}" "$PY" scripts/bench_variants.py --threads 1 2 4 8 16 --gb $GB --density 0.02 \
        --repeats 2 --workdir "$(mktemp -d)" > "$OUT/threads.md" 2>&1
    THREADS_RC=$?
    cat "$OUT/threads.md"
fi

if want tests; then
    echo "== tests on the device"
    TESTS="tests/test_kernels_cuda.py tests/test_kernels.py tests/test_class_sort.py tests/test_live.py
           tests/test_live_sums.py tests/test_device_choice.py tests/test_golden.py tests/test_cli.py
           tests/test_checks_pinned.py"
    # shellcheck disable=SC2086
    # One test that hangs is cut off by pytest-timeout (where its wheel came along), with its
    # stack in the log, and the rest still run; -rfE lists every failure's reason at the end.
    PER_TEST=""
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then PER_TEST="--timeout=${PER_TEST_LIMIT:-60}"; fi
    # Several pytest workers where pytest-xdist is there (the device image has it): the kernels
    # compile once into the shared NUMBA_CACHE_DIR, and the GPU takes the workers' small launches.
    WORKERS=""
    if "$PY" -c "import xdist" 2>/dev/null; then WORKERS="-n ${TEST_WORKERS:-8}"; fi
    # Every tier: on a GPU the slow tier's simulated cases (older golden patches, more dtypes) are fast. Not the
    # bench script's simulator run: the bench phase runs the script itself.
    limited "${TESTS_LIMIT:-150}" "$PY" -m pytest -q -rfE -p no:cacheprovider $PER_TEST $WORKERS -m "slow or not slow" \
        --deselect tests/test_kernels_cuda.py::test_bench_gpu_tiny_runs_under_the_simulator $TESTS > "$OUT/tests.log" 2>&1
    TESTS_RC=$?
    tail -n 25 "$OUT/tests.log"
fi

if want cli; then
    echo "== the CLI on a file pair, each --device"
    if [ $QUICK = 1 ]; then GB=0.25; else GB=1.0; fi
    limited "${CLI_LIMIT:-120}" "$PY" scripts/bench_variants.py --devices cpu auto cuda --gb $GB --density 0.02 --repeats 3 --workdir "$(mktemp -d)" \
        > "$OUT/cli_devices.md" 2>&1
    CLI_RC=$?
    cat "$OUT/cli_devices.md"
fi

result() { case "$1" in skipped) echo "not run" ;; 0) echo ok ;; *) echo "exit $1" ;; esac; }
echo
echo "== summary ($PHASE)"
printf '| check | result |\n|---|---|\n'
if [ "$TESTS_RC" = skipped ]; then TESTS_LINE="not run"
else TESTS_LINE="$(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -n 1 || true)"; TESTS_LINE=${TESTS_LINE:-"exit $TESTS_RC"}; fi
printf '| tests (NUMBA_ENABLE_CUDASIM=0) | %s |\n' "$TESTS_LINE"
printf '| scripts/bench_gpu.py (bit for bit) | %s |\n' "$(result $BENCH_RC)"
printf '| threads 1-16 (outputs cmp-identical) | %s |\n' "$(result $THREADS_RC)"
printf '| CLI per device (outputs cmp-identical) | %s |\n' "$(result $CLI_RC)"
for rc in $TESTS_RC $BENCH_RC $THREADS_RC $CLI_RC; do [ "$rc" = skipped ] || [ "$rc" = 0 ] || exit 1; done
