-- tower-idempotency: whether a key has live steps for a payload, for a claim of a new key to say
-- in its own statement, so that its handler's first step need not read them (one round trip).
--
-- A new key can have steps: they outlive a release of their record. The claim's statement
-- cannot look with its own snapshot: its `INSERT .. ON CONFLICT` may wait for, and succeed after,
-- a transaction that committed a step and then deleted the record (a concurrent claim's
-- release), which that snapshot does not see. A VOLATILE function takes a snapshot of its own
-- when it runs, after the claim's row is in place: every step recorded under an earlier holder
-- committed before that holder's row was deleted (the step's `FOR SHARE` lock orders them), and
-- no later step can be recorded but under the new claim's token.
--
-- Sequential scans are off for the plan PL/pgSQL caches, as in `complete_many`.

CREATE FUNCTION idempotency.steps_recorded(p_key uuid, p_fingerprint bytea)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
BEGIN
    RETURN EXISTS (
        SELECT FROM idempotency.steps s
        WHERE s.scope_key = p_key AND s.fingerprint = p_fingerprint AND s.expires_at > now()
    );
END
$$;
