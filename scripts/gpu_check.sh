#!/bin/bash
# One GPU machine's checks in one command, inside a time budget: the GPU tests
# (tests/gpu), then scripts/benchmark.py presets until the budget is spent.
#
#   bash scripts/gpu_check.sh OUT_DIR BUDGET_SECONDS [PRESET ...]
#
# TESTS=all (default) runs tests/gpu/test_gpu_training.py,
# tests/gpu/test_float8_ac_compile.py and tests/gpu/test_speed_paths.py side by
# side (they wait on compiles more than on the GPU; their timings are not
# read), TESTS=float8, TESTS=training or TESTS=speed one of them, TESTS=none none; TEST_SECONDS bounds them (default: half the
# budget when presets follow, all of it otherwise). The benchmark runs alone afterwards, one
# preset at a time, each as its own CLI run; its JSON (OUT_DIR/bench.json) is
# rewritten after every row, so a budget cut short keeps the rows it finished.
# Logs: OUT_DIR/gpu_training.log, OUT_DIR/float8.log, OUT_DIR/speed.log, OUT_DIR/bench.txt.
# BENCH_ARGS replaces the benchmark's "--device cuda --steps 30 --warmup 14"
# (BENCH_ARGS=--cpu-smoke rehearses the script on a CPU machine). Exit status:
# 1 if a test run failed (or ran out of time), 0 otherwise.
# Why a budget: lent GPU machines come by the minute (benchmarks/gpu-next-session.md).
set -u
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR BUDGET_SECONDS [PRESET ...]" >&2
    exit 2
fi
out=$1 budget=$2; shift 2
case $budget in ''|*[!0-9]*) echo "BUDGET_SECONDS must be a whole number of seconds, not '$budget'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
start=$(date +%s)
left() { echo $((start + budget - $(date +%s))); }
py=${PYTHON:-python3}

tests=${TESTS:-all}
case $tests in
    all|float8|training|speed|none) ;;
    *) echo "TESTS must be all, float8, training, speed or none, not '$tests'" >&2; exit 2 ;;
esac
# Tests get TEST_SECONDS, by default half the budget when presets follow and all of it otherwise.
cap=${TEST_SECONDS:-$(( $# > 0 ? budget / 2 : budget - 10 ))}
pids=()
if [ "$tests" = all ] || [ "$tests" = training ]; then
    timeout "$cap" "$py" -m pytest -q -m gpu -rA -p no:cacheprovider tests/gpu/test_gpu_training.py \
        >"$out/gpu_training.log" 2>&1 &
    pids+=($!)
fi
if [ "$tests" = all ] || [ "$tests" = float8 ]; then
    timeout "$cap" "$py" -m pytest -q -m gpu -s -rA -p no:cacheprovider tests/gpu/test_float8_ac_compile.py \
        >"$out/float8.log" 2>&1 &
    pids+=($!)
fi
if [ "$tests" = all ] || [ "$tests" = speed ]; then
    timeout "$cap" "$py" -m pytest -q -m gpu -rA -p no:cacheprovider tests/gpu/test_speed_paths.py \
        >"$out/speed.log" 2>&1 &
    pids+=($!)
fi
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for log in "$out/gpu_training.log" "$out/float8.log" "$out/speed.log"; do
    [ -f "$log" ] || continue
    echo "== $log"
    grep -E "^(PASSED|FAILED|XFAIL|XPASS|ERROR)|passed|failed|skipped" "$log" | tail -40
done

if [ $# -gt 0 ]; then
    secs=$(left)
    if [ "$secs" -lt 60 ]; then
        echo "no time left for the benchmark (${secs}s)"
    else
        echo "== benchmark, ${secs}s left"
        # A preset that outlives the budget is stopped by benchmark.py's own --timeout at the latest.
        # shellcheck disable=SC2086
        timeout "$secs" "$py" scripts/benchmark.py ${BENCH_ARGS:---device cuda --steps 30 --warmup 14} \
            --timeout "$(( secs < 180 ? secs : 180 ))" --out "$out/bench.json" --presets "$@" >"$out/bench.txt" 2>&1
        tail -20 "$out/bench.txt"
    fi
fi
echo "gpu_check done in $(( $(date +%s) - start ))s"
exit $status
