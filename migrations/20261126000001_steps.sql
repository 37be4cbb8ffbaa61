-- tower-idempotency: the finished steps of a key's handler (`Steps`, lease mode), so that a
-- request that takes the key over, or retries it after a release, skips what already ran.
--
-- A step is recorded by one statement fenced by the claim: it inserts only while the key's
-- record still carries the holder's token under a live lease, and its `FOR SHARE` row lock orders
-- it against a takeover's `UPDATE` of the record. Steps are bound to the payload's fingerprint
-- (a key claimed again with another payload finds none of them) and expire with the record they
-- were recorded under; they outlive a release, so a retry after one does not run them again.
-- `scope_key` is the record's key (the first 128 bits of the scope's SHA-256), in either table.

CREATE TABLE idempotency.steps (
    scope_key   uuid        NOT NULL,
    fingerprint bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    name        text        NOT NULL,
    output      bytea       NOT NULL,
    expires_at  timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope_key, name)
);

-- Expiry deletes in batches, oldest first.
CREATE INDEX steps_expires_at ON idempotency.steps (expires_at);
