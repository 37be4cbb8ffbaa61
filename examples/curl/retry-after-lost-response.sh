#!/usr/bin/env bash
# A payment whose response is lost: the client retries with the same Idempotency-Key and gets
# the same charge back, marked `Idempotent-Replayed: true`; the card is charged once.
#
# Works with any --processing-delay-ms. With a delay over half a second the first attempt really
# loses its response (the client gives up), and the retry meets `409` until the first attempt,
# which the server finishes anyway, is done.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

title "Retry after a lost response"
KEY=$(new_uuid)
say "-> POST /v1/charges  Idempotency-Key: $KEY  amount=2000 currency=usd"
say "   (the client gives up after 0.5 s, as if the network dropped the response)"
MAX_TIME=0.5 charge first "$KEY" amount=2000 currency=usd 'metadata[order_id]=6735'
FIRST_ID=""
if timed_out first; then
    say "<- no response: the client timed out. Did the card get charged? Retry and see."
else
    show first
    expect "the first attempt charged" "$(status first)" 200
    FIRST_ID=$(field first id)
    say "   (pretend this response was lost on its way to the client)"
fi

say ""
say "-> POST /v1/charges  Idempotency-Key: $KEY  (the same request, retried)"
for _ in $(seq 1 60); do
    charge retry "$KEY" amount=2000 currency=usd 'metadata[order_id]=6735'
    [ "$(status retry)" != 409 ] && break
    wait_for=$(header retry retry-after)
    say "<- HTTP 409: the first attempt is still being processed; retrying in ${wait_for:-1} s"
    sleep "${wait_for:-1}"
done
show retry
expect "the retry succeeds" "$(status retry)" 200
RETRY_ID=$(field retry id)
if [ -n "$FIRST_ID" ]; then
    expect "it is a replay" "$(header retry idempotent-replayed)" true
    expect "it is the same charge" "$RETRY_ID" "$FIRST_ID"
elif [ "$(header retry idempotent-replayed)" = true ]; then
    say "   ok: it is a replay: the first attempt did charge, and this is its answer"
else
    say "   ok: the first attempt never reached the server, so the retry charged"
fi

say ""
say "-> POST /v1/charges  Idempotency-Key: $KEY  (and once more)"
charge again "$KEY" amount=2000 currency=usd 'metadata[order_id]=6735'
show_brief again
expect "the same charge again" "$(field again id)" "$RETRY_ID"
expect "replayed again" "$(header again idempotent-replayed)" true
cmp -s "$TMP/retry.body" "$TMP/again.body" || fail "the replays differ"
say "   ok: the replays are byte for byte identical"

say ""
say "-> GET /v1/charges  (this account's charges)"
list_charges list
expect "exactly one charge exists" "$(count_charges list)" 1
expect "and it is that one" "$(field list id)" "$RETRY_ID"
pass "retried twice, charged once ($RETRY_ID)"
