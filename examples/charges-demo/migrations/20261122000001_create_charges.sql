-- charges-demo: the ledger of charges, one row per charge attempt (succeeded or declined).
--
-- These migrations are the application's own: they live in the default schema and are tracked in
-- the default `_sqlx_migrations` table. tower-idempotency keeps its table and its migrations table
-- in the `idempotency` schema (`idempotency._sqlx_migrations`), so the two sets never meet.

CREATE TABLE charges (
    -- Insertion order: lists are newest first, and `starting_after` pages by it.
    seq             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id              text        NOT NULL UNIQUE CHECK (id ~ '^ch_[A-Za-z0-9]+$'),
    -- The account derived from the API key: every read is scoped to it.
    account         text        NOT NULL,
    amount          bigint      NOT NULL CHECK (amount > 0),
    currency        text        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    status          text        NOT NULL CHECK (status IN ('succeeded', 'failed')),
    source          text        NOT NULL,
    customer        text,
    description     text,
    metadata        jsonb       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    failure_code    text,
    failure_message text,
    created         timestamptz NOT NULL,
    CHECK ((status = 'failed') = (failure_code IS NOT NULL))
);

CREATE INDEX charges_account_seq_idx ON charges (account, seq DESC);
