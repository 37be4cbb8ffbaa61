-- What PostgreSQL gets from four requests of the benchmark's `acquirer-lease` scenario that share
-- their batches (the acquirer is in the server's process and sends PostgreSQL nothing): one
-- `CLAIM_NEW_KEYS` of the four keys (an app without steps: no steps check), each request's
-- autocommitted charge INSERT, one `complete_many`. Each transaction is four requests.
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
    RETURNING scope_key, token, false AS stepless
)
SELECT array_agg(scope_key ORDER BY scope_key) AS keys, array_agg(token ORDER BY scope_key) AS tokens
FROM claimed
\gset
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
SELECT scope_key, token FROM idempotency.complete_many(
    :keys, :tokens, array_fill(201::int2, ARRAY[4]),
    array_fill(decode(repeat('7b', 150), 'hex'), ARRAY[4]), ARRAY[1, 2, 3, 4], ARRAY[1, 2, 3, 4],
    array_fill('content-type'::text, ARRAY[4]),
    array_fill('\x6170706c69636174696f6e2f6a736f6e'::bytea, ARRAY[4]));
