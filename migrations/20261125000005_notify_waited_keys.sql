-- tower-idempotency: only keys that someone waits for are announced when they settle.
--
-- PostgreSQL serialises the commits of every transaction that sent a notification, so a
-- completion that announced every key queued behind all the others' WAL flushes (pgbench: 16
-- notifying completions at once ran at 0.44x the rate of quiet ones). A duplicate that waits now
-- marks the row `waited` each time it finds the key in flight (an autocommitted UPDATE of a row in
-- flight); completions and releases announce a key only when its row is marked. The row lock
-- orders the two: a completion that commits first leaves no row in flight to mark, so the waiter
-- reads the key again; one that commits after finds the mark. Transactional mode's claims are
-- invisible until they commit, so its completions still announce every key.
--
-- Adding a nullable column rewrites nothing. Instances of the previous version keep working
-- beside new ones: their waiters do not mark rows, so until they are replaced a new instance's
-- completion of a key they wait for wakes them by their once-a-second read instead.

ALTER TABLE idempotency.records ADD COLUMN waited boolean;
ALTER TABLE idempotency.partitioned_records ADD COLUMN waited boolean;

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
            completed_at = now()
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
