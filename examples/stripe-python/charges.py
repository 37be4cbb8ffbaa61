#!/usr/bin/env python3
"""Stripe's own Python library against the charges demo: its retries meet the idempotency layer.

The library is used as a Stripe integration uses it, with nothing changed but the API's address:
it sends an `Idempotency-Key` with every POST (one of its own when the caller gives none), gives
up on a slow response after its timeout and retries with the same key, and retries a `409` by
itself. Each scenario prints what it shows and ends in PASS or FAIL; the script exits non-zero if
any failed.

    python3 -m venv .venv && .venv/bin/pip install -r examples/stripe-python/requirements.txt
    cargo run -p charges-demo -- --processing-delay-ms 1000      # in another shell
    .venv/bin/python examples/stripe-python/charges.py [BASE_URL]  # default http://127.0.0.1:3000

A processing delay longer than the client's timeout (half a second here) makes the first scenario
lose its first response for real, and the double click overlap; the scenarios pass without one.
"""

import sys
import threading
import uuid

import stripe

BASE_URL = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:3000").rstrip("/")
# The first scenario's client gives up on a response after this long, as an integration with a
# tight deadline would; the others wait for their answers.
TIMEOUT_SECS = 0.5
# Enough for the library's backoff (0.5 s, 1 s, 2 s, then 5 s at most) to outlast any delay the
# demo is likely to be given.
RETRIES = 10


class Failed(Exception):
    """A scenario's expectation did not hold."""


def client(api_key=None, timeout=30.0):
    """A client of Stripe's library for a fresh test account (an API key of its own)."""
    api_key = api_key or f"sk_test_py_{uuid.uuid4().hex}"
    return stripe.StripeClient(
        api_key,
        base_addresses={"api": BASE_URL},
        max_network_retries=RETRIES,
        http_client=stripe.RequestsClient(timeout=timeout),
    )


def replayed(obj_or_error):
    """Whether a response (or an error's response) was a replay of a stored one."""
    headers = getattr(obj_or_error, "headers", None)
    if headers is None:
        headers = obj_or_error.last_response.headers
    return headers.get("Idempotent-Replayed") == "true"


def expect(what, got, wanted):
    if got != wanted:
        raise Failed(f"{what}: expected {wanted!r}, got {got!r}")
    print(f"   ok: {what}")


def charges_of(c):
    return list(c.v1.charges.list(params={"limit": 100}).auto_paging_iter())


CHARGE = {"amount": 2000, "currency": "usd", "source": "tok_visa", "metadata": {"order_id": "6735"}}


def retry_after_lost_response():
    """A payment whose response is lost: the library retries with the same key, charged once."""
    c = client(timeout=TIMEOUT_SECS)
    key = str(uuid.uuid4())
    print(f"-> charges.create(amount=2000), idempotency_key={key}, timeout {TIMEOUT_SECS} s")
    first = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    if replayed(first):
        print("<- the library timed out, retried with the same key and got the stored charge back")
    else:
        print("<- answered in time (start the demo with a processing delay to lose the response)")
    print(f"   {first.id}: {first.status}")
    print("-> the same call again, as an integration retrying after a crash would")
    again = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    expect("the same charge", again.id, first.id)
    expect("marked Idempotent-Replayed", replayed(again), True)
    expect("one charge on the account", [ch.id for ch in charges_of(c)], [first.id])
    return f"retried, charged once ({first.id})"


def double_click():
    """Two requests with one key at once: one charge, and both callers get it."""
    api_key = f"sk_test_py_{uuid.uuid4().hex}"
    key = str(uuid.uuid4())
    start = threading.Barrier(2)
    results = [None, None]

    def click(i):
        c = client(api_key)
        start.wait()
        try:
            results[i] = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
        except Exception as error:  # reported below, with the scenario's name
            results[i] = error

    print(f"-> two charges.create with idempotency_key={key} at once")
    threads = [threading.Thread(target=click, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, Exception):
            raise Failed(f"a click failed: {result!r}")
    print(f"<- {results[0].id} (replayed: {replayed(results[0])}), "
          f"{results[1].id} (replayed: {replayed(results[1])})")
    expect("both got the same charge", results[0].id, results[1].id)
    expect("one ran, the other was a replay", sorted(map(replayed, results)), [False, True])
    expect("one charge on the account", len(charges_of(client(api_key))), 1)
    return f"two clicks, charged once ({results[0].id})"


def changed_amount():
    """A key reused for another payment is refused, and the first charge stays as it was."""
    c = client()
    key = str(uuid.uuid4())
    first = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    print(f"-> {first.id} for 2000; now the same key with amount=2500")
    try:
        c.v1.charges.create(params={**CHARGE, "amount": 2500}, options={"idempotency_key": key})
    except stripe.APIError as error:
        # The layer answers with an RFC 9457 problem document, not a Stripe error object, so
        # the library raises its generic APIError with the document as the body.
        print(f"<- {type(error).__name__} {error.http_status}: {error.json_body['title']}")
        expect("HTTP 422", error.http_status, 422)
        expect("a problem document", error.json_body["status"], 422)
    else:
        raise Failed("the second payment was accepted")
    charges = charges_of(c)
    expect("one charge on the account", [(ch.id, ch.amount) for ch in charges], [(first.id, 2000)])
    return "the changed amount was refused (422), nothing charged"


def declined_card():
    """A declined card is a final answer: the retry gets the same decline, not a second try."""
    c = client()
    key = str(uuid.uuid4())
    params = {**CHARGE, "source": "tok_chargeDeclined"}
    errors = []
    for attempt in ("first attempt", "retry"):
        try:
            c.v1.charges.create(params=params, options={"idempotency_key": key})
        except stripe.CardError as error:
            print(f"<- {attempt}: CardError {error.code}, charge {error.json_body['error']['charge']}"
                  f" (replayed: {replayed(error)})")
            errors.append(error)
        else:
            raise Failed(f"the {attempt} was not declined")
    first, retry = errors
    expect("declined as card_declined", first.code, "card_declined")
    expect("the first attempt ran", replayed(first), False)
    expect("the retry is the same decline",
           retry.json_body["error"]["charge"], first.json_body["error"]["charge"])
    expect("the retry was a replay", replayed(retry), True)
    charges = charges_of(c)
    expect("one failed charge on the account", [ch.status for ch in charges], ["failed"])
    return "declined once, the decline replayed"


def invalid_then_corrected():
    """An invalid request releases its key, so the corrected request runs under the same key."""
    c = client()
    key = str(uuid.uuid4())
    try:
        c.v1.charges.create(params={"amount": 2000}, options={"idempotency_key": key})
    except stripe.InvalidRequestError as error:
        print(f"<- InvalidRequestError on {error.param}: {error.user_message}")
        expect("the missing parameter named", error.param, "currency")
    else:
        raise Failed("a charge without a currency was accepted")
    # Had the 400 been stored, this would replay it and raise InvalidRequestError again.
    fixed = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    print(f"<- corrected, same key: {fixed.id}")
    expect("the corrected request ran (no replay)", replayed(fixed), False)
    expect("one charge on the account", [ch.id for ch in charges_of(c)], [fixed.id])
    return "the invalid request was not kept; the corrected one charged"


def keys_of_its_own_and_paging():
    """Without an idempotency_key the library sends one of its own; retrieve and list paginate."""
    c = client()
    made = [c.v1.charges.create(params={**CHARGE, "amount": 100 + i}) for i in range(3)]
    print(f"<- three charges, keys chosen by the library: {', '.join(ch.id for ch in made)}")
    expect("retrieved by id", c.v1.charges.retrieve(made[1].id).amount, 101)
    page = c.v1.charges.list(params={"limit": 2})
    expect("a page of two, more to come", (len(page.data), page.has_more), (2, True))
    expect("all three, newest first, across pages",
           [ch.id for ch in page.auto_paging_iter()], [ch.id for ch in reversed(made)])
    return "keys of its own, retrieve and paging work"


def bad_api_key():
    """A malformed API key is a Stripe authentication error."""
    try:
        client("pk_live_not_a_secret_key").v1.charges.create(params=CHARGE)
    except stripe.AuthenticationError as error:
        print(f"<- AuthenticationError {error.http_status}: {error.user_message}")
        expect("HTTP 401", error.http_status, 401)
    else:
        raise Failed("a publishable key was accepted")
    return "refused with AuthenticationError"


SCENARIOS = [
    retry_after_lost_response,
    double_click,
    changed_amount,
    declined_card,
    invalid_then_corrected,
    keys_of_its_own_and_paging,
    bad_api_key,
]


def main():
    print(f"stripe-python {stripe.VERSION} against {BASE_URL}")
    failed = []
    for scenario in SCENARIOS:
        print(f"\n== {scenario.__doc__.splitlines()[0]}")
        try:
            print(f"PASS: {scenario()}")
        except (Failed, stripe.StripeError) as error:
            print(f"FAIL: {scenario.__name__}: {error!r}", file=sys.stderr)
            failed.append(scenario.__name__)
    print()
    if failed:
        print(f"{len(failed)} of {len(SCENARIOS)} scenarios failed against {BASE_URL}: "
              f"{' '.join(failed)}", file=sys.stderr)
        sys.exit(1)
    print(f"all {len(SCENARIOS)} scenarios passed against {BASE_URL}")


if __name__ == "__main__":
    main()
