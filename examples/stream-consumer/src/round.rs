//! What one round reads: at most [`RETRIES`] pending entries idle past the claim time, found
//! with `XPENDING` (their delivery counts with them) and claimed one by one as they are tried,
//! then at most [`BATCH`] new entries (`XREADGROUP >`). New entries are read every round, so
//! entries that keep failing can delay them by one bounded batch, never stop them.

use std::time::Duration;

use redis::{
    AsyncCommands, RedisResult,
    streams::{
        StreamClaimReply, StreamId, StreamPendingCountReply, StreamReadOptions, StreamReadReply,
    },
};

use crate::consumer::Consumer;

/// New entries read at once.
const BATCH: usize = 16;
/// Pending entries tried again in one round.
const RETRIES: usize = 8;
/// How long a read for new entries blocks when no pending entry is due.
const BLOCK_MS: usize = 1_000;
/// How long any Redis reply may take: longer than a blocking read waits (the client's default,
/// 500 ms, is shorter, and ended an idle consumer).
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_millis(BLOCK_MS as u64 + 5_000);

/// An entry a round hands out.
pub(crate) enum Next {
    /// Read new: its first delivery.
    New(StreamId),
    /// Pending and idle: to be claimed before it is tried, its deliveries so far.
    Retry {
        /// The entry's id.
        id: String,
        /// How often it was delivered before this claim.
        delivered: u64,
    },
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

    /// The due pending entries, then new ones; waits for new ones only when none was due.
    pub(crate) async fn next_round(&mut self) -> RedisResult<Vec<Next>> {
        let mut round = self.due().await?;
        let block = round.is_empty().then_some(BLOCK_MS);
        let fresh = self.read_new(block).await?;
        round.extend(fresh.into_iter().map(Next::New));
        Ok(round)
    }

    /// Pending entries idle past the claim time, whoever holds them, scanned from where the
    /// last round stopped so that a run of failing entries cannot hide the ones after it.
    async fn due(&mut self) -> RedisResult<Vec<Next>> {
        let start = match &self.retry_after {
            Some(id) => format!("({id}"),
            None => "-".to_owned(),
        };
        let pending: StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("IDLE")
            .arg(millis(self.claim_idle))
            .arg(start)
            .arg("+")
            .arg(RETRIES)
            .query_async(&mut self.redis)
            .await?;
        self.retry_after = match pending.ids.last() {
            Some(last) if pending.ids.len() == RETRIES => Some(last.id.clone()),
            _ => None,
        };
        let due = pending.ids.into_iter().map(|entry| Next::Retry {
            delivered: u64::try_from(entry.times_delivered).unwrap_or(u64::MAX),
            id: entry.id,
        });
        Ok(due.collect())
    }

    /// Claims a pending entry for this consumer if it is still idle past the claim time (the
    /// claim counts a delivery): `None` if another consumer took it first, or it was deleted.
    pub(crate) async fn claim(&mut self, id: &str) -> RedisResult<Option<StreamId>> {
        let idle = millis(self.claim_idle);
        let claimed: StreamClaimReply = self
            .redis
            .xclaim(&self.stream, &self.group, &self.name, idle, &[id])
            .await?;
        Ok(claimed.ids.into_iter().next())
    }

    /// At most [`BATCH`] entries never delivered to the group, waiting `block` ms for one.
    async fn read_new(&mut self, block: Option<usize>) -> RedisResult<Vec<StreamId>> {
        let mut options = StreamReadOptions::default()
            .count(BATCH)
            .group(&self.group, &self.name);
        if let Some(block) = block {
            options = options.block(block);
        }
        let reply: Option<StreamReadReply> = self
            .redis
            .xread_options(&[&self.stream], &[">"], &options)
            .await?;
        let keys = reply.map(|reply| reply.keys).unwrap_or_default();
        Ok(keys.into_iter().flat_map(|key| key.ids).collect())
    }
}

/// A duration as the milliseconds Redis takes (a signed 64-bit count), saturated.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
