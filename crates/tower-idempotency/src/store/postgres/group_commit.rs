//! Lease mode's group commit: concurrent requests' claims of new keys, and their completions,
//! written together, one statement and one commit per batch (see [`PostgresStore`]).

use std::{collections::HashMap, time::Duration};

use sqlx::{PgPool, Postgres, Row, pool::PoolConnection, postgres::PgRow, types::Uuid};

use super::{
    batch::Batcher,
    sql::{CLAIM_NEW_KEYS, CLAIM_NEW_KEYS_STEPS, COMPLETE_MANY},
    statement::{interval, stored_key},
};
use crate::{
    record::Record,
    store::{ClaimRequest, ClaimStatus, Fence},
};

/// Lease mode's claims of new keys, each with its attempt's claimant, batched.
pub(super) type ClaimBatcher = Batcher<(ClaimRequest, Uuid), Batched<Option<NewClaim>>>;

/// A key a batch of [`CLAIM_NEW_KEYS`] claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct NewClaim {
    /// The key and its new token.
    pub(super) fence: Fence,
    /// No steps were recorded for the key and the claim's payload.
    pub(super) stepless: bool,
}

/// The most operations one batch writes.
pub(super) const MAX_BATCH: usize = 256;

/// Records larger than this (body and headers) are stored by a statement of their own, so a
/// batch stays under `MAX_BATCH` × 64 KiB however large the responses an app keeps.
pub(super) const MAX_BATCHED_RECORD: usize = 64 * 1024;

/// What became of an operation sent in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Batched<T> {
    /// Written, with this answer.
    Done(T),
    /// Not written: do it alone (its key was in the batch twice, or PostgreSQL refused the
    /// batch as a whole).
    Alone,
    /// The batch timed out.
    TimedOut,
}

/// Writes a batch of [`CLAIM_NEW_KEYS`] (taking each key's generation from the steps a release
/// left, and saying whether it has any, when `steps` are in use): for each request its new claim, `None` when its key has a row already. Bounded by
/// [`FLUSH_BOUND`], not by the store's timeout: a caller that stops waiting has its claim
/// released when the batch's answer comes (see `claim_lease`).
pub(super) async fn claim_new_keys(
    pool: PgPool,
    timeout: Duration,
    steps: bool,
    mut writer: BatchWriter,
    batch: Vec<(ClaimRequest, Uuid)>,
) -> (BatchWriter, Vec<Batched<Option<NewClaim>>>) {
    crate::metrics::batch("claim", batch.len());
    let keys: Vec<Uuid> = batch.iter().map(|(r, _)| stored_key(&r.key)).collect();
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by_key(|&i| keys[i]);
    // A key twice in one batch: the second one claims alone, after the first.
    let mut alone = vec![false; batch.len()];
    for pair in order.windows(2) {
        if keys[pair[0]] == keys[pair[1]] {
            alone[pair[1]] = true;
        }
    }
    let sent: Vec<usize> = order.into_iter().filter(|&i| !alone[i]).collect();
    let micros = |d: Duration| i64::try_from(interval(d).as_micros()).unwrap_or(i64::MAX);
    let query = sqlx::query(if steps {
        CLAIM_NEW_KEYS_STEPS
    } else {
        CLAIM_NEW_KEYS
    })
    .bind(sent.iter().map(|&i| keys[i]).collect::<Vec<_>>())
    .bind(
        sent.iter()
            .map(|&i| &batch[i].0.fingerprint.as_bytes()[..])
            .collect::<Vec<_>>(),
    )
    .bind(
        sent.iter()
            .map(|&i| micros(batch[i].0.lease))
            .collect::<Vec<_>>(),
    )
    .bind(
        sent.iter()
            .map(|&i| micros(batch[i].0.ttl))
            .collect::<Vec<_>>(),
    )
    .bind(sent.iter().map(|&i| batch[i].1).collect::<Vec<_>>())
    .bind(
        sent.iter()
            .map(|&i| batch[i].0.keeps_request)
            .collect::<Vec<_>>(),
    );
    let bound = timeout.max(FLUSH_BOUND);
    let read = |row: &PgRow| {
        let (token, generation): (i64, i64) = (row.try_get(1).ok()?, row.try_get(2).ok()?);
        // A key whose steps were looked for has none when it starts its own generation.
        let stepless = steps && generation == token;
        Some((row.try_get(0).ok()?, (token, stepless, generation)))
    };
    let tokens = match written(query, &pool, bound, &mut writer, read).await {
        Ok(tokens) => tokens,
        Err(failed) => return (writer, vec![failed; batch.len()]),
    };
    let claimed = batch
        .iter()
        .zip(keys)
        .zip(alone)
        .map(|(((request, _), key), alone)| {
            if alone {
                Batched::Alone
            } else {
                let claimed = tokens.get(&key);
                Batched::Done(claimed.map(|&(token, stepless, generation)| NewClaim {
                    fence: Fence {
                        key: request.key,
                        token,
                        generation,
                    },
                    stepless,
                }))
            }
        })
        .collect();
    (writer, claimed)
}

/// How long a batch of claims may take before the flusher gives up on it. Its callers stop
/// waiting after the store's timeout; the flusher waits longer so that the claims it wrote can
/// be released by their tokens. A batch given up on leaves each caller's [`ClaimAttempt`] to
/// release its claim by claimant.
pub(super) const FLUSH_BOUND: Duration = Duration::from_secs(30);

/// Writes a batch of [`COMPLETE_MANY`]: for each claim, whether it still held its key.
pub(super) async fn complete_many(
    pool: PgPool,
    timeout: Duration,
    notify: bool,
    mut writer: BatchWriter,
    batch: Vec<(Fence, Record)>,
) -> (BatchWriter, Vec<Batched<ClaimStatus>>) {
    crate::metrics::batch("complete", batch.len());
    let mut keys = Vec::with_capacity(batch.len());
    let mut tokens = Vec::with_capacity(batch.len());
    let mut statuses = Vec::with_capacity(batch.len());
    let mut bodies = Vec::with_capacity(batch.len());
    let (mut firsts, mut lasts) = (
        Vec::with_capacity(batch.len()),
        Vec::with_capacity(batch.len()),
    );
    let (mut names, mut values) = (Vec::new(), Vec::new());
    for (lease, record) in &batch {
        keys.push(stored_key(&lease.key));
        tokens.push(lease.token);
        statuses.push(record.status().as_u16() as i16);
        bodies.push(record.body().map(|b| &b[..]));
        // 1-based and inclusive, as PostgreSQL's array slices are.
        firsts.push(names.len() as i32 + 1);
        for (name, value) in record.headers() {
            names.push(name.as_str());
            values.push(value.as_bytes());
        }
        lasts.push(names.len() as i32);
    }
    let query = sqlx::query(COMPLETE_MANY)
        .bind(&keys[..])
        .bind(tokens)
        .bind(statuses)
        .bind(bodies)
        .bind(firsts)
        .bind(lasts)
        .bind(names)
        .bind(values)
        .bind(notify);
    let read = |row: &PgRow| Some((row.try_get(0).ok()?, row.try_get(1).ok()?));
    let held = match written(query, &pool, timeout, &mut writer, read).await {
        Ok(held) => held,
        Err(failed) => return (writer, vec![failed; batch.len()]),
    };
    let completed = batch
        .iter()
        .zip(&keys)
        .map(|((lease, _), key)| {
            Batched::Done(if held.get(key) == Some(&lease.token) {
                ClaimStatus::Held
            } else {
                ClaimStatus::Lost
            })
        })
        .collect();
    (writer, completed)
}

/// The connection a batch flusher keeps from one batch to the next while batches keep coming:
/// a pool checkout costs a round trip each way (sqlx pings a connection when it is taken and
/// again when it is given back), which back-to-back batches skip. It goes back to the pool
/// when the queue empties, after [`BATCHES_PER_CHECKOUT`] batches (so the pool's lifetime
/// limits still apply under constant load), and is closed after any failure.
#[derive(Default)]
pub(super) struct BatchWriter {
    pub(super) connection: Option<PoolConnection<Postgres>>,
    pub(super) batches: u32,
}

/// How many batches a flusher writes on one pool connection before giving it back.
pub(super) const BATCHES_PER_CHECKOUT: u32 = 256;

/// Runs a batch statement returning a row for each key it wrote, which `read` turns into the
/// key and what it says of it (its token, at least). Otherwise what each of the batch's
/// operations does instead: a timeout is every operation's timeout; any other failure (a
/// deadlock with another instance's batch, a lost connection, a row it cannot read) sends each
/// to do its operation alone, where it succeeds or fails on its own.
pub(super) async fn written<T, V>(
    query: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
    pool: &PgPool,
    timeout: Duration,
    writer: &mut BatchWriter,
    read: impl Fn(&PgRow) -> Option<(Uuid, V)>,
) -> Result<HashMap<Uuid, V>, Batched<T>> {
    // Taken out, so that the writer starts afresh whatever goes wrong below.
    let BatchWriter {
        connection: held,
        batches,
    } = std::mem::take(writer);
    let run = async {
        let mut connection = match held {
            Some(connection) => connection,
            None => pool.acquire().await?,
        };
        match query.fetch_all(&mut *connection).await {
            Ok(rows) => Ok((connection, rows)),
            Err(error) => {
                // The connection's state is unknown: don't hand it to anyone else.
                connection.close_on_drop();
                Err(error)
            }
        }
    };
    let rows = match tokio::time::timeout(timeout, run).await {
        Ok(Ok((connection, rows))) => {
            if batches + 1 < BATCHES_PER_CHECKOUT {
                *writer = BatchWriter {
                    connection: Some(connection),
                    batches: batches + 1,
                };
            }
            rows
        }
        Ok(Err(error)) => {
            tracing::debug!(%error, "a batch of idempotency store operations failed; each goes alone");
            return Err(Batched::Alone);
        }
        Err(_) => return Err(Batched::TimedOut),
    };
    rows.iter()
        .map(read)
        .collect::<Option<_>>()
        .ok_or(Batched::Alone)
}
