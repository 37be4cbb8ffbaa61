#!/usr/bin/env bash
# A refund runs once per Idempotency-Key, like a charge: retried, it is replayed and refunds
# nothing more. A refund of more than is left is refused (`400 amount_too_large`) and changes
# nothing; and a key belongs to one request whatever the endpoint, so the charge's key sent on a
# refund is `422 idempotency_error`.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

title "A refund, retried"
say "-> POST /v1/charges  amount=2000 currency=usd"
CHARGE_KEY=$(new_uuid)
charge charged "$CHARGE_KEY" amount=2000 currency=usd
show_brief charged
expect "the charge succeeds" "$(status charged)" 200
CHARGE_ID=$(field charged id)

say ""
KEY=$(new_uuid)
say "-> POST /v1/refunds  Idempotency-Key: $KEY  charge=$CHARGE_ID amount=500"
refund first "$KEY" charge="$CHARGE_ID" amount=500
show first
expect "the refund succeeds" "$(status first)" 200
expect "it is a refund" "$(field first object)" refund
expect "of 500" "$(field first amount)" 500
REFUND_ID=$(field first id)

say ""
say "-> POST /v1/refunds  Idempotency-Key: $KEY  (the same refund, retried)"
refund retry "$KEY" charge="$CHARGE_ID" amount=500
show_brief retry
expect "the retry gets the same refund" "$(field retry id)" "$REFUND_ID"
expect "as a replay" "$(header retry idempotent-replayed)" true
cmp -s "$TMP/first.body" "$TMP/retry.body" || fail "the replayed refund differs"
say "   ok: byte for byte the same refund"

say ""
say "-> POST /v1/refunds  Idempotency-Key: (new)  charge=$CHARGE_ID amount=2000  (more than is left)"
refund over "$(new_uuid)" charge="$CHARGE_ID" amount=2000
show over
expect "more than is left is refused" "$(status over)" 400
expect "as Stripe's amount_too_large" "$(field over code)" amount_too_large

say ""
say "-> POST /v1/refunds  Idempotency-Key: $CHARGE_KEY  (the charge's key)"
refund reused "$CHARGE_KEY" charge="$CHARGE_ID"
show_brief reused
expect "a key used for the charge is refused on a refund" "$(status reused)" 422
grep -q '"type": *"idempotency_error"' "$TMP/reused.body" ||
    fail "expected Stripe's idempotency_error in the problem's error: $(body reused)"
say "   ok: as Stripe's idempotency_error"

say ""
say "-> GET /v1/charges/$CHARGE_ID"
fetch after "/v1/charges/$CHARGE_ID"
expect "500 of it refunded, once" "$(field after amount_refunded)" 500
expect "not in full" "$(field after refunded)" false
say "-> GET /v1/refunds"
fetch refunds "/v1/refunds?limit=100"
expect "exactly one refund exists" "$(count_objects refunds refund)" 1
pass "refunded 500 of $CHARGE_ID once ($REFUND_ID), the retry replayed, an over-refund and a reused key refused"
