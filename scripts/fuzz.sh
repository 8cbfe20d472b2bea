#!/usr/bin/env bash
# Runs CapyCTL's fuzz targets with cargo-fuzz (libFuzzer; nightly Rust), each for a given time,
# and prints a table of each target's run time, executions and result.
#
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]     (default: 600 s, every target)
#
# Environment: FUZZ_JOBS targets at once (default 2); FUZZ_TARGET_DIR the build directory
# (default fuzz/target); FUZZ_WORK where each run's growing corpus and log go (default
# fuzz/work, ignored by git). Each run starts from the checked-in corpus fuzz/corpus/<target>/
# (read only) and writes what it finds to FUZZ_WORK/<target>/corpus; a crash, a hang
# (-timeout=10 s for one input) or memory over -rss_limit_mb=2048 stops the run and leaves
# the input in fuzz/artifacts/<target>/. Needs `cargo +nightly fuzz` (cargo install cargo-fuzz).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

SECONDS_EACH=${1:-600}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
    mapfile -t TARGETS < <(cargo +nightly fuzz list)
fi
JOBS=${FUZZ_JOBS:-2}
TARGET_DIR=${FUZZ_TARGET_DIR:-target}
WORK=${FUZZ_WORK:-work}

# -a: debug assertions and overflow checks on, as in the stable tests.
cargo +nightly fuzz build -a --target-dir "$TARGET_DIR"

run_one() {
    local target=$1
    local rc=0
    mkdir -p "$WORK/$target/corpus"
    cargo +nightly fuzz run -a --target-dir "$TARGET_DIR" "$target" \
        "$WORK/$target/corpus" "corpus/$target" -- \
        -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 >"$WORK/$target/log" 2>&1 || rc=$?
    echo "$rc" >"$WORK/$target/rc"
}

running=0
for target in "${TARGETS[@]}"; do
    run_one "$target" &
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then
        wait -n || true
        running=$((running - 1))
    fi
done
wait || true

printf '%-12s %8s %14s %10s  %s\n' target seconds executions exec/s result
failed=0
for target in "${TARGETS[@]}"; do
    log="$WORK/$target/log"
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
    # libFuzzer's last words: "Done 123456 runs in 600 second(s)".
    runs_line=$(grep -oE 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1 || true)
    execs=$(echo "$runs_line" | awk '{print $2}')
    secs=$(echo "$runs_line" | awk '{print $5}')
    rate=$(echo "$done_line" | grep -oE 'exec/s: [0-9]+' | grep -oE '[0-9]+' || true)
    if [ "$(cat "$WORK/$target/rc" 2>/dev/null)" = 0 ] && [ -n "$done_line" ]; then
        result=ok
    else
        result="FAILED (see $log)"
        failed=1
    fi
    printf '%-12s %8s %14s %10s  %s\n' "$target" "${secs:-?}" "${execs:-?}" "${rate:-?}" "$result"
done
exit $failed
