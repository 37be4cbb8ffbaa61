-- The table the benchmark's charge handler writes to (one INSERT a request), created in each run's
-- database before any server starts (src/app.rs includes this file), and by setup.sql for the
-- pgbench scripts.
CREATE TABLE charges (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account    text        NOT NULL,
    amount     bigint      NOT NULL CHECK (amount > 0),
    currency   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
