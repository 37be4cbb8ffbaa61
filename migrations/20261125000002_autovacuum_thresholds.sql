-- tower-idempotency: autovacuum first looks at a records table after 1,000 changes, not 50.
--
-- Why: each pooled connection keeps a generic plan of the store's statements (sqlx prepares
-- them), made from the table's statistics at the time and kept until the table is next analyzed
-- or vacuumed. Planned from statistics that say the table is a page or two, those plans read the
-- table sequentially; planned from none yet, or from a few pages more, they look the key up in
-- the primary key. By default autovacuum analyzes a new table after 50 changes, so an
-- application freshly deployed under load would plan its claims against a table of about 50
-- rows, and scan it whole for every claim, completion and replay while it grew, until the next
-- analyze (up to `autovacuum_naptime`, a minute by default: 6 ms a lookup at 100,000 rows,
-- against under 0.05 ms by key). From 1,000 changes on, the table is too large for a scan to win
-- (about 7 pages of claims suffice). On a large table the scale factors (10 % and 20 % of the
-- rows) decide when autovacuum comes, as before.
--
-- The partitions of `partitioned_records` get the same when they are created.

ALTER TABLE idempotency.records
    SET (autovacuum_analyze_threshold = 1000, autovacuum_vacuum_threshold = 1000);

DO $$
DECLARE
    partition regclass;
BEGIN
    FOR partition IN
        SELECT inhrelid::regclass FROM pg_inherits
        WHERE inhparent = 'idempotency.partitioned_records'::regclass
    LOOP
        EXECUTE format(
            'ALTER TABLE %s SET (autovacuum_analyze_threshold = 1000, autovacuum_vacuum_threshold = 1000)',
            partition
        );
    END LOOP;
END
$$;
