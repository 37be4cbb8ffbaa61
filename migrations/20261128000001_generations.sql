-- tower-idempotency: key generations (issue 44). A step's downstream key is derived from its key's
-- generation, so that a key claimed again after it expired (a new operation) never sends the
-- service it calls an old operation's downstream key, which would replay the old result.
--
-- A generation runs from a key's first claim to its expiry. The claim that starts one stores a
-- new value (from `fencing_tokens`: the claim's own token when it inserts the key); a takeover of
-- a claim in flight keeps it; a claim of a dead row (expired, or past its TTL and not held)
-- starts another. Steps belong to the generation they were recorded under and are read by it
-- alone. They outlive a release of their record, and so does their generation: a key inserted
-- anew whose payload has live steps takes their generation (`inherit_generation`).
--
-- Rows written before this migration have none (NULL), read as generation 0 on both sides;
-- steps of generation 0 still expire by their own `expires_at`, as they did. Adding nullable
-- columns rewrites nothing.
--
-- A step is recorded while its claim holds the token, as a completion is (the statement in the
-- store no longer asks for a live lease), and steps whose record of the same generation is alive
-- are not expired (the store's expiry statement), so a handler running past its TTL keeps them.

ALTER TABLE idempotency.records ADD COLUMN generation bigint;
ALTER TABLE idempotency.partitioned_records ADD COLUMN generation bigint;
ALTER TABLE idempotency.steps ADD COLUMN generation bigint;

-- The generation of a key that the calling claim has just inserted with `p_token` (and stored as
-- its generation): that of the payload's live steps if a release left some, written to the row,
-- else `p_token`. Called in the claim's `RETURNING`, with a snapshot of its own taken after the
-- row is in place, for the reason `steps_recorded` gives; the row is the caller's own, not yet
-- committed, so nobody else can have changed it. The newest generation wins if several left steps.

CREATE FUNCTION idempotency.inherit_generation(p_key uuid, p_fingerprint bytea, p_token bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    inherited bigint;
BEGIN
    SELECT coalesce(s.generation, 0) INTO inherited FROM idempotency.steps s
    WHERE s.scope_key = p_key AND s.fingerprint = p_fingerprint AND s.expires_at > now()
    ORDER BY s.generation DESC NULLS LAST
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN p_token;
    END IF;
    UPDATE idempotency.records r SET generation = inherited
    WHERE r.scope_key = p_key AND r.token = p_token;
    RETURN inherited;
END
$$;

-- `claim_partitioned` with the claim's generation, and `p_steps`: whether a key inserted anew
-- looks for the generation of its payload's live steps (apps that use steps). Its claims are
-- serialised on the key's advisory lock, so the look is taken after the key was read, in the
-- same function: every claim before it committed, and so did its steps.

CREATE FUNCTION idempotency.claim_partitioned(
    p_key uuid, p_fingerprint bytea, p_lease interval, p_ttl interval, p_try_lock boolean,
    p_claimant uuid, p_steps boolean
)
RETURNS TABLE (
    outcome text, token bigint, takeover boolean, same_fingerprint boolean,
    lease_remaining float8, expires_in float8, status smallint,
    header_names text[], header_values bytea[], body bytea, mine boolean, generation bigint
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key constant bigint :=
        ('x' || encode(substring(uuid_send(p_key) FROM 1 FOR 8), 'hex'))::bit(64)::bigint;
    existing idempotency.partitioned_records%ROWTYPE;
    new_token bigint;
    new_generation bigint;
    replaced bigint;
BEGIN
    IF p_try_lock THEN
        IF NOT pg_try_advisory_xact_lock(lock_key) THEN
            -- Another claimer holds the key's lock: a committed record is still answered.
            SELECT * INTO existing FROM idempotency.partitioned_records r
            WHERE r.scope_key = p_key AND r.expires_at > now() AND r.status IS NOT NULL
              AND r.created_at + p_ttl > now()
            ORDER BY r.expires_at DESC
            LIMIT 1;
            IF FOUND THEN
                RETURN QUERY SELECT 'existing'::text, existing.token, existing.takeover,
                    existing.fingerprint = p_fingerprint, NULL::float8,
                    extract(epoch FROM least(existing.expires_at, existing.created_at + p_ttl) - now())::float8,
                    existing.status, existing.header_names, existing.header_values, existing.body,
                    false, existing.generation;
                RETURN;
            END IF;
            RETURN QUERY SELECT 'busy'::text, NULL::bigint, NULL::boolean, NULL::boolean,
                NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea,
                NULL::boolean, NULL::bigint;
            RETURN;
        END IF;
    ELSE
        PERFORM pg_advisory_xact_lock(lock_key);
    END IF;

    SELECT * INTO existing FROM idempotency.partitioned_records r
    WHERE r.scope_key = p_key AND r.expires_at > now()
      -- Past its TTL and not held: as good as gone.
      AND NOT (r.created_at + p_ttl <= now() AND (r.status IS NOT NULL OR r.lease_until <= now()))
    ORDER BY r.expires_at DESC
    LIMIT 1;

    IF NOT FOUND THEN
        -- A row past its TTL is replaced; one past `expires_at` is left to the maintenance.
        DELETE FROM idempotency.partitioned_records r
        WHERE r.scope_key = p_key AND r.expires_at > now();
        GET DIAGNOSTICS replaced = ROW_COUNT;
        new_token := nextval('idempotency.fencing_tokens');
        -- A key that expired starts a new generation, even while its steps wait for their own
        -- expiry; one without a row may have been released with steps, whose generation goes on.
        IF p_steps AND replaced = 0 THEN
            SELECT coalesce(s.generation, 0) INTO new_generation FROM idempotency.steps s
            WHERE s.scope_key = p_key AND s.fingerprint = p_fingerprint AND s.expires_at > now()
            ORDER BY s.generation DESC NULLS LAST
            LIMIT 1;
        END IF;
        new_generation := coalesce(new_generation, new_token);
        INSERT INTO idempotency.partitioned_records
            (scope_key, fingerprint, token, expires_at, lease_until, claimant, generation)
        VALUES (p_key, p_fingerprint, new_token, now() + greatest(p_ttl, p_lease), now() + p_lease,
                p_claimant, new_generation);
        RETURN QUERY SELECT 'acquired'::text, new_token, false, NULL::boolean,
            NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea,
            NULL::boolean, new_generation;
        RETURN;
    END IF;

    IF existing.status IS NULL AND existing.lease_until <= now()
       AND existing.fingerprint = p_fingerprint THEN
        -- A takeover: the generation goes on.
        new_token := nextval('idempotency.fencing_tokens');
        UPDATE idempotency.partitioned_records r SET
            token = new_token,
            takeover = true,
            created_at = now(),
            expires_at = now() + greatest(p_ttl, p_lease),
            lease_until = now() + p_lease,
            claimant = p_claimant
        WHERE r.scope_key = p_key AND r.expires_at = existing.expires_at;
        RETURN QUERY SELECT 'acquired'::text, new_token, true, NULL::boolean,
            NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea,
            NULL::boolean, existing.generation;
        RETURN;
    END IF;

    RETURN QUERY SELECT 'existing'::text, existing.token, existing.takeover,
        existing.fingerprint = p_fingerprint,
        extract(epoch FROM existing.lease_until - now())::float8,
        extract(epoch FROM least(existing.expires_at, existing.created_at + p_ttl) - now())::float8,
        existing.status, existing.header_names, existing.header_values, existing.body,
        coalesce(existing.claimant = p_claimant, false) AND existing.status IS NULL,
        existing.generation;
END
$$;

-- The previous version, for instances not yet upgraded: the same claim, so that the rows they
-- write carry generations too.

CREATE OR REPLACE FUNCTION idempotency.claim_partitioned(
    p_key uuid, p_fingerprint bytea, p_lease interval, p_ttl interval, p_try_lock boolean,
    p_claimant uuid
)
RETURNS TABLE (
    outcome text, token bigint, takeover boolean, same_fingerprint boolean,
    lease_remaining float8, expires_in float8, status smallint,
    header_names text[], header_values bytea[], body bytea, mine boolean
)
LANGUAGE sql VOLATILE AS $$
    SELECT c.outcome, c.token, c.takeover, c.same_fingerprint, c.lease_remaining, c.expires_in,
           c.status, c.header_names, c.header_values, c.body, c.mine
    FROM idempotency.claim_partitioned(p_key, p_fingerprint, p_lease, p_ttl, p_try_lock,
                                       p_claimant, true) c
$$;
