//! The rules of a store's [`StepLog`], for stores whose capabilities offer one.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use super::{Keys, LONG, acquire, describe, held, ok, other_payload, poll};
use crate::store::{
    ClaimHandle, ClaimRequest, ClaimStatus, ExpiredDeletion, Fence, KeyState, StepLog,
    StepLogError, StepRecord, Store,
};

/// Runs the step rules against `store`'s step log, if it has one.
pub(super) async fn steps_are_kept<St: Store>(store: &St, keys: &Keys, short: Duration) {
    let Some(log) = store.capabilities().step_log().cloned() else {
        return;
    };
    steps_survive_a_takeover_and_a_stale_holder_records_nothing(store, &log, keys, short).await;
    a_lapsed_holder_records_steps_as_it_completes(store, &log, keys, short).await;
    steps_survive_a_release_for_the_same_payload_only(store, &log, keys).await;
    steps_expire_with_their_record(store, &log, keys, short).await;
    steps_found_by_a_later_claim_live_as_long_as_it(store, &log, keys, short).await;
}

async fn steps_survive_a_takeover_and_a_stale_holder_records_nothing<St: Store>(
    store: &St,
    log: &Arc<dyn StepLog>,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "steps survive a takeover, in order, and a stale holder records nothing";
    let request = keys.request(short, LONG);
    let stale = fence(RULE, &acquire(RULE, store, &request).await);
    for name in ["one", "two"] {
        record(RULE, log, &stale, &request, name, ClaimStatus::Held).await;
    }
    tokio::time::sleep(short).await;
    let fresh = poll(RULE, short, || async {
        match ok(RULE, "claim", store.claim(&request).await) {
            KeyState::Acquired { claim, .. } => Some(claim),
            KeyState::InFlight { .. } => None,
            other => panic!("{RULE}: expected a takeover, got {}", describe(&other)),
        }
    })
    .await;
    let fresh = found(RULE, &fresh);
    assert_eq!(
        names(RULE, log, &fresh, &request).await,
        ["one", "two"],
        "{RULE}"
    );
    record(RULE, log, &stale, &request, "three", ClaimStatus::Lost).await;
    assert_eq!(
        names(RULE, log, &fresh, &request).await,
        ["one", "two"],
        "{RULE}"
    );
    record(RULE, log, &fresh, &request, "three", ClaimStatus::Held).await;
    let all = names(RULE, log, &fresh, &request).await;
    assert_eq!(all, ["one", "two", "three"], "{RULE}");
}

/// The step fence is the completion's: a holder whose lease lapsed, and whom no request took
/// over, still completes its key, so it still records its steps (issue 44).
async fn a_lapsed_holder_records_steps_as_it_completes<St: Store>(
    store: &St,
    log: &Arc<dyn StepLog>,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "a holder whose lease lapsed, not taken over, records steps and completes";
    let request = keys.request(short, LONG);
    let claim = acquire(RULE, store, &request).await;
    let lapsed = fence(RULE, &claim);
    tokio::time::sleep(short * 2).await;
    record(RULE, log, &lapsed, &request, "one", ClaimStatus::Held).await;
    held(
        RULE,
        "complete",
        store.complete(&claim, &super::record()).await,
    );
    record(RULE, log, &lapsed, &request, "two", ClaimStatus::Lost).await;
}

async fn steps_survive_a_release_for_the_same_payload_only<St: Store>(
    store: &St,
    log: &Arc<dyn StepLog>,
    keys: &Keys,
) {
    const RULE: &str = "steps survive a release, for the same payload only";
    let request = keys.request(LONG, LONG);
    let claim = acquire(RULE, store, &request).await;
    let released = fence(RULE, &claim);
    record(RULE, log, &released, &request, "one", ClaimStatus::Held).await;
    held(RULE, "release", store.release(&claim).await);
    record(RULE, log, &released, &request, "two", ClaimStatus::Lost).await;
    let again = acquire(RULE, store, &request).await;
    let again = found(RULE, &again);
    assert_eq!(
        again.generation, released.generation,
        "{RULE}: a claim after a release that left steps keeps their generation"
    );
    assert_eq!(names(RULE, log, &again, &request).await, ["one"], "{RULE}");
    let claim = store.claim(&request).await;
    assert!(
        matches!(ok(RULE, "claim", claim), KeyState::InFlight { .. }),
        "{RULE}: the key is held again"
    );
    let other = other_payload(&request);
    let stored = log.recorded(&again, &other.fingerprint).await;
    assert!(
        answer(RULE, stored).is_empty(),
        "{RULE}: another payload has no steps"
    );
}

/// A key claimed again after it expired, with the same payload, is a new operation: a new
/// generation, which reads none of the old one's steps, even those not deleted yet (the record
/// was renewed past its TTL, so they expire after the key does).
async fn steps_expire_with_their_record<St: Store>(
    store: &St,
    log: &Arc<dyn StepLog>,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "steps expire with their record: a claim after it reads none of them";
    let request = keys.request(short, short);
    let claim = acquire(RULE, store, &request).await;
    let first = fence(RULE, &claim);
    record(RULE, log, &first, &request, "one", ClaimStatus::Held).await;
    held(RULE, "renew", store.renew(&claim, short * 3).await);
    record(RULE, log, &first, &request, "two", ClaimStatus::Held).await;
    held(
        RULE,
        "complete",
        store.complete(&claim, &super::record()).await,
    );
    tokio::time::sleep(short).await;
    let new = poll(RULE, short, || async {
        match ok(RULE, "claim", store.claim(&request).await) {
            KeyState::Acquired { claim, .. } => Some(claim),
            _ => None,
        }
    })
    .await;
    let new = fence(RULE, &new);
    assert_ne!(
        new.generation, first.generation,
        "{RULE}: a claim after the key expired starts a new generation"
    );
    let left = names(RULE, log, &new, &request).await;
    assert!(
        left.is_empty(),
        "{RULE}: steps {left:?} outlived their record"
    );
}

/// Steps live as long as their record, not as the claim that recorded them: a takeover late in
/// the key's TTL keeps its record past the steps' own expiry, and them with it, through the
/// expiry of steps (issue 44).
pub(super) async fn steps_live_as_long_as_their_record<St: ExpiredDeletion>(
    store: &St,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "steps live as long as their record, not as the claim that recorded them";
    let Some(log) = store.capabilities().step_log().cloned() else {
        return;
    };
    let request = keys.request(short, short * 3);
    let stale = fence(RULE, &acquire(RULE, store, &request).await);
    record(RULE, &log, &stale, &request, "one", ClaimStatus::Held).await;
    tokio::time::sleep(short).await;
    let fresh = poll(RULE, short, || async {
        match ok(RULE, "claim", store.claim(&request).await) {
            KeyState::Acquired { claim, .. } => Some(claim),
            KeyState::InFlight { .. } => None,
            other => panic!("{RULE}: expected a takeover, got {}", describe(&other)),
        }
    })
    .await;
    let fresh = found(RULE, &fresh);
    // Past the step's own expiry, within the record's.
    tokio::time::sleep(short * 2).await;
    while ok(RULE, "delete_expired", store.delete_expired(1_000).await) >= 1_000 {}
    let kept = names(RULE, &log, &fresh, &request).await;
    assert_eq!(kept, ["one"], "{RULE}: the takeover lost them");
}

/// A key released and claimed again under a longer TTL: the steps the new claim found must not
/// expire with the old claim, or a takeover after that would run them again.
async fn steps_found_by_a_later_claim_live_as_long_as_it<St: Store>(
    store: &St,
    log: &Arc<dyn StepLog>,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "steps found by a later claim live as long as it";
    let first = keys.request(short, short * 2);
    let claim = acquire(RULE, store, &first).await;
    record(
        RULE,
        log,
        &fence(RULE, &claim),
        &first,
        "one",
        ClaimStatus::Held,
    )
    .await;
    held(RULE, "release", store.release(&claim).await);
    let later = ClaimRequest {
        lease: LONG,
        ttl: LONG,
        ..first
    };
    let again = found(RULE, &acquire(RULE, store, &later).await);
    assert_eq!(names(RULE, log, &again, &later).await, ["one"], "{RULE}");
    tokio::time::sleep(short * 3).await;
    let left = names(RULE, log, &again, &later).await;
    assert_eq!(
        left,
        ["one"],
        "{RULE}: the steps expired with the released claim"
    );
}

/// The claim's fence: a store with a step log fences its lease-mode claims.
fn fence<C: ClaimHandle>(rule: &str, claim: &C) -> Fence {
    claim
        .fence()
        .unwrap_or_else(|| panic!("{rule}: a store with a step log must fence its claims"))
}

/// The fence of a claim whose key has steps: the claim must not say it has none
/// ([`ClaimHandle::may_have_steps`]), or its handler would run them again.
fn found<C: ClaimHandle>(rule: &str, claim: &C) -> Fence {
    assert!(
        claim.may_have_steps(),
        "{rule}: the claim of a key with steps says it has none"
    );
    fence(rule, claim)
}

async fn record(
    rule: &str,
    log: &Arc<dyn StepLog>,
    fence: &Fence,
    request: &ClaimRequest,
    name: &str,
    expected: ClaimStatus,
) {
    let step = StepRecord {
        name: name.to_owned(),
        output: Bytes::from(format!("\"{name}\"")),
    };
    let status = answer(rule, log.record(fence, &request.fingerprint, &step).await);
    assert_eq!(status, expected, "{rule}: recording step {name}");
}

async fn names(
    rule: &str,
    log: &Arc<dyn StepLog>,
    fence: &Fence,
    request: &ClaimRequest,
) -> Vec<String> {
    let steps = answer(rule, log.recorded(fence, &request.fingerprint).await);
    for step in &steps {
        let expected = format!("\"{}\"", step.name);
        assert_eq!(
            step.output,
            expected.as_bytes(),
            "{rule}: step output changed"
        );
    }
    steps.into_iter().map(|step| step.name).collect()
}

fn answer<T>(rule: &str, result: Result<T, StepLogError>) -> T {
    result.unwrap_or_else(|error| panic!("{rule}: the step log failed: {error}"))
}
