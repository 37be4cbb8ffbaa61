#!/usr/bin/env bash
# A double click: the same payment sent three times at once with one Idempotency-Key. One
# request charges; the duplicates that arrive while it is processed get `409` with Retry-After;
# exactly one charge exists.
#
# Needs the server started with a processing delay, so that the duplicates arrive while the
# first is still being processed:
#     cargo run -p charges-demo -- --processing-delay-ms 2000
set -euo pipefail
source "$(dirname "$0")/lib.sh"

CLICKS=3
title "Double click: $CLICKS identical payments at once"
KEY=$(new_uuid)
say "-> $CLICKS x POST /v1/charges  Idempotency-Key: $KEY  amount=4999 currency=usd  (concurrently)"
for i in $(seq 1 "$CLICKS"); do
    charge "click$i" "$KEY" amount=4999 currency=usd description="Concert tickets" &
done
wait

charged=0 conflicts=0 replays=0
for i in $(seq 1 "$CLICKS"); do
    printf '   click %s ' "$i"
    show_brief "click$i"
    case "$(status "click$i"):$(header "click$i" idempotent-replayed)" in
        200:true) replays=$((replays + 1)) ;;
        200:*) charged=$((charged + 1)); CHARGE_ID=$(field "click$i" id) ;;
        409:*) conflicts=$((conflicts + 1)) ;;
        *) fail "click $i: unexpected HTTP $(status "click$i")" ;;
    esac
done
expect "exactly one click ran the charge" "$charged" 1
if [ "$conflicts" -eq 0 ]; then
    fail "no click met the first one in flight (got $replays replays instead): start the server \
with a processing delay, e.g. \`cargo run -p charges-demo -- --processing-delay-ms 2000\`"
fi
say "   ok: $conflicts duplicate(s) got 409 while the first was processed"

say ""
say "-> POST /v1/charges  Idempotency-Key: $KEY  (the retry a 409 asks for)"
charge retry "$KEY" amount=4999 currency=usd description="Concert tickets"
show_brief retry
expect "the retry gets the charge" "$(field retry id)" "$CHARGE_ID"
expect "as a replay" "$(header retry idempotent-replayed)" true

say ""
say "-> GET /v1/charges"
list_charges list
expect "exactly one charge exists" "$(count_charges list)" 1
pass "$CLICKS clicks, one charge ($CHARGE_ID), $conflicts conflict(s)"
