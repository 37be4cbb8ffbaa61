-- charges-demo: settlement, reported by the acquirer's `charge.settled` webhooks, and the
-- balances it fills.
--
-- A charge is settled once: `settled` goes from NULL to a time in one conditional UPDATE, in the
-- transaction that records the webhook as handled, and that same statement adds the charge's
-- amount, less what was refunded by then, to `balances.available`. A refund of a settled charge
-- takes its amount back from `available` (which may then go below zero, as Stripe's can).

ALTER TABLE charges
    ADD COLUMN settled timestamptz,
    ADD CONSTRAINT charges_settled_only_if_paid CHECK (settled IS NULL OR status = 'succeeded');

CREATE TABLE balances (
    account   text   NOT NULL,
    currency  text   NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    available bigint NOT NULL,
    PRIMARY KEY (account, currency)
);
