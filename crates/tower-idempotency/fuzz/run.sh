#!/usr/bin/env bash
# Runs every fuzz target of tower-idempotency for SECONDS each (default 30), one after another,
# and exits non-zero if any of them finds a crash (a panic, a failed assertion, a timeout, or
# memory over the limit). The input that failed is left in fuzz/artifacts/<target>/.
#
#     crates/tower-idempotency/fuzz/run.sh [SECONDS]
#
# Needs a nightly toolchain and cargo-fuzz (`rustup toolchain install nightly`,
# `cargo install cargo-fuzz`). Without them it says so and exits 0, unless FUZZ_REQUIRED=1.
#
# New inputs libFuzzer finds go to a scratch corpus under the target directory
# (fuzz/target, or $CARGO_TARGET_DIR), never into the committed seeds in fuzz/corpus/.
set -euo pipefail

seconds=${1:-30}
case $seconds in
'' | *[!0-9]*)
    echo "usage: $0 [seconds-per-target]" >&2
    exit 2
    ;;
esac
cd "$(dirname "$0")"

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: cargo +nightly fuzz is not available; not fuzzing" \
        "(rustup toolchain install nightly && cargo install cargo-fuzz)" >&2
    [ "${FUZZ_REQUIRED:-0}" = 1 ] && exit 1
    exit 0
fi

target_dir=${CARGO_TARGET_DIR:-$PWD/target}
work=$target_dir/corpus-work
logs=$target_dir/logs
mkdir -p "$work" "$logs"

echo "fuzz: building the targets"
cargo +nightly fuzz build --target-dir "$target_dir"

failed=()
for target in $(cargo +nightly fuzz list); do
    mkdir -p "$work/$target" "corpus/$target"
    log=$logs/$target.log
    echo "fuzz: $target for ${seconds}s (log: $log)"
    # -rss_limit_mb / -malloc_limit_mb: the parsers must stay far below 1 GiB on any input.
    if cargo +nightly fuzz run --target-dir "$target_dir" "$target" \
        "$work/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -malloc_limit_mb=512 \
        -print_final_stats=1 >"$log" 2>&1; then
        status=ok
    else
        status=FAILED
        failed+=("$target")
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)
    echo "fuzz: $target $status: ${runs:-?} executions, ${coverage:-cov: ?}"
    if [ "$status" = FAILED ]; then
        tail -n 40 "$log" >&2
    fi
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: crashes in: ${failed[*]} (inputs in $PWD/artifacts/)" >&2
    exit 1
fi
echo "fuzz: no crashes"
