-- tower-idempotency: one row per (principal, method, path, Idempotency-Key), keyed by the SHA-256 of
-- that scope so neither principals nor raw keys are stored in clear.
--
-- A row is either
--   * in flight:  status IS NULL,     lease_until is the holder's lease, token fences the holder;
--   * completed:  status IS NOT NULL, the response to replay (body NULL when it was too large to keep).
-- A released claim is deleted. Fencing tokens come from a sequence, so they are never reused even
-- when a key is deleted and claimed again.
--
-- The schema `idempotency` and its migrations table `idempotency._sqlx_migrations` are created by
-- `PostgresStore::migrate`, never shared with the application's own migrations.

CREATE SEQUENCE idempotency.fencing_tokens AS bigint;

CREATE TABLE idempotency.records (
    scope_key      bytea       PRIMARY KEY CHECK (octet_length(scope_key) = 32),
    fingerprint    bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    token          bigint      NOT NULL,
    -- true when this claim took over a holder whose lease lapsed.
    takeover       boolean     NOT NULL DEFAULT false,
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- The record, completed or not, is deleted by the reaper once this passes. Set at claim time
    -- and never moved by `complete`, so completing a record is a HOT update.
    expires_at     timestamptz NOT NULL,
    lease_until    timestamptz,
    completed_at   timestamptz,
    status         smallint    CHECK (status BETWEEN 100 AND 999),
    header_names   text[],
    header_values  bytea[],
    body           bytea,
    CHECK ((status IS NULL) = (lease_until IS NOT NULL))
) WITH (fillfactor = 80);

-- The reaper walks expired rows in bounded batches.
CREATE INDEX records_expires_at_idx ON idempotency.records (expires_at);
