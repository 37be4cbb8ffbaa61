#!/usr/bin/env bash
# A key reused for a different request (another amount) is a client bug: the demo answers the
# IETF draft's `422`, a problem document carrying Stripe's `idempotency_error`, and neither
# charges again nor replays the first charge to the wrong request.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

title "Reusing a key with another amount"
KEY=$(new_uuid)
say "-> POST /v1/charges  Idempotency-Key: $KEY  amount=2000 currency=usd"
charge first "$KEY" amount=2000 currency=usd
show first
expect "the first request charges" "$(status first)" 200
FIRST_ID=$(field first id)

say ""
say "-> POST /v1/charges  Idempotency-Key: $KEY  amount=5000 currency=usd  (same key, new amount)"
charge changed "$KEY" amount=5000 currency=usd
show changed
expect "a different request under the same key is refused" "$(status changed)" 422
expect "as a problem document" "$(header changed content-type)" application/problem+json
grep -q '"type": *"idempotency_error"' "$TMP/changed.body" ||
    fail "expected Stripe's idempotency_error in the problem's error: $(body changed)"
say "   ok: as Stripe's idempotency_error"

say ""
say "-> POST /v1/charges  Idempotency-Key: $KEY  amount=2000 currency=usd  (the original again)"
charge original "$KEY" amount=2000 currency=usd
show_brief original
expect "the original request still replays its charge" "$(field original id)" "$FIRST_ID"
expect "as a replay" "$(header original idempotent-replayed)" true

say ""
say "-> GET /v1/charges"
list_charges list
expect "exactly one charge exists" "$(count_charges list)" 1
expect "for the original amount" "$(field list amount)" 2000
pass "the changed request got 422 idempotency_error; one charge of 2000 ($FIRST_ID)"
