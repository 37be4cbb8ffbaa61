-- tower-idempotency: the requests of keys in flight, kept for the completer (opt-in with
-- `IdempotencyLayer::with_completion`), so that a key whose client crashed and never came back is
-- driven to completion by a background task exactly as the client's retry would be.
--
-- A request is kept by one statement fenced by the claim (as a step is). `scope` is the whole
-- 32-byte scope key (the completer's logs, and a sealed request's associated data); `request` is
-- the layer's encoding, sealed when the store is wrapped in `SealingStore`. The completer's pick
-- is one `UPDATE` over `FOR UPDATE SKIP LOCKED` rows that bumps `attempts` and moves
-- `next_attempt_at`, so two instances never pick one key at once.

CREATE TABLE idempotency.pending_requests (
    scope_key       uuid        PRIMARY KEY,
    scope           bytea       NOT NULL CHECK (octet_length(scope) = 32),
    fingerprint     bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    request         bytea       NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    kept_at         timestamptz NOT NULL DEFAULT now()
);

-- The pick walks keys by when they are next due.
CREATE INDEX pending_requests_next_attempt_at ON idempotency.pending_requests (next_attempt_at);
