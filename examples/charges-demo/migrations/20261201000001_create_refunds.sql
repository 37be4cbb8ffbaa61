-- charges-demo: refunds, and how much of each charge they took back.
--
-- A refund row and its charge's `amount_refunded` are written in one transaction, the charge row
-- locked (`SELECT ... FOR UPDATE`) so that concurrent refunds of one charge take turns. The CHECK
-- below is the last line of defence: whatever a writer does, a charge is never refunded beyond its
-- amount.

ALTER TABLE charges
    ADD COLUMN amount_refunded bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT charges_refunded_within_amount
        CHECK (amount_refunded >= 0 AND amount_refunded <= amount),
    -- A declined charge took nothing, so it gives nothing back.
    ADD CONSTRAINT charges_refunded_only_if_paid
        CHECK (amount_refunded = 0 OR status = 'succeeded');

CREATE TABLE refunds (
    -- Insertion order: lists are newest first, and `starting_after` pages by it.
    seq      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id       text        NOT NULL UNIQUE CHECK (id ~ '^re_[A-Za-z0-9]+$'),
    -- The charge's account: every read is scoped to it.
    account  text        NOT NULL,
    charge   text        NOT NULL REFERENCES charges (id),
    amount   bigint      NOT NULL CHECK (amount > 0),
    currency text        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    metadata jsonb       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    created  timestamptz NOT NULL
);

CREATE INDEX refunds_account_seq_idx ON refunds (account, seq DESC);
CREATE INDEX refunds_charge_idx ON refunds (charge);
