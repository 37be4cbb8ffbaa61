#!/usr/bin/env bash
# The acquirer's `charge.settled` webhook, signed as Standard Webhooks signs (here with openssl),
# delivered three times (twice at once, then again): the charge moves from pending to available
# once. A forged delivery is `400` and changes nothing. Needs the demo's webhook secret:
# WEBHOOK_SECRET, else the development secret the demo uses without --webhook-secret.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

WEBHOOK_SECRET="${WEBHOOK_SECRET:-whsec_Y2hhcmdlcy1kZW1vIGRldiB3ZWJob29rIHNlY3JldCE=}"
command -v openssl >/dev/null 2>&1 || fail "openssl is needed to sign the webhooks"

# deliver TAG SECRET EVENT_ID BODY: POST /v1/webhooks/acquirer, signed now with SECRET.
deliver() {
    local tag=$1 secret=$2 id=$3 body=$4 ts hexkey signature
    ts=$(date +%s)
    hexkey=$(printf '%s' "${secret#whsec_}" | base64 -d | od -An -tx1 | tr -d ' \n')
    signature=$(printf '%s' "$id.$ts.$body" |
        openssl dgst -sha256 -mac HMAC -macopt "hexkey:$hexkey" -binary | base64)
    "${CURL[@]}" -o "$TMP/$tag.body" -D "$TMP/$tag.headers" -w '%{http_code}' \
        -H "content-type: application/json" -H "webhook-id: $id" \
        -H "webhook-timestamp: $ts" -H "webhook-signature: v1,$signature" \
        --data-binary "$body" "$BASE_URL/v1/webhooks/acquirer" >"$TMP/$tag.status" ||
        fail "cannot reach the demo at $BASE_URL"
}

# amounts TAG: the balance's available and pending usd amounts, space-separated.
amounts() {
    grep -o '"amount": *-\{0,1\}[0-9]*' "$TMP/$1.body" | sed 's/.*: *//' | head -n 2 | tr '\n' ' ' |
        sed 's/ $//'
}

title "A settlement webhook, redelivered"
charge charged "$(new_uuid)" amount=2000 currency=usd
show_brief charged
expect "the charge succeeds" "$(status charged)" 200
CHARGE_ID=$(field charged id)
fetch before /v1/balance
expect "before settlement it is pending" "$(amounts before)" "0 2000"

EVENT="evt_$(new_uuid | tr -d -)"
BODY="{\"id\":\"$EVENT\",\"type\":\"charge.settled\",\"data\":{\"object\":{\"id\":\"$CHARGE_ID\"}}}"
say ""
say "-> POST /v1/webhooks/acquirer  webhook-id: $EVENT  (forged signature)"
deliver forged "whsec_Zm9yZ2VkIHNlY3JldCBmb3IgdGhlIHRlc3RzIQ==" "$EVENT" "$BODY"
show forged
expect "a forged delivery is refused" "$(status forged)" 400
fetch after_forged /v1/balance
expect "and changes nothing" "$(amounts after_forged)" "0 2000"

say ""
say "-> POST /v1/webhooks/acquirer  webhook-id: $EVENT  (twice at once)"
deliver first "$WEBHOOK_SECRET" "$EVENT" "$BODY" &
deliver second "$WEBHOOK_SECRET" "$EVENT" "$BODY" &
wait
show first
expect "the first delivery is handled" "$(status first)" 200
expect "the concurrent one too" "$(status second)" 200
say "-> POST /v1/webhooks/acquirer  webhook-id: $EVENT  (redelivered)"
deliver again "$WEBHOOK_SECRET" "$EVENT" "$BODY"
expect "the redelivery is answered" "$(status again)" 200
cmp -s "$TMP/first.body" "$TMP/again.body" || fail "the redelivery got another answer: $(body again)"
say "   ok: with the first answer"

fetch after /v1/balance
show after
expect "the charge was settled once" "$(amounts after)" "2000 0"
pass "three deliveries, one settlement"
