#!/usr/bin/env bash
# Runs every scenario against the demo at $BASE_URL (default http://127.0.0.1:3000) and exits
# non-zero if any failed.
#
# The double click needs the server started with a processing delay:
#     cargo run -p charges-demo -- --processing-delay-ms 2000
# With DEMO_WAITS=1, for a server started with `--in-flight-wait-ms 5000` too, the double click
# expects the duplicates to wait for the first charge instead of getting `409`.
set -uo pipefail
dir=$(dirname "$0")
export BASE_URL="${BASE_URL:-http://127.0.0.1:3000}"

# The demo may still be compiling (`cargo run ... &`): wait up to 5 minutes for it to answer.
for _ in $(seq 300); do
    curl -s -o /dev/null "$BASE_URL/" && break
    [ "${announced:-}" ] || { echo "waiting for the demo at $BASE_URL ..."; announced=1; }
    sleep 1
done

double_click=double-click
[ "${DEMO_WAITS:-0}" = 1 ] && double_click=double-click-waiting
scenarios=(retry-after-lost-response "$double_click" changed-amount declined-card refund webhook-redelivery)
failed=()
for scenario in "${scenarios[@]}"; do
    if ! bash "$dir/$scenario.sh"; then
        failed+=("$scenario")
    fi
done

printf '\n'
if [ ${#failed[@]} -eq 0 ]; then
    printf 'all %d scenarios passed against %s\n' "${#scenarios[@]}" "$BASE_URL"
else
    printf '%d of %d scenarios failed against %s: %s\n' \
        "${#failed[@]}" "${#scenarios[@]}" "$BASE_URL" "${failed[*]}" >&2
    exit 1
fi
