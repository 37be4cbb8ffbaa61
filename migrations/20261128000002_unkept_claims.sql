-- tower-idempotency: a claim that will keep its request for the completer says so (issue 44).
--
-- With `with_completion`, the layer claims a key, then keeps its request: two statements. A
-- process that dies between them leaves the key in flight with no request for the completer to
-- finish it, until a client retry or its TTL; its handler never ran (the layer runs it only once
-- the request is kept, unless it fails open, and then it does not mark its claims). The claim now
-- says in its own statement that its request will be kept (`keeps_request`), and the completer's
-- round releases such a claim, fenced by its token, once its lease lapsed more than the grace ago
-- and no request of its payload is kept.
--
-- The partial indexes hold the claims in flight that keep their request: few (a completion clears
-- `keeps_request`, which takes its row out), so a round finds the unkept ones without reading the
-- table. Their predicate names `keeps_request` alone: a column named in any index predicate blocks
-- HOT updates of every row that changes it, so naming `status` there would have made every
-- completion, of any layer, a non-HOT update. Only a marked claim's completion (its flag cleared)
-- and a takeover (its `created_at` moved) lose HOT; the completions of layers without completion
-- keep it.

ALTER TABLE idempotency.records ADD COLUMN keeps_request boolean;
ALTER TABLE idempotency.partitioned_records ADD COLUMN keeps_request boolean;

CREATE INDEX records_unkept ON idempotency.records (created_at) WHERE keeps_request;
CREATE INDEX partitioned_records_unkept ON idempotency.partitioned_records (created_at)
    WHERE keeps_request;

-- `complete_many` (lease mode's group commit of completions) clearing the flag of what it completes.
CREATE OR REPLACE FUNCTION idempotency.complete_many(
    p_keys uuid[], p_tokens bigint[], p_statuses smallint[], p_bodies bytea[],
    p_firsts int[], p_lasts int[], p_names text[], p_values bytea[], p_notify boolean
)
RETURNS TABLE (scope_key uuid, token bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    v_waited boolean;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        UPDATE idempotency.records r
        SET status = p_statuses[i],
            header_names = p_names[p_firsts[i]:p_lasts[i]],
            header_values = p_values[p_firsts[i]:p_lasts[i]],
            body = p_bodies[i],
            lease_until = NULL,
            completed_at = now(),
            -- Unchanged for an unmarked claim, whose completion stays a HOT update.
            keeps_request = CASE WHEN r.keeps_request THEN false ELSE r.keeps_request END
        WHERE r.scope_key = p_keys[i]
          AND r.token = p_tokens[i]
          AND r.status IS NULL
          AND r.expires_at > now()
        RETURNING r.waited INTO v_waited;
        IF FOUND THEN
            IF p_notify AND v_waited THEN
                PERFORM pg_notify('idempotency_settled', p_keys[i]::text);
            END IF;
            scope_key := p_keys[i];
            token := p_tokens[i];
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

-- `claim_partitioned` marking the claim with `p_keeps_request`.

CREATE FUNCTION idempotency.claim_partitioned(
    p_key uuid, p_fingerprint bytea, p_lease interval, p_ttl interval, p_try_lock boolean,
    p_claimant uuid, p_steps boolean, p_keeps_request boolean
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
            (scope_key, fingerprint, token, expires_at, lease_until, claimant, generation,
             keeps_request)
        VALUES (p_key, p_fingerprint, new_token, now() + greatest(p_ttl, p_lease), now() + p_lease,
                p_claimant, new_generation, p_keeps_request);
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
            claimant = p_claimant,
            keeps_request = p_keeps_request
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

-- The previous version, for instances not yet upgraded: their claims are not marked.

CREATE OR REPLACE FUNCTION idempotency.claim_partitioned(
    p_key uuid, p_fingerprint bytea, p_lease interval, p_ttl interval, p_try_lock boolean,
    p_claimant uuid, p_steps boolean
)
RETURNS TABLE (
    outcome text, token bigint, takeover boolean, same_fingerprint boolean,
    lease_remaining float8, expires_in float8, status smallint,
    header_names text[], header_values bytea[], body bytea, mine boolean, generation bigint
)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM idempotency.claim_partitioned(p_key, p_fingerprint, p_lease, p_ttl, p_try_lock,
                                                p_claimant, p_steps, false)
$$;
