//! How a third party implements [`Store`]: idempotency records in Redis, held to the protocol
//! by `tower_idempotency::store::conformance`.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use redis_store::RedisStore;
//! use tower_idempotency::IdempotencyLayer;
//!
//! # async fn run() -> Result<(), redis::RedisError> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379", "idem").await?;
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(|| async { "charged once" }))
//!     .layer(IdempotencyLayer::new(store));
//! # Ok(()) }
//! ```
//!
//! Each scoped key is one Redis hash, `{prefix}:{key in hex}`, written only by the Lua scripts
//! below, so every step of the protocol is one atomic script run: the claim never reads and
//! then writes from the client. The scripts take the time from Redis (`TIME`), not from the app,
//! so app instances whose clocks drift still agree on when a lease lapses. A record's key
//! expires in Redis when its TTL does, so no reaper is needed ([`ExpiredDeletion`] is for
//! stores whose records stay until deleted).
//!
//! | field | meaning |
//! |---|---|
//! | `fingerprint` | the request's fingerprint (32 bytes) |
//! | `token` | the fencing token of the current claim, from the `{prefix}:tokens` counter |
//! | `generation` | the key's [generation](tower_idempotency::store::Fence::generation): the token of the claim that started it |
//! | `state` | `flight` or `done` |
//! | `lease_until`, `expires_at` | Redis time in milliseconds |
//! | `record` | the completed response ([`Record::to_bytes`]) |
//!
//! It is an example, not a product: it runs against one Redis server (the two keys a claim
//! touches are not in one hash slot, so Redis Cluster would refuse the scripts), and Redis only
//! keeps what its persistence settings keep: with the default snapshotting, a Redis crash
//! forgets the claims and records of the last minutes, and their keys run again.
//!
//! [`ExpiredDeletion`]: tower_idempotency::store::ExpiredDeletion

use std::{
    fmt::{self, Write as _},
    time::Duration,
};

use bytes::Bytes;
use redis::{Script, Value, aio::ConnectionManager};
use tower_idempotency::{
    Record, RecordBytesError,
    store::{ClaimRequest, ClaimStatus, Fence, KeyState, Store},
};

/// Claims a key, or says why not. `KEYS`: the record, the token counter. `ARGV`: fingerprint,
/// lease and TTL in milliseconds. Answers `{0, token, takeover, generation}` (acquired; a
/// takeover keeps the key's generation, any other claim starts one), `{1, lease left}` (in
/// flight), `{2, expires in, record}` (completed) or `{3}` (another fingerprint).
const CLAIM: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = redis.call('HMGET', KEYS[1], 'fingerprint', 'state', 'lease_until', 'expires_at', 'record', 'generation')
local takeover = 0
if held[1] and tonumber(held[4]) > now then
    if held[1] ~= ARGV[1] then
        return {3}
    end
    if held[2] == 'done' then
        return {2, tonumber(held[4]) - now, held[5]}
    end
    if tonumber(held[3]) > now then
        return {1, tonumber(held[3]) - now}
    end
    takeover = 1
end
local token = redis.call('INCR', KEYS[2])
local generation = token
if takeover == 1 then
    generation = tonumber(held[6]) or 0
end
local lease = tonumber(ARGV[2])
local expires_at = now + math.max(tonumber(ARGV[3]), lease)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[1], 'token', token, 'state', 'flight',
           'lease_until', now + lease, 'expires_at', expires_at, 'generation', generation)
redis.call('PEXPIREAT', KEYS[1], expires_at)
return {0, token, takeover, generation}
";

/// The preamble of the fenced scripts: `now`, and whether `ARGV[1]`'s claim still holds the
/// record `KEYS[1]` (in flight, not expired, same token). Each script answers 1 if it acted on
/// the claim, 0 if the claim was lost.
macro_rules! fenced {
    ($action:literal) => {
        concat!(
            r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = redis.call('HMGET', KEYS[1], 'token', 'state', 'expires_at')
if not held[1] or held[1] ~= ARGV[1] or held[2] ~= 'flight' or tonumber(held[3]) <= now then
    return 0
end
",
            $action,
            "
return 1
"
        )
    };
}

/// Extends the lease to `ARGV[2]` ms from now, and the record's life with it if need be.
const RENEW: &str = fenced!(
    r"
local lease_until = now + tonumber(ARGV[2])
local expires_at = math.max(tonumber(held[3]), lease_until)
redis.call('HSET', KEYS[1], 'lease_until', lease_until, 'expires_at', expires_at)
redis.call('PEXPIREAT', KEYS[1], expires_at)"
);

/// Stores the response `ARGV[2]`.
const COMPLETE: &str = fenced!(
    r"
redis.call('HSET', KEYS[1], 'state', 'done', 'record', ARGV[2])
redis.call('HDEL', KEYS[1], 'lease_until')"
);

/// Frees the key.
const RELEASE: &str = fenced!("redis.call('DEL', KEYS[1])");

/// A [`Store`] in Redis (see the [crate documentation](crate)).
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: String,
    scripts: Scripts,
}

#[derive(Clone)]
struct Scripts {
    claim: Script,
    renew: Script,
    complete: Script,
    release: Script,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to the Redis at `url` and keeps its records under `prefix`. The connection
    /// reconnects by itself; while Redis is away, every call fails and the layer answers `503`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, redis::RedisError> {
        let connection = redis::Client::open(url)?.get_connection_manager().await?;
        Ok(Self {
            connection,
            prefix: prefix.to_owned(),
            scripts: Scripts {
                claim: Script::new(CLAIM),
                renew: Script::new(RENEW),
                complete: Script::new(COMPLETE),
                release: Script::new(RELEASE),
            },
        })
    }

    fn record_key(&self, key: &tower_idempotency::ScopeKey) -> String {
        let mut name = String::with_capacity(self.prefix.len() + 65);
        name.push_str(&self.prefix);
        name.push(':');
        for byte in key.as_bytes() {
            write!(name, "{byte:02x}").expect("writing to a String cannot fail");
        }
        name
    }

    /// Runs a fenced script on `claim`'s record.
    async fn fenced(
        &self,
        script: &Script,
        claim: &Fence,
        arg: impl redis::ToRedisArgs,
    ) -> Result<ClaimStatus, RedisStoreError> {
        let acted: i64 = script
            .key(self.record_key(&claim.key))
            .arg(claim.token)
            .arg(arg)
            .invoke_async(&mut self.connection.clone())
            .await?;
        Ok(if acted == 1 {
            ClaimStatus::Held
        } else {
            ClaimStatus::Lost
        })
    }
}

impl Store for RedisStore {
    type Claim = Fence;
    type Error = RedisStoreError;

    async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<Fence>, RedisStoreError> {
        let answer: Vec<Value> = self
            .scripts
            .claim
            .key(self.record_key(&request.key))
            .key(format!("{}:tokens", self.prefix))
            .arg(&request.fingerprint.as_bytes()[..])
            .arg(millis(request.lease))
            .arg(millis(request.ttl))
            .invoke_async(&mut self.connection.clone())
            .await?;
        let int = |i: usize| match answer.get(i) {
            Some(Value::Int(n)) => Ok(*n),
            other => Err(RedisStoreError::Corrupt(format!(
                "expected an integer at {i}, got {other:?}"
            ))),
        };
        let remaining = |i| int(i).map(|ms| Duration::from_millis(ms.max(0).unsigned_abs()));
        Ok(match int(0)? {
            0 => KeyState::Acquired {
                claim: Fence {
                    key: request.key,
                    token: int(1)?,
                    generation: int(3)?,
                },
                takeover: int(2)? == 1,
            },
            1 => KeyState::InFlight {
                lease_remaining: Some(remaining(1)?),
            },
            2 => {
                let Some(Value::BulkString(bytes)) = answer.get(2) else {
                    return Err(RedisStoreError::Corrupt(
                        "a completed key without its record".into(),
                    ));
                };
                KeyState::Completed {
                    record: Record::from_bytes(Bytes::copy_from_slice(bytes))?,
                    expires_in: Some(remaining(1)?),
                }
            }
            3 => KeyState::Mismatch,
            other => {
                return Err(RedisStoreError::Corrupt(format!(
                    "unknown answer {other} from the claim script"
                )));
            }
        })
    }

    async fn renew(&self, claim: &Fence, lease: Duration) -> Result<ClaimStatus, RedisStoreError> {
        self.fenced(&self.scripts.renew, claim, millis(lease)).await
    }

    async fn complete(
        &self,
        claim: &Fence,
        record: &Record,
    ) -> Result<ClaimStatus, RedisStoreError> {
        self.fenced(&self.scripts.complete, claim, &record.to_bytes()[..])
            .await
    }

    async fn release(&self, claim: &Fence) -> Result<ClaimStatus, RedisStoreError> {
        self.fenced(&self.scripts.release, claim, 0).await
    }
}

/// What can go wrong: Redis could not be reached or refused, or a record could not be read.
#[derive(Debug)]
pub enum RedisStoreError {
    /// Redis could not be reached, or answered with an error.
    Redis(redis::RedisError),
    /// An answer that this store did not write.
    Corrupt(String),
    /// A stored record that is not in [`Record::to_bytes`]'s format.
    Record(RecordBytesError),
}

impl fmt::Display for RedisStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Redis(_) => f.write_str("Redis failed"),
            Self::Corrupt(what) => write!(f, "unreadable idempotency record in Redis: {what}"),
            Self::Record(_) => f.write_str("unreadable idempotency record in Redis"),
        }
    }
}

impl std::error::Error for RedisStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Redis(error) => Some(error),
            Self::Corrupt(_) => None,
            Self::Record(error) => Some(error),
        }
    }
}

impl From<RecordBytesError> for RedisStoreError {
    fn from(error: RecordBytesError) -> Self {
        Self::Record(error)
    }
}

impl From<redis::RedisError> for RedisStoreError {
    fn from(error: redis::RedisError) -> Self {
        Self::Redis(error)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
