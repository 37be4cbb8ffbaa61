#!/usr/bin/env python3
"""Stripe's own Python library, at its defaults, against the charges demo.

The library is used as a new Stripe integration uses it: `StripeClient` with nothing changed but
the API's address (and, in the first scenario, a short timeout: losing a response is its
point). At its defaults the client sends an `Idempotency-Key` with every POST (one of its own
when the caller gives none) and does not retry; the integration retries a lost response with the
same key. Each scenario prints what it shows and ends in PASS or FAIL; the script exits non-zero
if any failed.

    python3 -m venv .venv && .venv/bin/pip install -r examples/stripe-python/requirements.txt
    cargo run -p charges-demo -- --processing-delay-ms 1000      # in another shell
    .venv/bin/python examples/stripe-python/charges.py [BASE_URL] [--expect-wait]

BASE_URL defaults to http://127.0.0.1:3000. With --expect-wait, a request that meets its key's
first request still running must get that request's answer (a demo that waits for it), never
`idempotency_key_in_use`.
"""

import argparse
import sys
import threading
import time
import uuid

import stripe

# The first scenario's client gives up on a response after this long, as an integration with a
# tight deadline would.
TIMEOUT_SECS = 0.5
# How often the integration sends a request again while its key's first request still runs.
MAX_ATTEMPTS = 30

CHARGE = {"amount": 2000, "currency": "usd", "source": "tok_visa", "metadata": {"order_id": "6735"}}


class Failed(Exception):
    """A scenario's expectation did not hold."""


def client(api_key, timeout=None):
    """A client of Stripe's library at its defaults, but for the address (and a timeout)."""
    options = {"base_addresses": {"api": BASE_URL}}
    if timeout is not None:
        options["http_client"] = stripe.RequestsClient(timeout=timeout)
    return stripe.StripeClient(api_key, **options)


def new_api_key():
    """A fresh test key: an account of its own in the demo."""
    return f"sk_test_py_{uuid.uuid4().hex}"


def headers_of(obj_or_error):
    headers = getattr(obj_or_error, "headers", None)
    return headers if headers is not None else obj_or_error.last_response.headers


def replayed(obj_or_error):
    """Whether a response (or an error's response) was a replay of a stored one."""
    return headers_of(obj_or_error).get("Idempotent-Replayed") == "true"


def stripe_type(error):
    """The `type` of the Stripe error object the library read, if it read one."""
    return error.error.type if error.error else None


def stripe_code(error):
    return error.error.code if error.error else None


def describe(error):
    code = f" {stripe_code(error)}" if stripe_code(error) else ""
    return f"{type(error).__name__} {error.http_status} {stripe_type(error)}{code}"


def key_in_use(error):
    return isinstance(error, stripe.StripeError) and stripe_code(error) == "idempotency_key_in_use"


def expect(what, got, wanted):
    if got != wanted:
        raise Failed(f"{what}: expected {wanted!r}, got {got!r}")
    print(f"   ok: {what}")


def expect_typed(error, status, error_type, should_retry):
    """A refusal the library raised as a Stripe error: the status, the `type` of the error
    object it read (never "Invalid response object"), `Stripe-Should-Retry` and a request id."""
    expect(f"a Stripe error object of type {error_type}", stripe_type(error), error_type)
    expect(f"HTTP {status}", error.http_status, status)
    expect(f"Stripe-Should-Retry: {should_retry}",
           error.headers.get("Stripe-Should-Retry"), should_retry)
    expect("a request id", (error.request_id or "").startswith("req_"), True)


def charges_of(c):
    return list(c.v1.charges.list(params={"limit": 100}).auto_paging_iter())


def create_as_an_integration_retries(c, params, key):
    """Sends the request again with the same key while its first attempt still runs (the
    library, at its defaults, does not): the answer is then the first attempt's."""
    for _ in range(MAX_ATTEMPTS):
        try:
            return c.v1.charges.create(params=params, options={"idempotency_key": key})
        except stripe.StripeError as error:
            if not key_in_use(error):
                raise
            if EXPECT_WAIT:
                raise Failed(f"the demo was to wait for the first attempt: {describe(error)}")
            wait = float(error.headers.get("Retry-After", "1"))
            print(f"<- {describe(error)}, Stripe-Should-Retry: "
                  f"{error.headers.get('Stripe-Should-Retry')}: the first attempt still runs; "
                  f"again in {wait:g} s")
            time.sleep(wait)
    raise Failed(f"the key was still in use after {MAX_ATTEMPTS} attempts")


def retry_after_lost_response():
    """A payment whose response is lost: retried with the same key, it is charged once."""
    api_key = new_api_key()
    key = str(uuid.uuid4())
    print(f"-> charges.create(amount=2000), idempotency_key={key}, timeout {TIMEOUT_SECS} s")
    try:
        first = client(api_key, TIMEOUT_SECS).v1.charges.create(
            params=CHARGE, options={"idempotency_key": key})
        print(f"<- answered in time, {first.id} (start the demo with a processing delay to lose "
              "the response)")
    except stripe.APIConnectionError as error:
        print(f"<- {type(error).__name__}: the first response was lost; the library, at its "
              "defaults, does not retry")
    print("-> the same call with the same key, as the integration retries")
    c = client(api_key)
    charge = create_as_an_integration_retries(c, CHARGE, key)
    print(f"<- {charge.id}: {charge.status} (replayed: {replayed(charge)}, "
          f"Original-Request: {charge.last_response.headers.get('Original-Request')})")
    expect("marked Idempotent-Replayed", replayed(charge), True)
    again = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    expect("a retry gets the same charge", again.id, charge.id)
    expect("one charge on the account", [ch.id for ch in charges_of(c)], [charge.id])
    return f"retried, charged once ({charge.id})"


def double_click():
    """Two requests with one key at once: one charge; each click gets it, or the key in use."""
    api_key = new_api_key()
    key = str(uuid.uuid4())
    start = threading.Barrier(2)
    results = [None, None]

    def click(i):
        c = client(api_key)
        start.wait()
        try:
            results[i] = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
        except Exception as error:  # judged below, with the scenario's name
            results[i] = error

    print(f"-> two charges.create with idempotency_key={key} at once")
    threads = [threading.Thread(target=click, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    charges = [r for r in results if not isinstance(r, Exception)]
    for result in results:
        if isinstance(result, Exception):
            print(f"<- {describe(result) if isinstance(result, stripe.StripeError) else repr(result)}")
            if not key_in_use(result):
                raise Failed(f"a click failed otherwise than with the key in use: {result!r}")
            if EXPECT_WAIT:
                raise Failed("the demo was to wait for the first click, not refuse the second")
            expect_typed(result, 409, "invalid_request_error", "true")
        else:
            print(f"<- {result.id} (replayed: {replayed(result)})")
            if not result.id:
                raise Failed(f"a charge without an id: {result!r}")
    expect("one click ran the charge", [replayed(ch) for ch in charges].count(False), 1)
    expect("every click that got a charge got the same", len({ch.id for ch in charges}), 1)
    if len(charges) < 2:
        # The refused click's retry, now that the first has finished: the same charge.
        retry = client(api_key).v1.charges.create(params=CHARGE, options={"idempotency_key": key})
        expect("the refused click's retry gets the same charge", retry.id, charges[0].id)
    expect("one charge on the account", len(charges_of(client(api_key))), 1)
    return f"two clicks, charged once ({charges[0].id})"


def expect_reused_key(error):
    """A key reused for another request: `422`, which the library raises as `APIError` (it
    picks the class by status; only a `400` becomes `IdempotencyError`), carrying Stripe's
    `idempotency_error` in `json_body["error"]`."""
    print(f"<- {describe(error)}: {error.user_message}")
    expect("the library's APIError", type(error), stripe.APIError)
    expect('json_body["error"]["type"]', error.json_body["error"]["type"], "idempotency_error")
    expect_typed(error, 422, "idempotency_error", "false")


def changed_amount():
    """A key reused for another payment is refused, and the first charge stays as it was."""
    c = client(new_api_key())
    key = str(uuid.uuid4())
    first = c.v1.charges.create(params=CHARGE, options={"idempotency_key": key})
    print(f"-> {first.id} for 2000; now the same key with amount=2500")
    try:
        c.v1.charges.create(params={**CHARGE, "amount": 2500}, options={"idempotency_key": key})
    except stripe.StripeError as error:
        expect_reused_key(error)
    else:
        raise Failed("the second payment was accepted")
    print(f"-> refunds.create(charge={first.id}) with the charge's key")
    try:
        c.v1.refunds.create(params={"charge": first.id}, options={"idempotency_key": key})
    except stripe.StripeError as error:
        expect_reused_key(error)
    else:
        raise Failed("the charge's key was accepted for a refund")
    charges = charges_of(c)
    expect("one charge on the account", [(ch.id, ch.amount) for ch in charges], [(first.id, 2000)])
    expect("nothing refunded", c.v1.refunds.list().data, [])
    return "the changed amount and the charge's key on a refund were refused, nothing run"


def declined_card():
    """A declined card is a final answer: the retry gets the same decline, not a second try."""
    c = client(new_api_key())
    key = str(uuid.uuid4())
    params = {**CHARGE, "source": "tok_chargeDeclined"}
    errors = []
    for attempt in ("first attempt", "retry"):
        try:
            c.v1.charges.create(params=params, options={"idempotency_key": key})
        except stripe.CardError as error:
            print(f"<- {attempt}: CardError {error.code}, charge {error.error.charge}"
                  f" (replayed: {replayed(error)}, Request-Id: {error.request_id})")
            errors.append(error)
        else:
            raise Failed(f"the {attempt} was not declined")
    first, retry = errors
    expect("declined as card_declined", first.code, "card_declined")
    expect("the first attempt ran", replayed(first), False)
    expect("the retry is the same decline", retry.error.charge, first.error.charge)
    expect("the retry was a replay", replayed(retry), True)
    expect("the replay names the first request in Original-Request",
           retry.headers.get("Original-Request"), first.request_id)
    charges = charges_of(c)
    expect("one failed charge on the account", [ch.status for ch in charges], ["failed"])
    return "declined once, the decline replayed"


def invalid_then_corrected():
    """An invalid request releases its key, so the corrected request runs under the same key."""
    c = client(new_api_key())
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


def malformed_key():
    """A key longer than 255 characters is refused before anything runs."""
    c = client(new_api_key())
    try:
        c.v1.charges.create(params=CHARGE, options={"idempotency_key": "k" * 300})
    except stripe.InvalidRequestError as error:
        print(f"<- {describe(error)}: {error.user_message}")
        expect_typed(error, 400, "invalid_request_error", "false")
    else:
        raise Failed("a 300-character key was accepted")
    expect("nothing charged", charges_of(c), [])
    return "refused with InvalidRequestError, nothing charged"


def keys_of_its_own_and_paging():
    """Without an idempotency_key the library sends one of its own; retrieve and list paginate."""
    c = client(new_api_key())
    made = [c.v1.charges.create(params={**CHARGE, "amount": 100 + i}) for i in range(3)]
    print(f"<- three charges, keys chosen by the library: {', '.join(ch.id for ch in made)}")
    response = made[0].last_response
    expect("its key echoed", bool(response.idempotency_key), True)
    expect("a request id", (response.request_id or "").startswith("req_"), True)
    expect("retrieved by id", c.v1.charges.retrieve(made[1].id).amount, 101)
    page = c.v1.charges.list(params={"limit": 2})
    expect("a page of two, more to come", (len(page.data), page.has_more), (2, True))
    expect("all three, newest first, across pages",
           [ch.id for ch in page.auto_paging_iter()], [ch.id for ch in reversed(made)])
    return "keys of its own, retrieve and paging work"


def refund_retried():
    """A refund retried with its key refunds once; more than is left is amount_too_large."""
    c = client(new_api_key())
    charge = c.v1.charges.create(params=CHARGE)
    key = str(uuid.uuid4())
    params = {"charge": charge.id, "amount": 500}
    print(f"-> refunds.create(charge={charge.id}, amount=500), idempotency_key={key}")
    refund = c.v1.refunds.create(params=params, options={"idempotency_key": key})
    print(f"<- {refund.id}: {refund.status}, {refund.amount} of {refund.charge}")
    expect("a refund of 500 of the charge", (refund.object, refund.amount, refund.charge),
           ("refund", 500, charge.id))
    retry = c.v1.refunds.create(params=params, options={"idempotency_key": key})
    expect("the retry gets the same refund", retry.id, refund.id)
    expect("marked Idempotent-Replayed", replayed(retry), True)
    try:
        c.v1.refunds.create(params={"charge": charge.id, "amount": 2000},
                            options={"idempotency_key": str(uuid.uuid4())})
    except stripe.InvalidRequestError as error:
        print(f"<- {describe(error)} on {error.param}: {error.user_message}")
        expect("HTTP 400", error.http_status, 400)
        expect("Stripe's amount_too_large", error.code, "amount_too_large")
        expect("on the amount", error.param, "amount")
    else:
        raise Failed("a refund of more than is left was accepted")
    after = c.v1.charges.retrieve(charge.id)
    expect("500 refunded, not in full", (after.amount_refunded, after.refunded), (500, False))
    expect("one refund on the account", [r.id for r in c.v1.refunds.list().data], [refund.id])
    return f"refunded once ({refund.id}), the over-refund refused"


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
    malformed_key,
    keys_of_its_own_and_paging,
    refund_retried,
    bad_api_key,
]


def main():
    mode = " (expecting the demo to wait for a key's first request)" if EXPECT_WAIT else ""
    print(f"stripe-python {stripe.VERSION} against {BASE_URL}{mode}")
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url", nargs="?", default="http://127.0.0.1:3000")
    parser.add_argument("--expect-wait", action="store_true",
                        help="a key's second request must get the first one's answer")
    arguments = parser.parse_args()
    BASE_URL = arguments.base_url.rstrip("/")
    EXPECT_WAIT = arguments.expect_wait
    main()
