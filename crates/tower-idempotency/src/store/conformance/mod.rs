//! Checks that a [`Store`] keeps the protocol: for authors of third-party stores.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{MemoryStore, conformance};
//!
//! // In your store's tests, with your store in place of `MemoryStore`:
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let store = MemoryStore::new();
//! conformance::check(&store, Duration::from_secs(1)).await;
//! conformance::check_expired_deletion(&store, Duration::from_secs(1)).await;
//! # }
//! ```
//!
//! [`check`] runs every rule of the [protocol](super#the-protocol) against the store and panics,
//! naming the rule and what the store answered, at the first one it breaks:
//!
//! * a new key is acquired; a duplicate is in flight; another payload is a mismatch, while in
//!   flight, after its lease lapsed and once completed;
//! * a completed key replays its record exactly: status, headers in order (repeated and
//!   non-UTF-8 values too), body bytes (empty, binary, or not kept at all);
//! * a released key is free for any payload, and the released claim can no longer write;
//! * a takeover keeps the key's [generation](super::Fence::generation), a claim of an expired
//!   key starts another, whatever its payload;
//! * a lapsed lease is taken over (`takeover: true`) and the stale holder is fenced out of
//!   [`renew`](Store::renew), [`complete`](Store::complete) and [`release`](Store::release);
//!   a renewed lease does not lapse; an [abandoned](Store::abandon) claim is taken over at
//!   once, without waiting for its lease;
//! * a completed claim cannot be completed again, released or renewed: the record stays;
//! * a record past its TTL is new, whatever its payload; a claim in flight outlives its TTL
//!   while its lease is live (renewed too), and is new once the lease lapses;
//! * 64 concurrent [`claim`](Store::claim)s of one key acquire it exactly once, whether they
//!   carry the same payload or not, and never disturb other keys;
//! * for a store whose capabilities offer a [`StepLog`](super::StepLog): steps come back in
//!   order after a takeover, a stale holder records none (a holder whose lease lapsed and that
//!   nobody took over records them, as it completes), they survive a release for the same
//!   payload only (in its generation), and they expire with their record: a claim of the key
//!   after it expired reads none; a claim that finds them does not say it has none
//!   ([`ClaimHandle::may_have_steps`](super::ClaimHandle::may_have_steps)).
//!
//! * for a store whose capabilities offer a [`PendingLog`](super::PendingLog): a lapsed key is
//!   picked after its grace, once a pick and at most its maximum attempts; a completed or
//!   released key is not pending; a claim made to keep its request
//!   ([`ClaimRequest::keeps_request`](super::ClaimRequest::keeps_request)) that never kept it is
//!   released after its lease and the grace, a kept or unmarked one is not.
//!
//! [`check_expired_deletion`] adds the rules of [`ExpiredDeletion`]: batches are bounded,
//! expired records go, live ones (and claims whose lease outlives their TTL) stay, and steps
//! stay as long as their record (a takeover late in the TTL keeps them past their own expiry).
//!
//! Both run inside a tokio runtime; a multi-threaded one (`#[tokio::test(flavor =
//! "multi_thread")]`) makes the racing claims race on threads, not just interleave.
//! [`examples/redis-store`](https://github.com/tower-idempotency/tower-idempotency/tree/main/examples/redis-store)
//! in the repository is a whole third-party store tested this way.
//!
//! # Time
//!
//! Leases and TTLs must run out for some rules to be seen, so the checks wait. `short` is the
//! lease and TTL those checks give: the shortest span your store tells apart reliably (one
//! second suits stores whose clock is a database's `now()`; less makes the checks faster and
//! more sensitive to a loaded machine). The checks wait with `tokio::time`, so a store whose
//! clock is `tokio::time` too, as [`MemoryStore`](super::MemoryStore)'s is, runs them in no
//! real time under `tokio::time::pause`. Otherwise [`check`] takes about sixteen times `short`,
//! [`check_expired_deletion`] seven.
//!
//! The checks use keys of their own, random per run, so they can share a store (and its
//! database) with anything else, but they must have it to themselves for
//! [`check_expired_deletion`]'s counts: it deletes every expired record it finds.
//!
//! They check the lease protocol. A store whose claims are transactions, as
//! [`PostgresStore`](super::PostgresStore)'s transactional mode is, frees a key when its
//! transaction ends rather than when a lease lapses; the repository's HTTP suite covers it.

use std::{
    hash::{BuildHasher, RandomState},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use sha2::{Digest, Sha256};

use super::{ClaimRequest, ClaimStatus, ExpiredDeletion, KeyState, Store};
use crate::{chain::Chain, fingerprint::Fingerprint, record::Record, scope::ScopeKey};

/// A lease and TTL long enough never to run out during a check.
pub(super) const LONG: Duration = Duration::from_secs(3600);

/// How many requests race for one key.
pub(super) const RACERS: usize = 64;

/// Runs every rule of the store protocol against `store`; panics at the first one broken.
///
/// `short` is the lease and TTL of the checks that wait for one to run out (see
/// [Time](self#time)).
///
/// # Panics
///
/// When the store breaks a rule or fails, with the rule and the store's answer.
pub async fn check<St: Store + Clone>(store: &St, short: Duration) {
    let keys = Keys::new();
    a_new_key_is_acquired_and_its_duplicates_refused(store, &keys).await;
    a_completed_key_replays_its_record_exactly(store, &keys).await;
    a_released_key_is_free_and_its_claim_fenced_out(store, &keys).await;
    a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out(store, &keys, short).await;
    a_renewed_lease_does_not_lapse(store, &keys, short).await;
    an_abandoned_claim_is_taken_over_at_once(store, &keys).await;
    a_completed_claim_is_final(store, &keys).await;
    an_expired_record_is_new(store, &keys, short).await;
    a_claim_past_its_ttl_is_in_flight_until_its_lease_lapses(store, &keys, short).await;
    racing_requests_acquire_a_key_once(store, &keys).await;
    steps::steps_are_kept(store, &keys, short).await;
    pending::requests_are_kept(store, &keys, short).await;
}

/// Runs the rules of [`ExpiredDeletion`] against `store`; panics at the first one broken.
///
/// Leaves the store without expired records. Run it on a store that no other test is writing
/// expired records to meanwhile.
///
/// # Panics
///
/// When the store breaks a rule or fails, with the rule and the store's answer.
pub async fn check_expired_deletion<St: ExpiredDeletion>(store: &St, short: Duration) {
    const RULE: &str = "expired records are deleted in bounded batches, live ones kept";
    const EXPIRING: usize = 7;
    const BATCH: u32 = 3;
    let keys = Keys::new();
    let mut expiring = Vec::new();
    // Long enough a TTL that a record is completed well before it expires.
    let ttl = short * 3;
    for i in 0..EXPIRING {
        let request = keys.request(short, ttl);
        let claim = acquire(RULE, store, &request).await;
        // Completed records and claims left in flight both expire.
        if i % 2 == 0 {
            held(RULE, "complete", store.complete(&claim, &record()).await);
        }
        expiring.push(request);
    }
    let live = keys.request(LONG, LONG);
    let claim = acquire(RULE, store, &live).await;
    held(RULE, "complete", store.complete(&claim, &record()).await);
    let outliving = keys.request(LONG, short);
    acquire(RULE, store, &outliving).await;

    tokio::time::sleep(ttl + short).await;
    let mut deleted = 0;
    let mut batches = 0;
    loop {
        let n = ok(RULE, "delete_expired", store.delete_expired(BATCH).await);
        assert!(
            n <= u64::from(BATCH),
            "{RULE}: delete_expired({BATCH}) deleted {n} records"
        );
        deleted += n;
        batches += 1;
        if n < u64::from(BATCH) {
            break;
        }
        assert!(
            batches < 10_000,
            "{RULE}: delete_expired({BATCH}) still returned full batches after {batches} calls"
        );
    }
    assert!(
        deleted >= EXPIRING as u64,
        "{RULE}: {EXPIRING} records expired, but delete_expired deleted {deleted}"
    );
    assert!(
        matches!(
            ok(RULE, "claim", store.claim(&live).await),
            KeyState::Completed { .. }
        ),
        "{RULE}: a record within its TTL was deleted"
    );
    let answer = ok(RULE, "claim", store.claim(&outliving).await);
    assert!(
        matches!(answer, KeyState::InFlight { .. }),
        "{RULE}: a claim whose lease outlives its TTL must stay in flight, got {}",
        describe(&answer)
    );
    for request in &expiring {
        let answer = ok(RULE, "claim", store.claim(request).await);
        assert!(
            matches!(
                answer,
                KeyState::Acquired {
                    takeover: false,
                    ..
                }
            ),
            "{RULE}: a deleted record's key must be new, got {}",
            describe(&answer)
        );
    }
    steps::steps_live_as_long_as_their_record(store, &keys, short).await;
}

mod pending;
mod rules;
mod steps;

use rules::{
    a_claim_past_its_ttl_is_in_flight_until_its_lease_lapses, a_completed_claim_is_final,
    a_completed_key_replays_its_record_exactly,
    a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out,
    a_new_key_is_acquired_and_its_duplicates_refused,
    a_released_key_is_free_and_its_claim_fenced_out, a_renewed_lease_does_not_lapse,
    an_abandoned_claim_is_taken_over_at_once, an_expired_record_is_new,
    racing_requests_acquire_a_key_once,
};

/// Calls `attempt` until it answers, every tenth of `short`, for at most twenty `short`s plus
/// ten seconds.
pub(super) async fn poll<T, F: Future<Output = Option<T>>>(
    rule: &str,
    short: Duration,
    mut attempt: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + short * 20 + Duration::from_secs(10);
    loop {
        if let Some(answer) = attempt().await {
            return answer;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{rule}: the store never saw a lease or TTL of {short:?} run out"
        );
        tokio::time::sleep(short / 10).await;
    }
}

/// Fresh random keys, so that runs sharing a store never meet.
pub(super) struct Keys {
    seed: u64,
    next: AtomicU64,
}

impl Keys {
    fn new() -> Self {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            seed: RandomState::new().hash_one(now),
            next: AtomicU64::new(0),
        }
    }

    /// A claim of a new key.
    fn request(&self, lease: Duration, ttl: Duration) -> ClaimRequest {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut hasher = Sha256::new();
        hasher.update(self.seed.to_le_bytes());
        hasher.update(n.to_le_bytes());
        ClaimRequest {
            key: ScopeKey::from_bytes(hasher.finalize().into()),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease,
            ttl,
            waiting: false,
            keeps_request: false,
        }
    }
}

/// The same claim for a request with another payload.
pub(super) fn other_payload(request: &ClaimRequest) -> ClaimRequest {
    ClaimRequest {
        fingerprint: Fingerprint::from_bytes([2; 32]),
        ..request.clone()
    }
}

/// The plain record most checks keep.
pub(super) fn record() -> Record {
    Record::from_parts(
        StatusCode::CREATED,
        HeaderMap::new(),
        Some(Bytes::from_static(b"{\"id\":\"ch_1\"}")),
    )
}

/// Records that exercise every part a store must keep exactly.
pub(super) fn records() -> Vec<Record> {
    let mut headers = HeaderMap::new();
    let mut add = |name: &'static str, value: &[u8]| {
        headers.append(
            HeaderName::from_static(name),
            HeaderValue::from_bytes(value).expect("a valid header value"),
        );
    };
    add("content-type", b"application/json");
    add("link", b"</v1/charges?page=2>; rel=\"next\"");
    add("location", b"/v1/charges/ch_1");
    add("link", b"</v1/charges?page=1>; rel=\"prev\"");
    add("x-binary", &[0x80, 0xfe, b'a', 0xff]);
    add("etag", b"\"33a64df5\"");
    add("link", b"</v1/charges>; rel=\"index\"");
    add("x-empty", b"");
    let binary: Vec<u8> = (0..=255).cycle().take(70_000).collect();
    vec![
        Record::from_parts(StatusCode::OK, headers.clone(), Some(record_body())),
        Record::from_parts(StatusCode::PAYMENT_REQUIRED, headers, Some(binary.into())),
        Record::from_parts(StatusCode::NO_CONTENT, HeaderMap::new(), Some(Bytes::new())),
        // A body too large to keep: the record says so, and must not come back with one.
        Record::from_parts(StatusCode::OK, HeaderMap::new(), None),
        Record::from_parts(
            StatusCode::SEE_OTHER,
            HeaderMap::new(),
            Some("\0\r\n".into()),
        ),
    ]
}

pub(super) fn record_body() -> Bytes {
    Bytes::from_static("{\"id\":\"ch_1\",\"description\":\"caf\u{e9} \u{1f600}\"}".as_bytes())
}

pub(super) async fn acquire<St: Store>(
    rule: &str,
    store: &St,
    request: &ClaimRequest,
) -> St::Claim {
    match ok(rule, "claim", store.claim(request).await) {
        KeyState::Acquired { claim, .. } => claim,
        other => panic!(
            "{rule}: a new key must be acquired, got {}",
            describe(&other)
        ),
    }
}

pub(super) fn ok<T, E: std::error::Error + 'static>(
    rule: &str,
    operation: &str,
    result: Result<T, E>,
) -> T {
    result.unwrap_or_else(|error| panic!("{rule}: {operation} failed: {}", Chain(&error)))
}

pub(super) fn held<E: std::error::Error + 'static>(
    rule: &str,
    operation: &str,
    result: Result<ClaimStatus, E>,
) {
    let must = "of a held claim must take effect";
    answered(rule, operation, result, ClaimStatus::Held, must);
}

pub(super) fn lost<E: std::error::Error + 'static>(
    rule: &str,
    operation: &str,
    result: Result<ClaimStatus, E>,
) {
    let must = "of a claim no longer held must write nothing";
    answered(rule, operation, result, ClaimStatus::Lost, must);
}

fn answered<E: std::error::Error + 'static>(
    rule: &str,
    operation: &str,
    result: Result<ClaimStatus, E>,
    expected: ClaimStatus,
    must: &str,
) {
    let status = ok(rule, operation, result);
    assert_eq!(status, expected, "{rule}: {operation} {must}");
}

/// An answer, without its claim (a store's claim type need not be `Debug`).
pub(super) fn describe<C>(answer: &KeyState<C>) -> String {
    match answer {
        KeyState::Acquired { takeover, .. } => format!("Acquired {{ takeover: {takeover} }}"),
        KeyState::InFlight { lease_remaining } => {
            format!("InFlight {{ lease_remaining: {lease_remaining:?} }}")
        }
        KeyState::Completed { record, expires_in } => format!(
            "Completed {{ status: {}, expires_in: {expires_in:?} }}",
            record.status()
        ),
        KeyState::Mismatch => "Mismatch".to_owned(),
    }
}
