//! The statements' text: claims, the fenced operations on a held claim, the group commits,
//! releases by claimant and the notifications of settled keys.

/// How a key inserted anew gets its token and generation: `apart`, a value each from the sequence
/// (a generation need only be new); `shared`, one value for both, so that a key whose generation
/// is its token is known to have started it (it found no steps to take theirs), at the cost of a
/// subquery, which only stores whose handlers use steps pay.
macro_rules! fresh {
    (token, apart) => {
        "nextval('idempotency.fencing_tokens')"
    };
    (generation, apart) => {
        "nextval('idempotency.fencing_tokens')"
    };
    (from, apart) => {
        ""
    };
    (token, shared) => {
        "n.token"
    };
    (generation, shared) => {
        "n.token"
    };
    (from, shared) => {
        "FROM (SELECT nextval('idempotency.fencing_tokens') AS token) n"
    };
}

// The claim statement, in two variants sharing their text: lease mode claims unconditionally;
// transactional mode first tries a transaction-scoped advisory lock on the key and claims only if
// it got it, so a duplicate never waits on the holder's uncommitted row (it still gets a completed
// record's replay or mismatch, which needs no lock).
//
// The key's row is read first. A key with no row is inserted (`ON CONFLICT DO NOTHING`); a row
// that is dead (past `expires_at`, or past its TTL counted from its claim and not held under a
// live lease), or in flight under a lapsed lease with the same fingerprint, is taken over by a
// conditional `UPDATE` whose row lock orders racing claimers (the loser re-checks the winner's
// version and leaves it). Otherwise the row is returned as it stands: replays and conflicts
// neither write, nor lock, nor take a transaction id. The reads share the statement's snapshot,
// so a row committed by a racing claim after the snapshot was taken can be invisible; the
// statement then returns nothing and the caller runs it again (rare, and safe: nothing was
// claimed). `$5` is the attempt's claimant: a row it finds in flight under that id is its own
// (`mine`), claimed by an earlier try whose answer was lost. A waiting duplicate's variant marks
// a claim it finds in flight as waited for (`mark`), once per claim, and says in `marked` whether
// the claim is marked, by it or before: if not, the claim settled meanwhile and its settlement
// announced nothing, so the caller reads the key again rather than waiting to be woken.
// `generation` is the claim's generation (see the migration `generations`): a takeover keeps the
// row's, a dead row's claim starts another, and an inserted key starts one (its token, when
// `fresh` is `shared`) unless `inherit` (steps in use) finds its payload's live steps a release
// left, whose generation it takes. `stepless` then says of an inserted key whether it has no steps (a `taken` row is not
// asked), so that its handler need not read them; `false` claims nothing. `keeps` marks a claim
// whose request the layer keeps for the completer (see the migration `unkept_claims`).
macro_rules! claim_statement {
    (lock: $lock:literal, mark: $mark:literal, marked: $marked:literal, gate: $gate:literal,
     existing: $existing:literal, busy: $busy:literal, fresh: $fresh:ident,
     inherit: $inherit:literal, stepless: $stepless:literal, keeps: $keeps:literal) => {
        concat!(
            "WITH ",
            $lock,
            "existing AS MATERIALIZED (
                SELECT token, takeover, fingerprint, lease_until, expires_at, created_at, claimant,
                       status, header_names, header_values, body, waited, generation
                FROM idempotency.records WHERE scope_key = $1
            ), ",
            $mark,
            "
            inserted AS (
                INSERT INTO idempotency.records
                    (scope_key, fingerprint, token, expires_at, lease_until, claimant, generation,
                     keeps_request)
                SELECT $1, $2, ",
            fresh!(token, $fresh),
            ", now() + greatest($4::interval, $3::interval), now() + $3::interval, $5, ",
            fresh!(generation, $fresh),
            ", ",
            $keeps,
            " ",
            fresh!(from, $fresh),
            " WHERE NOT EXISTS (SELECT FROM existing) ",
            $gate,
            " ON CONFLICT (scope_key) DO NOTHING
                RETURNING token, takeover, ",
            $inherit,
            " AS generation
            ),
            taken AS (
                UPDATE idempotency.records r SET
                    fingerprint   = $2,
                    token         = nextval('idempotency.fencing_tokens'),
                    takeover      = r.status IS NULL AND r.expires_at > now()
                                    AND r.created_at + $4::interval > now(),
                    created_at    = now(),
                    expires_at    = now() + greatest($4::interval, $3::interval),
                    lease_until   = now() + $3::interval,
                    completed_at  = NULL,
                    status        = NULL,
                    header_names  = NULL,
                    header_values = NULL,
                    body          = NULL,
                    claimant      = $5,
                    waited        = NULL,
                    keeps_request = ",
            $keeps,
            ",
                    generation    = CASE WHEN r.status IS NULL AND r.expires_at > now()
                                              AND r.created_at + $4::interval > now()
                                         THEN coalesce(r.generation, 0)
                                         ELSE nextval('idempotency.fencing_tokens') END
                WHERE r.scope_key = $1 AND EXISTS (SELECT FROM existing) ",
            $gate,
            " AND (r.expires_at <= now()
                       OR (r.created_at + $4::interval <= now()
                           AND (r.status IS NOT NULL OR r.lease_until <= now()))
                       OR (r.status IS NULL AND r.lease_until <= now() AND r.fingerprint = $2))
                RETURNING r.token, r.takeover, false AS stepless, r.generation
            ),
            claimed AS (SELECT token, takeover, ",
            $stepless,
            " AS stepless, generation FROM inserted
                        UNION ALL SELECT token, takeover, stepless, generation FROM taken)
            SELECT 'acquired' AS outcome, token, takeover, stepless,
                   NULL::boolean AS same_fingerprint, NULL::float8 AS lease_remaining,
                   NULL::float8 AS expires_in,
                   NULL::int2 AS status, NULL::text[] AS header_names, NULL::bytea[] AS header_values,
                   NULL::bytea AS body, NULL::boolean AS mine, NULL::boolean AS marked, generation
            FROM claimed ",
            $busy,
            " UNION ALL
            SELECT 'existing', e.token, e.takeover, false,
                   e.fingerprint = $2, extract(epoch FROM e.lease_until - now())::float8,
                   extract(epoch FROM least(e.expires_at, e.created_at + $4::interval) - now())::float8,
                   e.status, e.header_names, e.header_values, e.body,
                   coalesce(e.claimant = $5, false) AND e.status IS NULL, ",
            $marked,
            ", e.generation
            FROM existing e
            WHERE e.expires_at > now()
              AND NOT (e.created_at + $4::interval <= now()
                       AND (e.status IS NOT NULL OR e.lease_until <= now()))
              AND NOT EXISTS (SELECT FROM claimed) ",
            $existing,
        )
    };
}

pub(super) const CLAIM_LEASE: &str = claim_statement!(
    lock: "", mark: "", marked: "NULL::boolean", gate: "", existing: "", busy: "",
    fresh: apart, inherit: "generation", stepless: "false", keeps: "$6::boolean"
);

/// [`CLAIM_LEASE`] for a store whose handlers use steps: a key it inserts takes the generation
/// of its payload's steps a release left, and says whether it has any, which costs a function
/// call that apps without steps need not pay.
pub(super) const CLAIM_LEASE_STEPS: &str = claim_statement!(
    lock: "", mark: "", marked: "NULL::boolean", gate: "", existing: "", busy: "",
    fresh: shared,
    inherit: "idempotency.inherit_generation(scope_key, fingerprint, token)",
    stepless: "generation = token",
    keeps: "$6::boolean"
);

/// [`CLAIM_LEASE`] for a waiting duplicate ([`ClaimRequest::waiting`](crate::store::ClaimRequest)):
/// a claim in flight with its fingerprint and a live lease is marked `waited`, unless it is
/// already, a row update once per claim however many duplicates wait. The lease condition
/// excludes every row `taken` may update, so no row is updated twice in the statement.
pub(super) const CLAIM_LEASE_WAITING: &str = claim_statement!(
    lock: "",
    mark: "marked AS (
        UPDATE idempotency.records r SET waited = true
        WHERE r.scope_key = $1 AND r.fingerprint = $2 AND r.status IS NULL
          AND r.waited IS NOT TRUE AND r.lease_until > now() AND r.expires_at > now()
        RETURNING 1
    ),",
    marked: "EXISTS (SELECT FROM marked) OR coalesce(e.waited, false)",
    gate: "",
    existing: "",
    busy: "",
    // A waiter's key has a row: it seldom inserts one.
    fresh: apart,
    inherit: "generation",
    stepless: "false",
    keeps: "$6::boolean"
);

pub(super) const CLAIM_TRANSACTIONAL: &str = claim_statement!(
    lock: "lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($6) AS held), ",
    mark: "",
    marked: "NULL::boolean",
    gate: "AND (SELECT held FROM lock)",
    // Without the lock, only a completed record is answered: an uncommitted claim is invisible.
    existing: "AND ((SELECT held FROM lock) OR e.status IS NOT NULL)",
    busy: "UNION ALL SELECT 'busy', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                  NULL, NULL
           FROM lock WHERE NOT lock.held AND NOT EXISTS (
               SELECT FROM existing e WHERE e.status IS NOT NULL AND e.expires_at > now()
                 AND e.created_at + $4::interval > now())",
    // A transactional claim's handler has no steps, nor a request kept for completion.
    fresh: apart,
    inherit: "generation",
    stepless: "false",
    keeps: "NULL::boolean"
);

// The fenced statements, for the plain table and the partitioned one. `expires_at > now()` costs
// nothing on the plain table (a held claim has not expired) and prunes the partitioned one.
macro_rules! fenced_statements {
    ($table:literal) => {
        Fenced {
            renew: concat!(
                "UPDATE idempotency.",
                $table,
                "
                 SET lease_until = now() + $3::interval,
                     expires_at = greatest(expires_at, now() + $3::interval)
                 WHERE scope_key = $1 AND token = $2 AND status IS NULL AND expires_at > now()"
            ),
            complete: concat!("", complete!($table)),
            complete_notify: concat!(
                "WITH settled AS (",
                complete!($table),
                " RETURNING scope_key, waited) ",
                NOTIFY_WAITED!()
            ),
            complete_notify_all: concat!(
                "WITH settled AS (",
                complete!($table),
                " RETURNING scope_key) ",
                NOTIFY_SETTLED!()
            ),
            mark_waited: concat!(
                "WITH marked AS (UPDATE idempotency.",
                $table,
                " SET waited = true
                 WHERE scope_key = $1 AND status IS NULL AND waited IS NOT TRUE
                   AND lease_until > now() AND expires_at > now()
                 RETURNING 1)
                 SELECT EXISTS (SELECT FROM marked) OR EXISTS (SELECT FROM idempotency.",
                $table,
                " WHERE scope_key = $1 AND status IS NULL AND waited AND expires_at > now())
                 AS marked"
            ),
            release: concat!("", release!($table)),
            abandon: concat!("", abandon!($table)),
            abandon_notify: concat!(
                "WITH settled AS (",
                abandon!($table),
                " RETURNING scope_key, waited) ",
                NOTIFY_WAITED!()
            ),
            release_notify: concat!(
                "WITH settled AS (",
                release!($table),
                " RETURNING scope_key, waited) ",
                NOTIFY_WAITED!()
            ),
            release_notify_all: concat!(
                "WITH settled AS (",
                release!($table),
                " RETURNING scope_key) ",
                NOTIFY_SETTLED!()
            ),
        }
    };
}

macro_rules! complete {
    ($table:literal) => {
        concat!(
            "UPDATE idempotency.",
            $table,
            "
             SET status = $3, header_names = $4, header_values = $5, body = $6,
                 lease_until = NULL, completed_at = now(),
                 keeps_request = CASE WHEN keeps_request THEN false ELSE keeps_request END
             WHERE scope_key = $1 AND token = $2 AND status IS NULL AND expires_at > now()"
        )
    };
}

/// Ends a held claim's lease now: the next request takes the key over.
macro_rules! abandon {
    ($table:literal) => {
        concat!(
            "UPDATE idempotency.",
            $table,
            " SET lease_until = now()
             WHERE scope_key = $1 AND token = $2 AND status IS NULL AND expires_at > now()"
        )
    };
}

macro_rules! release {
    ($table:literal) => {
        concat!(
            "DELETE FROM idempotency.",
            $table,
            "
             WHERE scope_key = $1 AND token = $2 AND status IS NULL AND expires_at > now()"
        )
    };
}

/// Tells the listeners of every instance that the keys of `settled` settled, when the
/// statement's transaction commits (see [`PostgresStore::capabilities`](crate::store::Store::capabilities)).
macro_rules! NOTIFY_SETTLED {
    () => {
        "SELECT pg_notify('idempotency_settled', scope_key::text) FROM settled"
    };
}

/// [`NOTIFY_SETTLED`] for the keys of `settled` that a duplicate marked as waited for, still one
/// row for each key settled: the count says whether the claim was held. A key nobody waits for
/// sends nothing, so its commit does not queue behind every other notifying commit.
macro_rules! NOTIFY_WAITED {
    () => {
        "SELECT CASE WHEN waited THEN pg_notify('idempotency_settled', scope_key::text) END
         FROM settled"
    };
}

/// The channel of [`NOTIFY_SETTLED`]: its payload is a record's key.
pub(super) const SETTLED_CHANNEL: &str = "idempotency_settled";

/// [`NOTIFY_SETTLED`] for one key, on its own (after a rollback, which notifies nothing).
pub(super) const NOTIFY_ONE: &str = "SELECT pg_notify('idempotency_settled', $1::text)";

/// Lease mode's group commit of claims (see [`PostgresStore`]): inserts the keys that have no
/// row, each with its own fencing token, and returns them with their generation, as
/// [`CLAIM_LEASE`]'s (with `shared` tokens, a key whose generation is its token has no steps). The keys come sorted, so two batches racing for the same keys take them in the same
/// order and cannot deadlock. A plain `INSERT`, whose answer says `INSERT` as it always did.
macro_rules! claim_new_keys {
    (apart) => {
        "INSERT INTO idempotency.records
                 (scope_key, fingerprint, token, expires_at, lease_until, claimant, generation,
                  keeps_request)
             SELECT c.key, c.fingerprint, nextval('idempotency.fencing_tokens'),
                    now() + greatest(c.ttl, c.lease) * interval '1 microsecond',
                    now() + c.lease * interval '1 microsecond', c.claimant,
                    nextval('idempotency.fencing_tokens'), c.keeps
             FROM unnest($1::uuid[], $2::bytea[], $3::int8[], $4::int8[], $5::uuid[], $6::bool[])
                 AS c(key, fingerprint, lease, ttl, claimant, keeps)
             ON CONFLICT (scope_key) DO NOTHING
             RETURNING scope_key, token, generation"
    };
    (shared) => {
        "INSERT INTO idempotency.records
                 (scope_key, fingerprint, token, expires_at, lease_until, claimant, generation,
                  keeps_request)
             SELECT c.key, c.fingerprint, c.token,
                    now() + greatest(c.ttl, c.lease) * interval '1 microsecond',
                    now() + c.lease * interval '1 microsecond', c.claimant, c.token, c.keeps
             FROM (SELECT u.*, nextval('idempotency.fencing_tokens') AS token
                   FROM unnest($1::uuid[], $2::bytea[], $3::int8[], $4::int8[], $5::uuid[],
                               $6::bool[])
                       AS u(key, fingerprint, lease, ttl, claimant, keeps)) c
             ON CONFLICT (scope_key) DO NOTHING
             RETURNING scope_key, token,
                       idempotency.inherit_generation(scope_key, fingerprint, token) AS generation"
    };
}

pub(super) const CLAIM_NEW_KEYS: &str = claim_new_keys!(apart);

/// [`CLAIM_NEW_KEYS`] taking the generation of each key's steps a release left, as
/// [`CLAIM_LEASE_STEPS`].
pub(super) const CLAIM_NEW_KEYS_STEPS: &str = claim_new_keys!(shared);

/// Lease mode's group commit of completions: `complete` for many claims, each fenced by its
/// token, by the migrations' `idempotency.complete_many` (one primary-key `UPDATE` per record,
/// its plan cached for the session and never a table scan). Header names and values come as
/// two flat arrays, each record's headers being the slice `[first:last]` of them (empty when
/// `last < first`).
pub(super) const COMPLETE_MANY: &str =
    "SELECT scope_key, token FROM idempotency.complete_many($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// The statements that act on a held claim; `_notify` variants also wake the duplicates that
/// marked the key as waited for.
pub(super) struct Fenced {
    pub(super) renew: &'static str,
    pub(super) complete: &'static str,
    pub(super) complete_notify: &'static str,
    /// Announces the key whether or not it was marked: transactional mode's claim is invisible
    /// until it commits, so no waiter can mark it.
    pub(super) complete_notify_all: &'static str,
    pub(super) release: &'static str,
    pub(super) release_notify: &'static str,
    /// [`release_notify`](Self::release_notify) for every key, as `complete_notify_all`.
    pub(super) release_notify_all: &'static str,
    /// Marks a key in flight as waited for unless it is already (not fenced: any duplicate
    /// may), and says whether it is marked: `false` when no claim of it is in flight any more.
    pub(super) mark_waited: &'static str,
    /// Ends a stopped handler's lease now, so the next request takes the key over at once.
    pub(super) abandon: &'static str,
    /// [`abandon`](Self::abandon), announcing the key if a waiter marked it: the waiters take
    /// it over at once rather than at their next read.
    pub(super) abandon_notify: &'static str,
}

pub(super) const FENCED: Fenced = fenced_statements!("records");
pub(super) const FENCED_PARTITIONED: Fenced = fenced_statements!("partitioned_records");

pub(super) const CLAIM_PARTITIONED: &str =
    "SELECT * FROM idempotency.claim_partitioned($1, $2, $3, $4, $6, $5, $7, $8)";

/// Undoes what a claim attempt may have claimed, found by its claimant id (see
/// [`ClaimAttempt`]): only a row still in flight under that id, so never another's claim. A key
/// it inserted (or a dead row it replaced) is deleted; a claim in flight it took over is given
/// back as found, its lease ended, since its first holder may have run in part: deleting it
/// would hide that holder's steps and kept request from the completer.
macro_rules! release_claimant {
    ($table:literal) => {
        concat!(
            "WITH released AS (
                 DELETE FROM idempotency.",
            $table,
            " WHERE scope_key = $1 AND claimant = $2 AND status IS NULL AND NOT takeover
                 RETURNING 1
             ), given_back AS (
                 UPDATE idempotency.",
            $table,
            " SET lease_until = least(lease_until, now())
                 WHERE scope_key = $1 AND claimant = $2 AND status IS NULL AND takeover
                 RETURNING 1
             )
             SELECT 1 FROM released UNION ALL SELECT 1 FROM given_back"
        )
    };
}

pub(super) const RELEASE_CLAIMANT: &str = release_claimant!("records");
pub(super) const RELEASE_CLAIMANT_PARTITIONED: &str = release_claimant!("partitioned_records");
