-- `two-call-steps.sql` as a driver that pipelines could send it: `BEGIN` travels with the charge
-- INSERT, the `ledger` record with `COMMIT`, so each step costs one round trip more than
-- `two-call-lease.sql` (the literal "one extra round trip per step"). sqlx sends one statement
-- and waits for its answer before the next, so the layer cannot send this today.
\set k random(1, 2000000000000000)
WITH claimed AS (
    INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, lease_until, claimant)
    SELECT c.key, c.fingerprint, nextval('idempotency.fencing_tokens'),
           now() + greatest(c.ttl, c.lease) * interval '1 microsecond',
           now() + c.lease * interval '1 microsecond', c.claimant
    FROM unnest(
        ARRAY[lpad(to_hex(:k::int8 * 4), 32, '0')::uuid, lpad(to_hex(:k::int8 * 4 + 1), 32, '0')::uuid,
              lpad(to_hex(:k::int8 * 4 + 2), 32, '0')::uuid, lpad(to_hex(:k::int8 * 4 + 3), 32, '0')::uuid],
        array_fill(decode(repeat('ab', 32), 'hex'), ARRAY[4]),
        array_fill(30000000::int8, ARRAY[4]), array_fill(86400000000::int8, ARRAY[4]),
        array_fill('00000000-0000-0000-0000-000000000001'::uuid, ARRAY[4])
    ) AS c(key, fingerprint, lease, ttl, claimant)
    ON CONFLICT (scope_key) DO NOTHING
    RETURNING scope_key, token, NOT idempotency.steps_recorded(scope_key, fingerprint) AS stepless
)
SELECT array_agg(scope_key ORDER BY scope_key) AS keys, array_agg(token ORDER BY scope_key) AS tokens
FROM claimed
\gset
-- request 1
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[1], decode(repeat('ab', 32), 'hex'), 'authorize', convert_to('"auth_0123456789abcdef0123456789abcdef"', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[1] AND r.token = (:tokens::int8[])[1] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
\startpipeline
BEGIN;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
\endpipeline
\startpipeline
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[1], decode(repeat('ab', 32), 'hex'), 'ledger', convert_to('123456', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[1] AND r.token = (:tokens::int8[])[1] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
COMMIT;
\endpipeline
-- request 2
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[2], decode(repeat('ab', 32), 'hex'), 'authorize', convert_to('"auth_0123456789abcdef0123456789abcdef"', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[2] AND r.token = (:tokens::int8[])[2] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
\startpipeline
BEGIN;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
\endpipeline
\startpipeline
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[2], decode(repeat('ab', 32), 'hex'), 'ledger', convert_to('123456', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[2] AND r.token = (:tokens::int8[])[2] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
COMMIT;
\endpipeline
-- request 3
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[3], decode(repeat('ab', 32), 'hex'), 'authorize', convert_to('"auth_0123456789abcdef0123456789abcdef"', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[3] AND r.token = (:tokens::int8[])[3] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
\startpipeline
BEGIN;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
\endpipeline
\startpipeline
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[3], decode(repeat('ab', 32), 'hex'), 'ledger', convert_to('123456', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[3] AND r.token = (:tokens::int8[])[3] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
COMMIT;
\endpipeline
-- request 4
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[4], decode(repeat('ab', 32), 'hex'), 'authorize', convert_to('"auth_0123456789abcdef0123456789abcdef"', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[4] AND r.token = (:tokens::int8[])[4] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
\startpipeline
BEGIN;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
\endpipeline
\startpipeline
INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
SELECT (:keys::uuid[])[4], decode(repeat('ab', 32), 'hex'), 'ledger', convert_to('123456', 'UTF8'), r.expires_at
FROM idempotency.records r
WHERE r.scope_key = (:keys::uuid[])[4] AND r.token = (:tokens::int8[])[4] AND r.status IS NULL
  AND r.lease_until > now() AND r.expires_at > now()
FOR SHARE
ON CONFLICT (scope_key, name) DO UPDATE SET
    fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
    expires_at = EXCLUDED.expires_at, recorded_at = now();
COMMIT;
\endpipeline
SELECT scope_key, token FROM idempotency.complete_many(
    :keys, :tokens, array_fill(201::int2, ARRAY[4]),
    array_fill(decode(repeat('7b', 150), 'hex'), ARRAY[4]), ARRAY[1, 2, 3, 4], ARRAY[1, 2, 3, 4],
    array_fill('content-type'::text, ARRAY[4]),
    array_fill('\x6170706c69636174696f6e2f6a736f6e'::bytea, ARRAY[4]));
