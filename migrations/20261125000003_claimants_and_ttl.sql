-- tower-idempotency: who made a claim, and records that expire at their TTL.
--
-- `claimant` is a random id each claim attempt carries. A lease-mode claim commits on its own,
-- so when its caller loses the answer (a timeout, a lost connection, a cancelled request) the row
-- may exist with nobody holding it; the attempt then finds its own row again by this id, or
-- deletes it, instead of leaving the key blocked until its lease lapses. NULL for rows written
-- before this migration.
--
-- The new `claim_partitioned` (one argument more) also treats a completed record as expired once
-- its TTL, counted from its claim, has passed, even while its row is kept longer for a longer
-- lease. The five-argument version stays for instances not yet upgraded.

ALTER TABLE idempotency.records ADD COLUMN claimant uuid;
ALTER TABLE idempotency.partitioned_records ADD COLUMN claimant uuid;

CREATE FUNCTION idempotency.claim_partitioned(
    p_key uuid, p_fingerprint bytea, p_lease interval, p_ttl interval, p_try_lock boolean,
    p_claimant uuid
)
RETURNS TABLE (
    outcome text, token bigint, takeover boolean, same_fingerprint boolean,
    lease_remaining float8, expires_in float8, status smallint,
    header_names text[], header_values bytea[], body bytea, mine boolean
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key constant bigint :=
        ('x' || encode(substring(uuid_send(p_key) FROM 1 FOR 8), 'hex'))::bit(64)::bigint;
    existing idempotency.partitioned_records%ROWTYPE;
    new_token bigint;
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
                    false;
                RETURN;
            END IF;
            RETURN QUERY SELECT 'busy'::text, NULL::bigint, NULL::boolean, NULL::boolean,
                NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea,
                NULL::boolean;
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
        new_token := nextval('idempotency.fencing_tokens');
        INSERT INTO idempotency.partitioned_records
            (scope_key, fingerprint, token, expires_at, lease_until, claimant)
        VALUES (p_key, p_fingerprint, new_token, now() + greatest(p_ttl, p_lease), now() + p_lease,
                p_claimant);
        RETURN QUERY SELECT 'acquired'::text, new_token, false, NULL::boolean,
            NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea,
            NULL::boolean;
        RETURN;
    END IF;

    IF existing.status IS NULL AND existing.lease_until <= now()
       AND existing.fingerprint = p_fingerprint THEN
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
            NULL::boolean;
        RETURN;
    END IF;

    RETURN QUERY SELECT 'existing'::text, existing.token, existing.takeover,
        existing.fingerprint = p_fingerprint,
        extract(epoch FROM existing.lease_until - now())::float8,
        extract(epoch FROM least(existing.expires_at, existing.created_at + p_ttl) - now())::float8,
        existing.status, existing.header_names, existing.header_values, existing.body,
        coalesce(existing.claimant = p_claimant, false) AND existing.status IS NULL;
END
$$;
