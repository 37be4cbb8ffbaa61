//! The rules of a store's [`PendingLog`], for stores whose capabilities offer one.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use super::{Keys, LONG, acquire, describe, held, ok, poll, record};
use crate::{
    scope::ScopeKey,
    store::{
        Abandoned, ClaimHandle, ClaimRequest, ClaimStatus, Fence, KeyState, PendingLog,
        PendingLogError, PendingPick, Store,
    },
};

/// More than any check keeps, so a pick hands out every key due.
const EVERY: u32 = 1_000;

/// Runs the pending-log rules against `store`'s pending log, if it has one.
pub(super) async fn requests_are_kept<St: Store>(store: &St, keys: &Keys, short: Duration) {
    let Some(log) = store.capabilities().pending_log().cloned() else {
        return;
    };
    a_lapsed_key_is_picked_after_its_grace_once_and_at_most_max_attempts(store, &log, keys, short)
        .await;
    a_completed_or_released_key_is_not_pending(store, &log, keys).await;
    a_claim_never_kept_is_released_after_its_grace(store, &log, keys, short).await;
}

/// A claim made to keep its request that never kept it (its process died in between) is
/// released once its lease lapsed more than the grace ago; a kept one and one made without
/// keeping in mind are left to the pick and to their client (issue 44).
async fn a_claim_never_kept_is_released_after_its_grace<St: Store>(
    store: &St,
    log: &Arc<dyn PendingLog>,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str =
        "a claim made to keep its request that never did is released after its grace";
    let keeping = |request: ClaimRequest| ClaimRequest {
        keeps_request: true,
        ..request
    };
    let (unkept, kept) = (
        keeping(keys.request(short, LONG)),
        keeping(keys.request(short, LONG)),
    );
    let unmarked = keys.request(short, LONG);
    acquire(RULE, store, &unkept).await;
    let claim = acquire(RULE, store, &kept).await;
    keep(RULE, log, &fence(RULE, &claim), &kept, ClaimStatus::Held).await;
    acquire(RULE, store, &unmarked).await;
    answer(RULE, log.release_unkept(EVERY, LONG).await);
    in_flight(RULE, store, &unkept, "within its grace").await;
    tokio::time::sleep(short * 2).await;
    let released = answer(RULE, log.release_unkept(EVERY, short).await);
    assert!(released >= 1, "{RULE}: released {released}");
    let answer = ok(RULE, "claim", store.claim(&unkept).await);
    assert!(
        matches!(
            answer,
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ),
        "{RULE}: a released key must be new, got {}",
        describe(&answer)
    );
    for (request, what) in [(&kept, "a kept claim"), (&unmarked, "an unmarked claim")] {
        let answer = ok(RULE, "claim", store.claim(request).await);
        assert!(
            matches!(answer, KeyState::Acquired { takeover: true, .. }),
            "{RULE}: {what} must stay to be taken over, got {}",
            describe(&answer)
        );
    }
}

/// Asserts that `request`'s key is in flight.
async fn in_flight<St: Store>(rule: &str, store: &St, request: &ClaimRequest, when: &str) {
    let answer = ok(rule, "claim", store.claim(request).await);
    assert!(
        matches!(answer, KeyState::InFlight { .. }),
        "{rule}: {when}, the key must be in flight, got {}",
        describe(&answer)
    );
}

async fn a_lapsed_key_is_picked_after_its_grace_once_and_at_most_max_attempts<St: Store>(
    store: &St,
    log: &Arc<dyn PendingLog>,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "a lapsed key is picked after its grace, once a pick, at most max times";
    let request = keys.request(short, LONG);
    let stale = fence(RULE, &acquire(RULE, store, &request).await);
    keep(RULE, log, &stale, &request, ClaimStatus::Held).await;
    let pick = |max_attempts| PendingPick {
        limit: EVERY,
        grace: short,
        max_attempts,
    };
    assert!(
        picked(RULE, log, pick(2), &request.key).await.is_none(),
        "{RULE}: picked while its lease was live"
    );
    let first = poll(RULE, short, || picked(RULE, log, pick(2), &request.key)).await;
    assert_eq!(first.attempt, 1, "{RULE}");
    assert_eq!(first.request, kept_bytes(), "{RULE}: the request changed");
    assert!(
        picked(RULE, log, pick(2), &request.key).await.is_none(),
        "{RULE}: picked twice within its grace"
    );
    let second = poll(RULE, short, || picked(RULE, log, pick(2), &request.key)).await;
    assert_eq!(second.attempt, 2, "{RULE}");
    tokio::time::sleep(short * 2).await;
    assert!(
        picked(RULE, log, pick(2), &request.key).await.is_none(),
        "{RULE}: picked past its maximum attempts"
    );
    keep(RULE, log, &stale, &request, ClaimStatus::Lost).await;
}

async fn a_completed_or_released_key_is_not_pending<St: Store>(
    store: &St,
    log: &Arc<dyn PendingLog>,
    keys: &Keys,
) {
    const RULE: &str = "a completed or released key is not pending, and its request is purged";
    let completed = keys.request(LONG, LONG);
    let claim = acquire(RULE, store, &completed).await;
    keep(
        RULE,
        log,
        &fence(RULE, &claim),
        &completed,
        ClaimStatus::Held,
    )
    .await;
    assert!(
        !answer(RULE, log.finish(&completed.key).await),
        "{RULE}: in flight"
    );
    held(RULE, "complete", store.complete(&claim, &record()).await);
    assert!(
        answer(RULE, log.finish(&completed.key).await),
        "{RULE}: completed"
    );
    let released = keys.request(LONG, LONG);
    let claim = acquire(RULE, store, &released).await;
    keep(
        RULE,
        log,
        &fence(RULE, &claim),
        &released,
        ClaimStatus::Held,
    )
    .await;
    held(RULE, "release", store.release(&claim).await);
    answer(RULE, log.purge(EVERY).await);
    let pick = PendingPick {
        limit: EVERY,
        grace: Duration::from_millis(1),
        max_attempts: 5,
    };
    for request in [&completed, &released] {
        assert!(
            picked(RULE, log, pick, &request.key).await.is_none(),
            "{RULE}"
        );
    }
}

/// The claim's fence: a store with a pending log fences its claims.
fn fence<C: ClaimHandle>(rule: &str, claim: &C) -> Fence {
    claim
        .fence()
        .unwrap_or_else(|| panic!("{rule}: a store with a pending log must fence its claims"))
}

fn kept_bytes() -> Bytes {
    Bytes::from_static(b"a request kept for completion")
}

async fn keep(
    rule: &str,
    log: &Arc<dyn PendingLog>,
    fence: &Fence,
    request: &ClaimRequest,
    expected: ClaimStatus,
) {
    let status = answer(
        rule,
        log.keep(fence, &request.fingerprint, kept_bytes()).await,
    );
    assert_eq!(status, expected, "{rule}: keeping a request");
}

/// What a pick hands out for `key`, if anything.
async fn picked(
    rule: &str,
    log: &Arc<dyn PendingLog>,
    pick: PendingPick,
    key: &ScopeKey,
) -> Option<Abandoned> {
    let picked = answer(rule, log.pick(pick).await);
    picked.into_iter().find(|abandoned| abandoned.key == *key)
}

fn answer<T>(rule: &str, result: Result<T, PendingLogError>) -> T {
    result.unwrap_or_else(|error| panic!("{rule}: the pending log failed: {error}"))
}
