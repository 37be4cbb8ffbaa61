-- tower-idempotency: records are keyed by the first 128 bits of the scope's SHA-256, kept as a
-- `uuid` (16 bytes, fixed width) instead of the whole hash as `bytea` (33 bytes with its length).
--
-- Why: every claim of a new key inserts into the primary key at a random leaf, so on a large
-- table the index decides how much must stay in memory and how many pages each checkpoint
-- cycle writes whole to the WAL. An entry of the primary key shrinks from 48 to 24 bytes.
-- 128 bits keep collisions out of reach: among a billion live keys the chance that any two
-- share a prefix is about 10⁻²¹, and two keys that did would only meet as one record if their
-- fingerprints matched too.
--
-- Existing records keep their keys (the same prefix of the same hash). The tables are rewritten,
-- under an exclusive lock, once.

ALTER TABLE idempotency.records DROP CONSTRAINT records_scope_key_check;
ALTER TABLE idempotency.records
    ALTER COLUMN scope_key TYPE uuid USING encode(substring(scope_key FROM 1 FOR 16), 'hex')::uuid;

ALTER TABLE idempotency.partitioned_records DROP CONSTRAINT partitioned_records_scope_key_check;
ALTER TABLE idempotency.partitioned_records
    ALTER COLUMN scope_key TYPE uuid USING encode(substring(scope_key FROM 1 FOR 16), 'hex')::uuid;

-- The partitioned claim, as before, taking the key as a `uuid`.
DROP FUNCTION idempotency.claim_partitioned(bytea, bytea, interval, interval, boolean);

CREATE FUNCTION idempotency.claim_partitioned(
    p_key uuid, p_fingerprint bytea, p_lease interval, p_ttl interval, p_try_lock boolean
)
RETURNS TABLE (
    outcome text, token bigint, takeover boolean, same_fingerprint boolean,
    lease_remaining float8, expires_in float8, status smallint,
    header_names text[], header_values bytea[], body bytea
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
            RETURN QUERY SELECT 'busy'::text, NULL::bigint, NULL::boolean, NULL::boolean,
                NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea;
            RETURN;
        END IF;
    ELSE
        PERFORM pg_advisory_xact_lock(lock_key);
    END IF;

    SELECT * INTO existing FROM idempotency.partitioned_records r
    WHERE r.scope_key = p_key AND r.expires_at > now()
    ORDER BY r.expires_at DESC
    LIMIT 1;

    IF NOT FOUND THEN
        new_token := nextval('idempotency.fencing_tokens');
        INSERT INTO idempotency.partitioned_records
            (scope_key, fingerprint, token, expires_at, lease_until)
        VALUES (p_key, p_fingerprint, new_token, now() + greatest(p_ttl, p_lease), now() + p_lease);
        RETURN QUERY SELECT 'acquired'::text, new_token, false, NULL::boolean,
            NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea;
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
            lease_until = now() + p_lease
        WHERE r.scope_key = p_key AND r.expires_at = existing.expires_at;
        RETURN QUERY SELECT 'acquired'::text, new_token, true, NULL::boolean,
            NULL::float8, NULL::float8, NULL::smallint, NULL::text[], NULL::bytea[], NULL::bytea;
        RETURN;
    END IF;

    RETURN QUERY SELECT 'existing'::text, existing.token, existing.takeover,
        existing.fingerprint = p_fingerprint,
        extract(epoch FROM existing.lease_until - now())::float8,
        extract(epoch FROM existing.expires_at - now())::float8,
        existing.status, existing.header_names, existing.header_values, existing.body;
END
$$;
