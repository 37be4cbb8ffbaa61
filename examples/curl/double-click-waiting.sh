#!/usr/bin/env bash
# A double click against a demo that waits for a charge in flight: the same payment sent three
# times at once with one Idempotency-Key. One request charges; the duplicates wait for it and
# get its charge back, marked Idempotent-Replayed, instead of `409`; exactly one charge exists.
#
# Needs the server started with a processing delay and an in-flight wait longer than it:
#     cargo run -p charges-demo -- --processing-delay-ms 2000 --in-flight-wait-ms 5000
set -euo pipefail
source "$(dirname "$0")/lib.sh"

CLICKS=3
title "Double click, the server waiting: $CLICKS identical payments at once"
KEY=$(new_uuid)
say "-> $CLICKS x POST /v1/charges  Idempotency-Key: $KEY  amount=4999 currency=usd  (concurrently)"
for i in $(seq 1 "$CLICKS"); do
    charge "click$i" "$KEY" amount=4999 currency=usd description="Concert tickets" &
done
wait

charged=0 replays=0 ids=()
for i in $(seq 1 "$CLICKS"); do
    printf '   click %s ' "$i"
    show_brief "click$i"
    case "$(status "click$i"):$(header "click$i" idempotent-replayed)" in
        200:true) replays=$((replays + 1)) ;;
        200:*) charged=$((charged + 1)) ;;
        409:*) fail "click $i got 409: start the server with \`--in-flight-wait-ms 5000\`" ;;
        *) fail "click $i: unexpected HTTP $(status "click$i")" ;;
    esac
    ids+=("$(field "click$i" id)")
done
expect "exactly one click ran the charge" "$charged" 1
expect "the others waited and got it replayed" "$replays" $((CLICKS - 1))
for id in "${ids[@]}"; do
    expect "every click got the same charge" "$id" "${ids[0]}"
done

say ""
say "-> GET /v1/charges"
list_charges list
expect "exactly one charge exists" "$(count_charges list)" 1
pass "$CLICKS clicks, one charge (${ids[0]}), no 409"
