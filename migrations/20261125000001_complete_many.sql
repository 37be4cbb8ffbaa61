-- tower-idempotency: lease mode's group commit of stored responses, as a function.
--
-- The batch used to be one `UPDATE .. FROM unnest(..)` sent as an unnamed statement, so that it
-- was planned afresh for every batch: a generic plan of that join, cached while the table was
-- small, scans the whole table (sequentially, or along an index) for every batch, and goes on
-- doing so as the table grows until the next ANALYZE. Planning it cost PostgreSQL about 140 µs
-- per batch, more than running it.
--
-- Here each record is completed by its own `UPDATE` on the primary key, whose plan PL/pgSQL
-- caches for the session. Sequential scans are switched off while the function runs, so that
-- plan is an index lookup by `scope_key` whatever the table's statistics said when it was made
-- (on an analyzed, nearly empty table the planner would otherwise prefer a sequential scan).
--
-- Each record's headers are the slice `p_names[first:last]` / `p_values[first:last]` of two flat
-- arrays (empty when `last < first`). Returns the records completed: those whose claim (key and
-- fencing token) still held, in flight and unexpired.

CREATE FUNCTION idempotency.complete_many(
    p_keys uuid[], p_tokens bigint[], p_statuses smallint[], p_bodies bytea[],
    p_firsts int[], p_lasts int[], p_names text[], p_values bytea[]
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
            scope_key := p_keys[i];
            token := p_tokens[i];
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
