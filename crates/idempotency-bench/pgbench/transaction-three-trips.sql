-- The same five statements in the three round trips a driver with pipelining could send: `BEGIN`
-- with the lock (the handler must know the claim's outcome before it runs), the handler's
-- `INSERT` alone (the handler's own statement, sent when the handler sends it), and the record
-- with `COMMIT`. sqlx, the driver the layer shares with the app, cannot pipeline; this is what
-- a driver that could would be bounded by.
\set k random(1, 9000000000000000)
\startpipeline
BEGIN;
SELECT pg_try_advisory_xact_lock(:k::bigint);
\endpipeline
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
\startpipeline
INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, status, header_names, header_values, body, completed_at)
VALUES (lpad(to_hex(:k::bigint), 32, '0')::uuid, decode(repeat('ab', 32), 'hex'), nextval('idempotency.fencing_tokens'),
        now() + interval '1 day', 201, '{content-type}'::text[], ARRAY['\x6170706c69636174696f6e2f6a736f6e'::bytea],
        decode(repeat('7b', 150), 'hex'), now())
ON CONFLICT DO NOTHING RETURNING token;
COMMIT;
\endpipeline
