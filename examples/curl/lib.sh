# shellcheck shell=bash
# Shared by the scenario scripts: where the demo is, fresh keys, a curl wrapper, and checks.
# Sourced, not run.

BASE_URL="${BASE_URL:-http://127.0.0.1:3000}"
BASE_URL="${BASE_URL%/}"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Requests to this machine never go through a proxy the environment may name.
CURL=(curl -sS --noproxy "localhost,127.0.0.1,::1")

new_uuid() {
    if command -v uuidgen >/dev/null 2>&1; then
        uuidgen | tr '[:upper:]' '[:lower:]'
    else
        cat /proc/sys/kernel/random/uuid
    fi
}

# Each scenario uses an API key of its own, so an account of its own: its list of charges holds
# exactly what the scenario did.
API_KEY="sk_test_demo_$(new_uuid | tr -d -)"

# A command failing where no check expected it is reported, not a silent exit.
set -E
trap 'fail "unexpected error (exit $?) at ${BASH_SOURCE[0]##*/} line $LINENO: $BASH_COMMAND"' ERR

title() { printf '\n== %s\n' "$*"; }
say() { printf '%s\n' "$*"; }
pass() { printf 'PASS: %s\n' "$*"; exit 0; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

# post PATH TAG IDEMPOTENCY_KEY NAME=VALUE...
# POSTs a form-encoded body to PATH (as Stripe's libraries do). Leaves the response in
# $TMP/TAG.status, $TMP/TAG.headers and $TMP/TAG.body, and curl's exit code in $TMP/TAG.curl. With
# MAX_TIME set, the client gives up after that many seconds (exit code 28, no status).
post() {
    local path=$1 tag=$2 key=$3
    shift 3
    local args=()
    [ -n "${MAX_TIME:-}" ] && args+=(--max-time "$MAX_TIME")
    for field in "$@"; do
        args+=(--data-urlencode "$field")
    done
    local rc=0
    "${CURL[@]}" -o "$TMP/$tag.body" -D "$TMP/$tag.headers" -w '%{http_code}' \
        -u "$API_KEY:" -H "Idempotency-Key: $key" "${args[@]}" \
        "$BASE_URL$path" >"$TMP/$tag.status" 2>"$TMP/$tag.stderr" || rc=$?
    echo "$rc" >"$TMP/$tag.curl"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 28 ]; then
        cat "$TMP/$tag.stderr" >&2
        fail "cannot reach the demo at $BASE_URL (curl exit $rc): start it with \`cargo run -p charges-demo\`"
    fi
}

# charge TAG IDEMPOTENCY_KEY NAME=VALUE...: POST /v1/charges, as `post`.
charge() { post /v1/charges "$@"; }

# refund TAG IDEMPOTENCY_KEY NAME=VALUE...: POST /v1/refunds, as `post`.
refund() { post /v1/refunds "$@"; }

# fetch TAG PATH: GET PATH for this scenario's account.
fetch() {
    local tag=$1 path=$2
    "${CURL[@]}" -o "$TMP/$tag.body" -D "$TMP/$tag.headers" -w '%{http_code}' \
        -u "$API_KEY:" "$BASE_URL$path" >"$TMP/$tag.status" ||
        fail "cannot reach the demo at $BASE_URL"
}

# list_charges TAG: GET /v1/charges?limit=100 for this scenario's account.
list_charges() { fetch "$1" "/v1/charges?limit=100"; }

status() { cat "$TMP/$1.status"; }
timed_out() { [ "$(cat "$TMP/$1.curl")" = 28 ]; }
body() { cat "$TMP/$1.body"; }

# header TAG NAME: the value of a response header (case-insensitive), or nothing.
header() {
    { grep -i "^$2:" "$TMP/$1.headers" || true; } | tail -n 1 | cut -d: -f2- | tr -d '\r' | sed 's/^ *//'
}

# field TAG NAME: the first string, number or boolean member NAME in the JSON body.
field() {
    { grep -o "\"$2\": *\(\"[^\"]*\"\|[0-9-][0-9]*\|true\|false\)" "$TMP/$1.body" || true; } | head -n 1 |
        sed 's/^"[^"]*": *//; s/^"\(.*\)"$/\1/'
}

# count_charges TAG: how many charge objects a list body holds.
count_charges() { count_objects "$1" charge; }

# count_objects TAG OBJECT: how many objects of that kind (`charge`, `refund`) a list body holds.
count_objects() { grep -c "\"object\": *\"$2\"" "$TMP/$1.body" || true; }

# show TAG: the response as a person wants to see it: status, the interesting headers, body.
show() {
    show_brief "$1"
    printf '%s\n' "$(sed 's/^/   /' "$TMP/$1.body")"
}

# show_brief TAG: the status line and interesting headers, and the object's id.
show_brief() {
    local replayed retry_after id
    printf '<- HTTP %s' "$(status "$1")"
    replayed=$(header "$1" idempotent-replayed)
    retry_after=$(header "$1" retry-after)
    if [ -n "$replayed" ]; then printf '  Idempotent-Replayed: %s' "$replayed"; fi
    if [ -n "$retry_after" ]; then printf '  Retry-After: %s' "$retry_after"; fi
    id=$(field "$1" id)
    if [ -n "$id" ]; then printf '  (%s %s)' "$(field "$1" object)" "$id"; fi
    printf '\n'
}

# expect WHAT ACTUAL EXPECTED
expect() {
    if [ "$2" = "$3" ]; then
        say "   ok: $1"
    else
        fail "$1: expected '$3', got '$2'"
    fi
}
