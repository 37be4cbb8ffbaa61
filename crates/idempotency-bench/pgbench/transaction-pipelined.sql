-- The same five statements pipelined: sent together, answered together, one round trip.
-- (No client driver the layer can use pipelines a handler's own statements; this is the bound.)
\set k random(1, 9000000000000000)
\startpipeline
BEGIN;
SELECT pg_try_advisory_xact_lock(:k::bigint);
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, status, header_names, header_values, body, completed_at)
VALUES (lpad(to_hex(:k::bigint), 32, '0')::uuid, decode(repeat('ab', 32), 'hex'), nextval('idempotency.fencing_tokens'),
        now() + interval '1 day', 201, '{content-type}'::text[], ARRAY['\x6170706c69636174696f6e2f6a736f6e'::bytea],
        decode(repeat('7b', 150), 'hex'), now())
ON CONFLICT DO NOTHING RETURNING token;
COMMIT;
\endpipeline
