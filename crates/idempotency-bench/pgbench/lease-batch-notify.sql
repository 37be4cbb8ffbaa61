-- lease-batch.sql with the completion announcing each key, as a layer built with
-- `with_in_flight_wait` sends it when a duplicate waits for every key (the worst case): the
-- claims are marked `waited`, and `complete_many(..., p_notify => true)` sends one
-- `pg_notify('idempotency_settled', key)` per record, delivered at commit.
--
-- What PostgreSQL does for four lease-mode requests that share their batches, as the layer
-- sends it: one INSERT of the four claims (as `CLAIM_NEW_KEYS` in the store; the aggregate around
-- it only hands the keys and tokens on to the completion), each request's own autocommitted
-- charge INSERT, and one batched completion (`idempotency.complete_many`). Each transaction of
-- this script is four requests.
\set k random(1, 2000000000000000)
WITH claimed AS (
    INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, lease_until, waited)
    SELECT c.key, c.fingerprint, nextval('idempotency.fencing_tokens'),
           now() + greatest(c.ttl, c.lease) * interval '1 microsecond',
           now() + c.lease * interval '1 microsecond', true
    FROM unnest(
        ARRAY[lpad(to_hex(:k::int8 * 4), 32, '0')::uuid, lpad(to_hex(:k::int8 * 4 + 1), 32, '0')::uuid,
              lpad(to_hex(:k::int8 * 4 + 2), 32, '0')::uuid, lpad(to_hex(:k::int8 * 4 + 3), 32, '0')::uuid],
        array_fill(decode(repeat('ab', 32), 'hex'), ARRAY[4]),
        array_fill(30000000::int8, ARRAY[4]), array_fill(86400000000::int8, ARRAY[4])
    ) AS c(key, fingerprint, lease, ttl)
    ON CONFLICT (scope_key) DO NOTHING
    RETURNING scope_key, token
)
SELECT array_agg(scope_key) AS keys, array_agg(token) AS tokens FROM claimed
\gset
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
SELECT scope_key, token FROM idempotency.complete_many(
    :keys, :tokens, array_fill(201::int2, ARRAY[4]),
    array_fill(decode(repeat('7b', 150), 'hex'), ARRAY[4]), ARRAY[1, 2, 3, 4], ARRAY[1, 2, 3, 4],
    array_fill('content-type'::text, ARRAY[4]),
    array_fill('\x6170706c69636174696f6e2f6a736f6e'::bytea, ARRAY[4]), true);
