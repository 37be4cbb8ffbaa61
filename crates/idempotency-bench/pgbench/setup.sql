-- The tables the pgbench scripts write to: the benchmark's charges table and the store's schema.
-- psql -h 127.0.0.1 -d <scratch database> -f setup.sql
\ir charges.sql
;
CREATE SCHEMA idempotency;
\ir ../../../migrations/20261121000001_create_records.sql
\ir ../../../migrations/20261122000001_partitioned_records.sql
\ir ../../../migrations/20261123000001_uuid_scope_keys.sql
\ir ../../../migrations/20261125000001_complete_many.sql
\ir ../../../migrations/20261125000002_autovacuum_thresholds.sql
\ir ../../../migrations/20261125000003_claimants_and_ttl.sql
\ir ../../../migrations/20261125000004_settled_notifications.sql
\ir ../../../migrations/20261125000005_notify_waited_keys.sql
\ir ../../../migrations/20261126000001_steps.sql
\ir ../../../migrations/20261127000001_pending_requests.sql
\ir ../../../migrations/20261127000002_steps_recorded.sql
