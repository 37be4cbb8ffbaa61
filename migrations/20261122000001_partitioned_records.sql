-- tower-idempotency, partitioned mode (opt-in, `PostgresStore::partitioned`): the same records,
-- range-partitioned by `expires_at`, so expiry drops whole partitions instead of deleting rows.
--
-- A partitioned table's unique constraints must include the partition key, so `scope_key` alone
-- cannot be unique here. Claims therefore go through `claim_partitioned`, which serialises the
-- claims of one key on a transaction-scoped advisory lock and then decides on a fresh snapshot
-- (each statement of a READ COMMITTED function sees everything committed before it ran): still
-- one statement for the caller, atomic by the lock rather than by a unique index. Partitions are
-- created ahead and dropped behind by the store's maintenance (`delete_expired`).

CREATE TABLE idempotency.partitioned_records (
    scope_key      bytea       NOT NULL CHECK (octet_length(scope_key) = 32),
    fingerprint    bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    token          bigint      NOT NULL,
    takeover       boolean     NOT NULL DEFAULT false,
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz NOT NULL,
    lease_until    timestamptz,
    completed_at   timestamptz,
    status         smallint    CHECK (status BETWEEN 100 AND 999),
    header_names   text[],
    header_values  bytea[],
    body           bytea,
    CHECK ((status IS NULL) = (lease_until IS NOT NULL)),
    PRIMARY KEY (scope_key, expires_at)
) PARTITION BY RANGE (expires_at);

-- Claims a key (see `PostgresStore` for the protocol). `try_lock` is the transactional mode:
-- answer 'busy' at once instead of waiting for another claimer of the key.
CREATE FUNCTION idempotency.claim_partitioned(
    p_key bytea, p_fingerprint bytea, p_lease interval, p_ttl interval, p_try_lock boolean
)
RETURNS TABLE (
    outcome text, token bigint, takeover boolean, same_fingerprint boolean,
    lease_remaining float8, expires_in float8, status smallint,
    header_names text[], header_values bytea[], body bytea
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key constant bigint := ('x' || encode(substring(p_key FROM 1 FOR 8), 'hex'))::bit(64)::bigint;
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
