#!/usr/bin/env bash
# Runs the multi-node test binaries (real swarms of processes and tasks on 127.0.0.1) N times
# in a row beside two CPU hogs, with no retries, to find the tests that fail now and then.
# Stops by itself after LIMIT seconds (default and most: 1800), whatever N says. Prints one
# line per run and a summary (runs, passes, failures and the tests that failed), also written
# to target/soak/summary.txt.
#
#   sim/scripts/soak-tests.sh [N]        # N runs (default 5)
#   LIMIT=600 sim/scripts/soak-tests.sh 3
set -u
N=${1:-5}
LIMIT=${LIMIT:-1800}
if [ "$LIMIT" -gt 1800 ]; then LIMIT=1800; fi
cd "$(dirname "$0")/../.."
OUT=target/soak
mkdir -p "$OUT"
FILTER='binary(swarm) or binary(market) or binary(worker) or binary(http) or binary(api)
  or binary(chat_api) or binary(relay) or binary(distributed) or binary(dashboard)
  or binary(serve) or binary(cli_swarm) or binary(crash) or binary(liveness)'

# Build first, outside the time limit's runs.
cargo nextest run --workspace --no-run >/dev/null 2>&1 || {
  echo "the tests do not build" >&2
  exit 2
}

# Two processes that keep both cores busy, ended whatever way this script ends.
yes >/dev/null &
HOG1=$!
yes >/dev/null &
HOG2=$!
trap 'kill $HOG1 $HOG2 2>/dev/null' EXIT
trap 'exit 143' INT TERM

START=$(date +%s)
PASSES=0
FAILURES=0
RUNS=0
: >"$OUT/failed-tests.txt"
for i in $(seq 1 "$N"); do
  LEFT=$((LIMIT - ($(date +%s) - START)))
  if [ "$LEFT" -le 0 ]; then
    echo "time limit of ${LIMIT}s reached after $RUNS runs"
    break
  fi
  LOG="$OUT/run-$i.log"
  T0=$(date +%s)
  timeout "$LEFT" cargo nextest run --workspace --no-fail-fast --retries 0 -E "$FILTER" >"$LOG" 2>&1
  RC=$?
  RUNS=$((RUNS + 1))
  SUMMARY=$(grep -E '^ +Summary' "$LOG" | tail -1 | sed 's/^ *//')
  if [ "$RC" -eq 0 ]; then
    PASSES=$((PASSES + 1))
    echo "run $i: passed in $(($(date +%s) - T0)) s: $SUMMARY"
  else
    FAILURES=$((FAILURES + 1))
    echo "run $i: FAILED (status $RC) in $(($(date +%s) - T0)) s: $SUMMARY"
    grep -E '^ +(FAIL|TIMEOUT|SIGSEGV|SIGABRT)' "$LOG" | sed 's/^ *//' | sort -u | tee -a "$OUT/failed-tests.txt"
  fi
done
{
  echo "soak: $RUNS runs of the multi-node tests beside two CPU hogs, no retries"
  echo "passed: $PASSES, failed: $FAILURES, wall: $(($(date +%s) - START)) s"
  if [ -s "$OUT/failed-tests.txt" ]; then
    echo "failed tests (logs in $OUT/run-*.log):"
    sort "$OUT/failed-tests.txt" | uniq -c
  fi
} | tee "$OUT/summary.txt"
[ "$FAILURES" -eq 0 ]
