#!/usr/bin/env node
// Stripe's own Node.js library, at its defaults, against the charges demo.
//
// The library is used as a new Stripe integration uses it: `new Stripe(key)` with nothing
// changed but the API's address (and, in the first scenario, a short timeout: losing a response
// is its point). At its defaults it sends an `Idempotency-Key` with every POST (one of its own
// when the caller gives none) and retries twice, with the same key, a lost response, a `409`,
// a `5xx` and whatever `Stripe-Should-Retry: true` marks. Each scenario prints what it shows and
// ends in PASS or FAIL; the script exits non-zero if any failed.
//
//     (cd examples/stripe-node && npm ci)
//     cargo run -p charges-demo -- --processing-delay-ms 1000      # in another shell
//     node examples/stripe-node/charges.mjs [BASE_URL] [--expect-wait]
//
// BASE_URL defaults to http://127.0.0.1:3000. With --expect-wait, a request that meets its key's
// first request still running must get that request's answer (a demo that waits for it), never
// `idempotency_key_in_use`.

import { randomUUID } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';

import Stripe from 'stripe';

const args = process.argv.slice(2);
const EXPECT_WAIT = args.includes('--expect-wait');
const BASE_URL = (args.find((a) => !a.startsWith('--')) ?? 'http://127.0.0.1:3000').replace(/\/+$/, '');
// The first scenario's client gives up on a response after this long, as an integration with a
// tight deadline would.
const TIMEOUT_MS = 500;
// How often the integration sends a request again while its key's first request still runs.
const MAX_ATTEMPTS = 30;

const CHARGE = { amount: 2000, currency: 'usd', source: 'tok_visa', metadata: { order_id: '6735' } };

class Failed extends Error {}

/** A client of Stripe's library at its defaults, but for the address (and a timeout). */
function client(apiKey, timeout) {
  const url = new URL(BASE_URL);
  const options = { host: url.hostname, port: url.port, protocol: url.protocol.replace(':', '') };
  if (timeout !== undefined) options.timeout = timeout;
  return new Stripe(apiKey, options);
}

/** A fresh test key: an account of its own in the demo. */
const newApiKey = () => `sk_test_node_${randomUUID().replaceAll('-', '')}`;

const headersOf = (chargeOrError) => chargeOrError.headers ?? chargeOrError.lastResponse.headers;
/** Whether a response (or an error's response) was a replay of a stored one. */
const replayed = (chargeOrError) => headersOf(chargeOrError)['idempotent-replayed'] === 'true';
const keyInUse = (error) =>
  error instanceof Stripe.errors.StripeError && error.code === 'idempotency_key_in_use';
const describe = (error) =>
  error instanceof Stripe.errors.StripeError
    ? `${error.type} ${error.statusCode} ${error.rawType}${error.code ? ` ${error.code}` : ''}`
    : String(error);

function expect(what, got, wanted) {
  if (JSON.stringify(got) !== JSON.stringify(wanted)) {
    throw new Failed(`${what}: expected ${JSON.stringify(wanted)}, got ${JSON.stringify(got)}`);
  }
  console.log(`   ok: ${what}`);
}

/** A refusal the library raised as a Stripe error (never a "charge" without an id): the class
 * it picked, the status, the `type` of the error object it read, `Stripe-Should-Retry` and a
 * request id. */
function expectTyped(error, className, status, errorType, shouldRetry) {
  expect(`a ${className}`, error.type, className);
  expect(`a Stripe error object of type ${errorType}`, error.rawType, errorType);
  expect(`HTTP ${status}`, error.statusCode, status);
  expect(`Stripe-Should-Retry: ${shouldRetry}`, error.headers['stripe-should-retry'], shouldRetry);
  expect('a request id', (error.requestId ?? '').startsWith('req_'), true);
}

async function chargesOf(stripe) {
  const charges = [];
  for await (const charge of stripe.charges.list({ limit: 100 })) charges.push(charge);
  return charges;
}

function expectCharge(charge) {
  if (typeof charge?.id !== 'string' || !charge.id.startsWith('ch_')) {
    throw new Failed(`a "charge" without an id: ${JSON.stringify(charge)}`);
  }
  return charge;
}

/** Sends the request again with the same key, once the library's own retries are spent, while
 * its response is lost or its first attempt still runs: the answer is then the first attempt's. */
async function createAsAnIntegrationRetries(stripe, params, key) {
  for (let attempt = 0; attempt < MAX_ATTEMPTS; attempt++) {
    try {
      return expectCharge(await stripe.charges.create(params, { idempotencyKey: key }));
    } catch (error) {
      if (error instanceof Stripe.errors.StripeConnectionError) {
        console.log(`<- ${error.type}: ${error.message}; again`);
        continue;
      }
      if (!keyInUse(error)) throw error;
      if (EXPECT_WAIT) throw new Failed(`the demo was to wait for the first attempt: ${describe(error)}`);
      const wait = Number(error.headers['retry-after'] ?? 1);
      console.log(`<- ${describe(error)}, the library's retries spent: the first attempt still runs; again in ${wait} s`);
      await sleep(wait * 1000);
    }
  }
  throw new Failed(`the key was still in use after ${MAX_ATTEMPTS} attempts`);
}

async function retryAfterLostResponse() {
  const apiKey = newApiKey();
  const key = randomUUID();
  console.log(`-> charges.create(amount=2000), idempotencyKey=${key}, timeout ${TIMEOUT_MS} ms`);
  const charge = await createAsAnIntegrationRetries(client(apiKey, TIMEOUT_MS), CHARGE, key);
  if (replayed(charge)) {
    console.log('<- the first response was lost: the library timed out, retried with the same key and got the stored charge back');
  } else {
    console.log('<- answered in time (start the demo with a processing delay to lose the response)');
  }
  console.log(`   ${charge.id}: ${charge.status} (Original-Request: ${charge.lastResponse.headers['original-request']})`);
  const stripe = client(apiKey);
  console.log('-> the same call again, as an integration retrying after a crash would');
  const again = await stripe.charges.create(CHARGE, { idempotencyKey: key });
  expect('the same charge', again.id, charge.id);
  expect('marked Idempotent-Replayed', replayed(again), true);
  expect('its key echoed', again.lastResponse.idempotencyKey, key);
  expect('one charge on the account', (await chargesOf(stripe)).map((c) => c.id), [charge.id]);
  return `retried, charged once (${charge.id})`;
}

async function doubleClick() {
  const apiKey = newApiKey();
  const key = randomUUID();
  console.log(`-> two charges.create with idempotencyKey=${key} at once`);
  // The library retries a 409 by itself, out of sight but for its `request` events.
  let sent = 0;
  const clicks = [0, 1].map(() => {
    const stripe = client(apiKey);
    stripe.on('request', () => sent++);
    return stripe.charges.create(CHARGE, { idempotencyKey: key });
  });
  const results = await Promise.allSettled(clicks);
  console.log(`<- the library sent ${sent} requests for the two clicks`);
  if (EXPECT_WAIT) expect('no click retried: the demo waited for the first', sent, 2);
  const charges = [];
  for (const result of results) {
    if (result.status === 'rejected') {
      const error = result.reason;
      console.log(`<- ${describe(error)}, after the library's retries`);
      if (!keyInUse(error)) throw new Failed(`a click failed otherwise than with the key in use: ${describe(error)}`);
      if (EXPECT_WAIT) throw new Failed('the demo was to wait for the first click, not refuse the second');
      expectTyped(error, 'StripeAPIError', 409, 'invalid_request_error', 'true');
    } else {
      charges.push(expectCharge(result.value));
      console.log(`<- ${result.value.id} (replayed: ${replayed(result.value)})`);
    }
  }
  expect('one click ran the charge', charges.filter((c) => !replayed(c)).length, 1);
  expect('every click that got a charge got the same', new Set(charges.map((c) => c.id)).size, 1);
  if (charges.length < 2) {
    // The refused click's retry, now that the first has finished: the same charge.
    const retry = await client(apiKey).charges.create(CHARGE, { idempotencyKey: key });
    expect("the refused click's retry gets the same charge", retry.id, charges[0].id);
  }
  expect('one charge on the account', (await chargesOf(client(apiKey))).length, 1);
  return `two clicks, charged once (${charges[0].id})`;
}

/** Sends `request` with a key already used for another request: refused with `422`, which the
 * library raises as `StripeAPIError` (it picks the class by status for v1 paths; only a `400`
 * becomes `StripeIdempotencyError`) carrying Stripe's `idempotency_error`, and sends once. */
async function expectReusedKeyRefused(stripe, what, request) {
  let sent = 0;
  const count = () => sent++;
  stripe.on('request', count);
  try {
    await request();
    throw new Failed(`${what} was accepted`);
  } catch (error) {
    if (error instanceof Failed) throw error;
    console.log(`<- ${describe(error)}: ${error.message}`);
    expectTyped(error, 'StripeAPIError', 422, 'idempotency_error', 'false');
    expect('an instance of Stripe.errors.StripeAPIError', error instanceof Stripe.errors.StripeAPIError, true);
  } finally {
    stripe.off('request', count);
  }
  expect('sent once: the library did not retry it', sent, 1);
}

async function changedAmount() {
  const stripe = client(newApiKey());
  const key = randomUUID();
  const first = await stripe.charges.create(CHARGE, { idempotencyKey: key });
  console.log(`-> ${first.id} for 2000; now the same key with amount=2500`);
  await expectReusedKeyRefused(stripe, 'the second payment', () =>
    stripe.charges.create({ ...CHARGE, amount: 2500 }, { idempotencyKey: key }));
  console.log(`-> refunds.create(charge=${first.id}) with the charge's key`);
  await expectReusedKeyRefused(stripe, "the charge's key on a refund", () =>
    stripe.refunds.create({ charge: first.id }, { idempotencyKey: key }));
  const charges = await chargesOf(stripe);
  expect('one charge on the account', charges.map((c) => [c.id, c.amount]), [[first.id, 2000]]);
  expect('nothing refunded', (await stripe.refunds.list()).data, []);
  return "the changed amount and the charge's key on a refund were refused, nothing run";
}

async function declinedCard() {
  const stripe = client(newApiKey());
  const key = randomUUID();
  const params = { ...CHARGE, source: 'tok_chargeDeclined' };
  const errors = [];
  for (const attempt of ['first attempt', 'retry']) {
    try {
      await stripe.charges.create(params, { idempotencyKey: key });
      throw new Failed(`the ${attempt} was not declined`);
    } catch (error) {
      if (!(error instanceof Stripe.errors.StripeCardError)) throw error;
      console.log(`<- ${attempt}: ${error.type} ${error.code}, charge ${error.charge} (replayed: ${replayed(error)}, Request-Id: ${error.requestId})`);
      errors.push(error);
    }
  }
  const [first, retry] = errors;
  expect('declined as card_declined', first.code, 'card_declined');
  expect('the first attempt ran', replayed(first), false);
  expect('the retry is the same decline', retry.charge, first.charge);
  expect('the retry was a replay', replayed(retry), true);
  expect('the replay names the first request in Original-Request', retry.headers['original-request'], first.requestId);
  expect('one failed charge on the account', (await chargesOf(stripe)).map((c) => c.status), ['failed']);
  return 'declined once, the decline replayed';
}

async function invalidThenCorrected() {
  const stripe = client(newApiKey());
  const key = randomUUID();
  try {
    await stripe.charges.create({ amount: 2000 }, { idempotencyKey: key });
    throw new Failed('a charge without a currency was accepted');
  } catch (error) {
    if (!(error instanceof Stripe.errors.StripeInvalidRequestError)) throw error;
    console.log(`<- ${error.type} on ${error.param}: ${error.message}`);
    expect('the missing parameter named', error.param, 'currency');
  }
  // Had the 400 been stored, this would replay it and throw StripeInvalidRequestError again.
  const fixed = await stripe.charges.create(CHARGE, { idempotencyKey: key });
  console.log(`<- corrected, same key: ${fixed.id}`);
  expect('the corrected request ran (no replay)', replayed(fixed), false);
  expect('one charge on the account', (await chargesOf(stripe)).map((c) => c.id), [fixed.id]);
  return 'the invalid request was not kept; the corrected one charged';
}

async function malformedKey() {
  const stripe = client(newApiKey());
  try {
    await stripe.charges.create(CHARGE, { idempotencyKey: 'k'.repeat(300) });
    throw new Failed('a 300-character key was accepted');
  } catch (error) {
    if (error instanceof Failed) throw error;
    console.log(`<- ${describe(error)}: ${error.message}`);
    expectTyped(error, 'StripeInvalidRequestError', 400, 'invalid_request_error', 'false');
  }
  expect('nothing charged', await chargesOf(stripe), []);
  return 'refused with StripeInvalidRequestError, nothing charged';
}

async function keysOfItsOwnAndPaging() {
  const stripe = client(newApiKey());
  const made = [];
  for (let i = 0; i < 3; i++) made.push(await stripe.charges.create({ ...CHARGE, amount: 100 + i }));
  console.log(`<- three charges, keys chosen by the library: ${made.map((c) => c.id).join(', ')}`);
  const response = made[0].lastResponse;
  expect("the library's key echoed", response.idempotencyKey?.startsWith('stripe-node-retry-'), true);
  expect('a request id', response.requestId?.startsWith('req_'), true);
  expect('retrieved by id', (await stripe.charges.retrieve(made[1].id)).amount, 101);
  const page = await stripe.charges.list({ limit: 2 });
  expect('a page of two, more to come', [page.data.length, page.has_more], [2, true]);
  const all = [];
  for await (const charge of stripe.charges.list({ limit: 2 })) all.push(charge.id);
  expect('all three, newest first, across pages', all, made.map((c) => c.id).reverse());
  return 'keys of its own, retrieve and paging work';
}

async function refundRetried() {
  const stripe = client(newApiKey());
  const charge = expectCharge(await stripe.charges.create(CHARGE));
  const key = randomUUID();
  const params = { charge: charge.id, amount: 500 };
  console.log(`-> refunds.create(charge=${charge.id}, amount=500), idempotencyKey=${key}`);
  const refund = await stripe.refunds.create(params, { idempotencyKey: key });
  console.log(`<- ${refund.id}: ${refund.status}, ${refund.amount} of ${refund.charge}`);
  expect('a refund of 500 of the charge', [refund.object, refund.amount, refund.charge], ['refund', 500, charge.id]);
  const retry = await stripe.refunds.create(params, { idempotencyKey: key });
  expect('the retry gets the same refund', retry.id, refund.id);
  expect('marked Idempotent-Replayed', replayed(retry), true);
  try {
    await stripe.refunds.create({ charge: charge.id, amount: 2000 }, { idempotencyKey: randomUUID() });
    throw new Failed('a refund of more than is left was accepted');
  } catch (error) {
    if (!(error instanceof Stripe.errors.StripeInvalidRequestError)) throw error;
    console.log(`<- ${describe(error)} on ${error.param}: ${error.message}`);
    expect('HTTP 400', error.statusCode, 400);
    expect("Stripe's amount_too_large", error.code, 'amount_too_large');
    expect('on the amount', error.param, 'amount');
  }
  const after = await stripe.charges.retrieve(charge.id);
  expect('500 refunded, not in full', [after.amount_refunded, after.refunded], [500, false]);
  expect('one refund on the account', (await stripe.refunds.list()).data.map((r) => r.id), [refund.id]);
  return `refunded once (${refund.id}), the over-refund refused`;
}

async function badApiKey() {
  try {
    await client('pk_live_not_a_secret_key').charges.create(CHARGE);
    throw new Failed('a publishable key was accepted');
  } catch (error) {
    if (!(error instanceof Stripe.errors.StripeAuthenticationError)) throw error;
    console.log(`<- ${error.type} ${error.statusCode}: ${error.message}`);
    expect('HTTP 401', error.statusCode, 401);
  }
  return 'refused with StripeAuthenticationError';
}

const SCENARIOS = [
  ['A payment whose response is lost: retried with the same key, it is charged once', retryAfterLostResponse],
  ['Two requests with one key at once: one charge; each click gets it, or the key in use', doubleClick],
  ['A key reused for another payment is refused, and the first charge stays as it was', changedAmount],
  ['A declined card is a final answer: the retry gets the same decline, not a second try', declinedCard],
  ['An invalid request releases its key, so the corrected request runs under the same key', invalidThenCorrected],
  ['A key longer than 255 characters is refused before anything runs', malformedKey],
  ['Without an idempotencyKey the library sends one of its own; retrieve and list paginate', keysOfItsOwnAndPaging],
  ['A refund retried with its key refunds once; more than is left is amount_too_large', refundRetried],
  ['A malformed API key is a Stripe authentication error', badApiKey],
];

const mode = EXPECT_WAIT ? " (expecting the demo to wait for a key's first request)" : '';
console.log(`stripe-node ${Stripe.PACKAGE_VERSION} against ${BASE_URL}${mode}`);
const failed = [];
for (const [title, scenario] of SCENARIOS) {
  console.log(`\n== ${title}`);
  try {
    console.log(`PASS: ${await scenario()}`);
  } catch (error) {
    console.error(`FAIL: ${scenario.name}: ${error instanceof Failed ? error.message : describe(error)}`);
    failed.push(scenario.name);
  }
}
console.log();
if (failed.length > 0) {
  console.error(`${failed.length} of ${SCENARIOS.length} scenarios failed against ${BASE_URL}: ${failed.join(' ')}`);
  process.exit(1);
}
console.log(`all ${SCENARIOS.length} scenarios passed against ${BASE_URL}`);
// The library's keep-alive connections would hold the process open until their 80 s timeout.
process.exit(0);
