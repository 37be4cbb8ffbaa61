//! The consumer: each round, a bounded number of pending entries idle past the claim time
//! (its own included) and then new ones, so pending entries never starve new ones; each entry
//! applied once and acknowledged (`XACK`) only after its effect committed or it was
//! dead-lettered.

use std::time::Duration;

use redis::{AsyncCommands, RedisResult, aio::MultiplexedConnection, streams::StreamId};
use tokio::sync::watch;
use tower_idempotency::{Once, store::PostgresStore};

use crate::{
    effect::{self, Credit},
    failure::Failure,
    round::Next,
};

/// The first pause before an entry that failed transiently is tried again, in place.
const BACKOFF: Duration = Duration::from_millis(100);
/// The longest such pause: the database down for long is polled this often.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

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
    /// How long a pending entry stays untouched before it is tried again (by any consumer).
    pub(crate) claim_idle: Duration,
    /// The deliveries an entry gets before it is dead-lettered (at least 1).
    pub(crate) max_deliveries: u64,
    /// A pause inside each effect, to widen the window a crash can land in.
    pub(crate) effect_delay: Duration,
    /// Where the next scan of pending entries starts: after this id, or at the first.
    pub(crate) retry_after: Option<String>,
}

impl Consumer {
    /// Consumes until `shutdown` turns true; an entry being applied is finished first.
    pub(crate) async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> RedisResult<()> {
        self.ensure_group().await?;
        while !*shutdown.borrow() {
            let round = tokio::select! {
                round = self.next_round() => round?,
                _ = shutdown.changed() => break,
            };
            for next in round {
                if *shutdown.borrow() {
                    break;
                }
                if let Some((entry, delivered)) = self.take(next).await? {
                    self.handle(&entry, delivered, &mut shutdown).await?;
                }
            }
        }
        tracing::info!("shutting down");
        Ok(())
    }

    /// Handles one entry on its `delivered`th delivery: applied and acknowledged, dead-lettered,
    /// or left pending for a later delivery.
    async fn handle(
        &mut self,
        entry: &StreamId,
        delivered: u64,
        shutdown: &mut watch::Receiver<bool>,
    ) -> RedisResult<()> {
        if delivered > self.max_deliveries {
            // Earlier deliveries ended without an outcome: the consumer died on each, perhaps.
            let reason = format!("delivered {delivered} times without an outcome");
            return self.dead_letter(entry, delivered, &reason).await;
        }
        let credit = match parse(entry) {
            Ok(credit) => credit,
            Err(reason) => return self.dead_letter(entry, delivered, reason).await,
        };
        let Some(failure) = self.apply(entry, &credit, shutdown).await else {
            return self.ack(entry).await;
        };
        match failure {
            Failure::Permanent(reason) => self.dead_letter(entry, delivered, &reason).await,
            Failure::Unknown(error) if delivered >= self.max_deliveries => {
                let reason = format!("failed on each of {delivered} deliveries, last: {error}");
                self.dead_letter(entry, delivered, &reason).await
            }
            Failure::Unknown(error) | Failure::Transient(error) => {
                let (event, stream_id) = (&credit.event_id, &entry.id);
                tracing::warn!(
                    %event, %stream_id, delivered, %error,
                    "event not applied; left pending"
                );
                Ok(())
            }
        }
    }

    /// Applies `credit`, retrying in place while it fails transiently: `None` once it is
    /// applied (now or before), else the failure (transient only if shutting down).
    async fn apply(
        &self,
        entry: &StreamId,
        credit: &Credit,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Option<Failure> {
        let mut pause = BACKOFF;
        let (event, stream_id) = (&credit.event_id, &entry.id);
        loop {
            let delay = self.effect_delay;
            let error =
                match effect::apply(&self.once, &self.stream, stream_id, credit, delay).await {
                    Ok((balance, applied)) => {
                        tracing::info!(%event, %stream_id, balance, applied, "committed event");
                        return None;
                    }
                    Err(error) => error,
                };
            let reason = match Failure::of(&error) {
                Failure::Transient(reason) if !*shutdown.borrow() => reason,
                failure => return Some(failure),
            };
            tracing::warn!(%event, %reason, ?pause, "event not applied; retrying");
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                _ = shutdown.changed() => {}
            }
            pause = (pause * 2).min(MAX_BACKOFF);
        }
    }

    /// Acknowledges an entry that has its outcome.
    async fn ack(&mut self, entry: &StreamId) -> RedisResult<()> {
        let _: () = self
            .redis
            .xack(&self.stream, &self.group, &[&entry.id])
            .await?;
        Ok(())
    }

    /// Moves an entry that will never apply to `<stream>:dead`: every field as sent (bytes,
    /// not text), its id, its deliveries and the reason; added and acknowledged atomically.
    async fn dead_letter(
        &mut self,
        entry: &StreamId,
        delivered: u64,
        reason: &str,
    ) -> RedisResult<()> {
        tracing::warn!(stream_id = %entry.id, delivered, reason, "dead-lettering entry");
        let mut fields: Vec<(String, Vec<u8>)> = entry
            .map
            .keys()
            // Stream values are always strings, so each converts.
            .filter_map(|field| Some((field.clone(), entry.get::<Vec<u8>>(field)?)))
            .collect();
        fields.sort();
        fields.push(("dead_reason".into(), reason.into()));
        fields.push(("dead_stream_id".into(), entry.id.clone().into()));
        fields.push(("dead_deliveries".into(), delivered.to_string().into()));
        let dead = format!("{}:dead", self.stream);
        let mut pipe = redis::pipe();
        pipe.atomic()
            .xadd(&dead, "*", &fields)
            .ignore()
            .xack(&self.stream, &self.group, &[&entry.id])
            .ignore();
        pipe.query_async(&mut self.redis).await
    }

    /// The entry a round named, claimed now if it was pending, with its delivery count; `None`
    /// when another consumer took it meanwhile or it was deleted.
    async fn take(&mut self, next: Next) -> RedisResult<Option<(StreamId, u64)>> {
        Ok(match next {
            Next::New(entry) => Some((entry, 1)),
            Next::Retry { id, delivered } => self
                .claim(&id)
                .await?
                .map(|entry| (entry, delivered.saturating_add(1))),
        })
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
