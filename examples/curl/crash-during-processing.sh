#!/usr/bin/env bash
# A crash at the worst moment: the demo is killed (SIGKILL) while a charge sleeps in its
# processing delay, after the acquirer authorized the card and before the ledger write. Restarted,
# the demo finishes the charge on the client's retry, and the acquirer shows one authorization:
# the retry found the recorded `authorize` step (or, in memory, re-sent the same downstream key).
#
# Unlike the other scenarios it starts its own processes, since it kills one: the demo
# ($CHARGES_DEMO_BIN, else built with cargo) on $DATABASE_URL if set, else in memory; and an
# acquirer, unless $ACQUIRER_URL names one ($ACQUIRER_BIN, else built with cargo).
set -euo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
source "$dir/lib.sh"

PIDS=()
trap 'for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill -9 "$pid" 2>/dev/null || true; done; rm -rf "$TMP"' EXIT

if [ -z "${CHARGES_DEMO_BIN:-}" ] || { [ -z "${ACQUIRER_URL:-}" ] && [ -z "${ACQUIRER_BIN:-}" ]; }; then
    say "building charges-demo and acquirer ..."
    (cd "$dir/../.." && cargo build -q -p charges-demo -p acquirer)
    target=${CARGO_TARGET_DIR:-$dir/../../target}
    CHARGES_DEMO_BIN=${CHARGES_DEMO_BIN:-$target/debug/charges-demo}
    ACQUIRER_BIN=${ACQUIRER_BIN:-$target/debug/acquirer}
fi

# start NAME COMMAND...: runs it in the background and waits for its `listening on ADDR` line;
# leaves its pid in $PID and its address in $ADDR.
start() {
    local name=$1
    shift
    "$@" >"$TMP/$name.out" 2>"$TMP/$name.log" &
    PID=$!
    # Not the shell's job: killing it is this script's point, not news to print.
    disown "$PID"
    PIDS+=("$PID")
    ADDR=""
    for _ in $(seq 300); do
        ADDR=$(sed -n 's/^listening on //p' "$TMP/$name.out")
        [ -n "$ADDR" ] && return 0
        kill -0 "$PID" 2>/dev/null || fail "$name exited at start-up: $(tail -n 3 "$TMP/$name.log")"
        sleep 0.1
    done
    fail "$name did not start within 30 s"
}

# authorizations: how many authorizations the acquirer lists.
authorizations() {
    "${CURL[@]}" "$ACQUIRER_URL/v1/authorizations" -o "$TMP/authorizations.body" ||
        fail "cannot reach the acquirer at $ACQUIRER_URL"
    count_objects authorizations authorization
}

title "Crash between the authorization and the ledger write"
if [ -z "${ACQUIRER_URL:-}" ]; then
    start acquirer "$ACQUIRER_BIN" --listen 127.0.0.1:0
    ACQUIRER_URL="http://$ADDR"
fi
before=$(authorizations)
demo=("$CHARGES_DEMO_BIN" --listen 127.0.0.1:0 --acquirer-url "$ACQUIRER_URL"
    --processing-delay-ms 3000 --lease-secs 2)
[ -n "${DATABASE_URL:-}" ] && demo+=(--database-url "$DATABASE_URL")
start demo "${demo[@]}"
BASE_URL="http://$ADDR"
say "   the demo listens on $BASE_URL, the acquirer on $ACQUIRER_URL"

KEY=$(new_uuid)
say "-> POST /v1/charges  Idempotency-Key: $KEY  amount=2000 currency=usd"
"${CURL[@]}" -o /dev/null -u "$API_KEY:" -H "Idempotency-Key: $KEY" \
    -d amount=2000 -d currency=usd "$BASE_URL/v1/charges" >/dev/null 2>&1 &
for _ in $(seq 200); do
    [ "$(authorizations)" -gt "$before" ] && break
    sleep 0.1
done
expect "the acquirer authorized the card" "$(authorizations)" $((before + 1))
say "   the charge now sleeps in its processing delay, before the ledger write"
say "-> kill -9 the demo"
kill -9 "$PID"
while kill -0 "$PID" 2>/dev/null; do sleep 0.1; done

start demo "${demo[@]}"
BASE_URL="http://$ADDR"
say "   restarted on $BASE_URL"
say "-> POST /v1/charges  Idempotency-Key: $KEY  (the client's retry)"
for _ in $(seq 1 30); do
    charge retry "$KEY" amount=2000 currency=usd
    [ "$(status retry)" != 409 ] && break
    wait_for=$(header retry retry-after)
    say "<- HTTP 409: the dead demo's lease still holds the key; retrying in ${wait_for:-1} s"
    sleep "${wait_for:-1}"
done
show_brief retry
expect "the retry charges" "$(status retry)" 200
expect "the acquirer holds one authorization for it" "$(authorizations)" $((before + 1))
list_charges list
expect "exactly one charge exists" "$(count_charges list)" 1
pass "killed mid-charge, retried: one authorization, one charge ($(field retry id))"
