#!/usr/bin/env bash
# A declined card (`tok_chargeDeclined`) is a final answer: `402 card_error`, stored and replayed
# to retries, which do not try the card again.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

title "Declined card"
KEY=$(new_uuid)
say "-> POST /v1/charges  Idempotency-Key: $KEY  amount=2000 currency=usd source=tok_chargeDeclined"
charge first "$KEY" amount=2000 currency=usd source=tok_chargeDeclined
show first
expect "the card is declined" "$(status first)" 402
expect "as a card error" "$(field first type)" card_error
expect "card_declined" "$(field first code)" card_declined
FAILED_ID=$(field first charge)

say ""
say "-> POST /v1/charges  Idempotency-Key: $KEY  (retried)"
charge retry "$KEY" amount=2000 currency=usd source=tok_chargeDeclined
show retry
expect "the decline is replayed" "$(status retry)" 402
expect "marked as a replay" "$(header retry idempotent-replayed)" true
cmp -s "$TMP/first.body" "$TMP/retry.body" || fail "the replayed decline differs"
say "   ok: byte for byte the same decline"

say ""
say "-> GET /v1/charges"
list_charges list
expect "one attempt was made" "$(count_charges list)" 1
expect "the failed charge" "$(field list id)" "$FAILED_ID"
expect "with status failed" "$(field list status)" failed
pass "declined once ($FAILED_ID), replayed to the retry"
