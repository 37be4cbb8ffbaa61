//! The consumer: its own pending entries first (a restart after a crash), then entries other
//! consumers left pending past the idle time (`XAUTOCLAIM`), then new ones (`XREADGROUP`);
//! each applied once and acknowledged (`XACK`) only after its effect committed.

use std::time::Duration;

use redis::{
    AsyncCommands, RedisResult,
    aio::MultiplexedConnection,
    streams::{
        StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
    },
};
use tokio::sync::watch;
use tower_idempotency::{Once, OnceError, store::PostgresStore};

use crate::effect::{self, Credit};

/// Entries read at once.
const BATCH: usize = 16;
/// How long a read for new entries blocks.
const BLOCK_MS: usize = 1_000;
/// How long any Redis reply may take: longer than a blocking read waits (the client's default,
/// 500 ms, is shorter, and ended an idle consumer).
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_millis(BLOCK_MS as u64 + 5_000);
/// The pause after a batch in which nothing could be acknowledged (the database down, or an
/// event still held by a consumer that died and whose transaction is not yet rolled back).
const BACKOFF: Duration = Duration::from_millis(100);

/// What the consumer reads from and writes to.
pub(crate) struct Consumer {
    /// The Redis connection.
    pub(crate) redis: MultiplexedConnection,
    /// The idempotent calls, on a transactional store.
    pub(crate) once: Once<PostgresStore>,
    /// The stream.
    pub(crate) stream: String,
    /// The consumer group.
    pub(crate) group: String,
    /// This consumer's name in the group.
    pub(crate) name: String,
    /// How long an entry stays pending with another consumer before this one claims it.
    pub(crate) claim_idle: Duration,
    /// A pause inside each effect, to widen the window a crash can land in.
    pub(crate) effect_delay: Duration,
}

/// What became of one entry.
#[derive(Debug, PartialEq, Eq)]
enum Handled {
    /// Applied, found applied, or dead-lettered: acknowledged.
    Acked,
    /// Left pending, to be tried again.
    Pending,
}

impl Consumer {
    /// Creates the group (and the stream) if they do not exist.
    pub(crate) async fn ensure_group(&mut self) -> RedisResult<()> {
        let created: RedisResult<()> = self
            .redis
            .xgroup_create_mkstream(&self.stream, &self.group, "0")
            .await;
        match created {
            Err(error) if error.code() == Some("BUSYGROUP") => Ok(()),
            other => other,
        }
    }

    /// Consumes until `shutdown` turns true; an entry being applied is finished first.
    pub(crate) async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> RedisResult<()> {
        self.ensure_group().await?;
        while !*shutdown.borrow() {
            let entries = tokio::select! {
                entries = self.next_entries() => entries?,
                _ = shutdown.changed() => break,
            };
            let mut acked = 0;
            for entry in &entries {
                if self.handle(entry).await? == Handled::Acked {
                    acked += 1;
                }
            }
            if acked < entries.len() {
                tokio::time::sleep(BACKOFF).await;
            }
        }
        tracing::info!("shutting down");
        Ok(())
    }

    /// This consumer's own pending entries, else others' idle ones, else new ones.
    async fn next_entries(&mut self) -> RedisResult<Vec<StreamId>> {
        let own = self.read(StreamReadOptions::default(), "0").await?;
        if !own.is_empty() {
            return Ok(own);
        }
        let options = StreamAutoClaimOptions::default().count(BATCH);
        let idle = self.claim_idle.as_millis() as u64;
        let claimed: StreamAutoClaimReply = self
            .redis
            .xautoclaim_options(&self.stream, &self.group, &self.name, idle, "0-0", options)
            .await?;
        if !claimed.deleted_ids.is_empty() {
            let deleted = &claimed.deleted_ids;
            let _: () = self.redis.xack(&self.stream, &self.group, deleted).await?;
        }
        if !claimed.claimed.is_empty() {
            return Ok(claimed.claimed);
        }
        self.read(StreamReadOptions::default().block(BLOCK_MS), ">")
            .await
    }

    async fn read(&mut self, options: StreamReadOptions, id: &str) -> RedisResult<Vec<StreamId>> {
        let options = options.count(BATCH).group(&self.group, &self.name);
        let reply: Option<StreamReadReply> = self
            .redis
            .xread_options(&[&self.stream], &[id], &options)
            .await?;
        let keys = reply.map(|reply| reply.keys).unwrap_or_default();
        Ok(keys.into_iter().flat_map(|key| key.ids).collect())
    }

    /// Applies one entry once, and acknowledges it once that committed or it can never apply.
    async fn handle(&mut self, entry: &StreamId) -> RedisResult<Handled> {
        let credit = match parse(entry) {
            Ok(credit) => credit,
            Err(reason) => return self.dead_letter(entry, reason).await,
        };
        let applied = effect::apply(
            &self.once,
            &self.stream,
            &entry.id,
            &credit,
            self.effect_delay,
        )
        .await;
        match applied {
            Ok((balance, applied)) => {
                tracing::info!(event = %credit.event_id, stream_id = %entry.id, balance, applied, "committed event");
                self.ack(entry).await
            }
            Err(OnceError::Mismatch) => {
                self.dead_letter(entry, "event id reused with another payload")
                    .await
            }
            Err(OnceError::InvalidKey(_)) => self.dead_letter(entry, "invalid event id").await,
            Err(OnceError::InFlight) => {
                tracing::info!(event = %credit.event_id, "event in flight elsewhere; left pending");
                Ok(Handled::Pending)
            }
            Err(error) => {
                tracing::warn!(event = %credit.event_id, error = &error as &dyn std::error::Error, "event not applied; left pending");
                Ok(Handled::Pending)
            }
        }
    }

    async fn ack(&mut self, entry: &StreamId) -> RedisResult<Handled> {
        let _: () = self
            .redis
            .xack(&self.stream, &self.group, &[&entry.id])
            .await?;
        Ok(Handled::Acked)
    }

    /// Moves an entry that can never apply to `<stream>:dead`, with the reason, and
    /// acknowledges it.
    async fn dead_letter(&mut self, entry: &StreamId, reason: &str) -> RedisResult<Handled> {
        tracing::warn!(stream_id = %entry.id, reason, "dead-lettering entry");
        let mut fields: Vec<(String, String)> = entry
            .map
            .keys()
            .filter_map(|field| Some((field.clone(), entry.get::<String>(field)?)))
            .collect();
        fields.push(("dead_reason".into(), reason.into()));
        fields.push(("dead_stream_id".into(), entry.id.clone()));
        let dead = format!("{}:dead", self.stream);
        let _: String = self.redis.xadd(&dead, "*", &fields).await?;
        self.ack(entry).await
    }
}

/// The credit an entry carries: fields `event_id`, `account` and `amount` (an integer).
fn parse(entry: &StreamId) -> Result<Credit, &'static str> {
    let field = |name: &str| entry.get::<String>(name);
    let (Some(event_id), Some(account), Some(amount)) =
        (field("event_id"), field("account"), field("amount"))
    else {
        return Err("missing event_id, account or amount");
    };
    let amount = amount.parse().map_err(|_| "amount is not an integer")?;
    Ok(Credit {
        event_id,
        account,
        amount,
    })
}
