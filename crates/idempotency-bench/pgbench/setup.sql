-- The tables the pgbench scripts write to: the benchmark's charges table and the store's schema.
-- psql -h 127.0.0.1 -d <scratch database> -f setup.sql
CREATE TABLE charges (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account    text        NOT NULL,
    amount     bigint      NOT NULL CHECK (amount > 0),
    currency   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE SCHEMA idempotency;
\ir ../../../migrations/20261121000001_create_records.sql
