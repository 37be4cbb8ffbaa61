-- tower-idempotency: lease mode's group commit of stored responses can wake waiting duplicates.
--
-- The same as `complete_many`, with one argument more: when `p_notify` is true, each record
-- completed is announced on the channel `idempotency_settled` (its key as payload), delivered
-- to every instance's listener when the batch commits. Requests waiting for a key in flight
-- (`IdempotencyLayer::with_in_flight_wait`) are woken by it. The eight-argument version stays
-- for instances not yet upgraded.

CREATE FUNCTION idempotency.complete_many(
    p_keys uuid[], p_tokens bigint[], p_statuses smallint[], p_bodies bytea[],
    p_firsts int[], p_lasts int[], p_names text[], p_values bytea[], p_notify boolean
)
RETURNS TABLE (scope_key uuid, token bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        UPDATE idempotency.records r
        SET status = p_statuses[i],
            header_names = p_names[p_firsts[i]:p_lasts[i]],
            header_values = p_values[p_firsts[i]:p_lasts[i]],
            body = p_bodies[i],
            lease_until = NULL,
            completed_at = now()
        WHERE r.scope_key = p_keys[i]
          AND r.token = p_tokens[i]
          AND r.status IS NULL
          AND r.expires_at > now();
        IF FOUND THEN
            IF p_notify THEN
                PERFORM pg_notify('idempotency_settled', p_keys[i]::text);
            END IF;
            scope_key := p_keys[i];
            token := p_tokens[i];
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
