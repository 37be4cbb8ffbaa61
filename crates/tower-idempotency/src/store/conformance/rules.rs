//! The rules [`check`](super::check) holds a store to, one function each.

use std::time::Duration;

use http::{HeaderMap, StatusCode};

use super::{
    Keys, LONG, RACERS, acquire, describe, held, lost, ok, other_payload, poll, record, records,
};
use crate::{
    record::Record,
    store::{ClaimHandle, ClaimRequest, KeyState, Store},
};

pub(super) async fn a_new_key_is_acquired_and_its_duplicates_refused<St: Store>(
    store: &St,
    keys: &Keys,
) {
    const RULE: &str =
        "a new key is acquired, its duplicate is in flight, another payload a mismatch";
    let request = keys.request(LONG, LONG);
    let answer = ok(RULE, "claim", store.claim(&request).await);
    assert!(
        matches!(
            answer,
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ),
        "{RULE}: a new key must be acquired without takeover, got {}",
        describe(&answer)
    );
    let answer = ok(RULE, "claim", store.claim(&request).await);
    match answer {
        KeyState::InFlight {
            lease_remaining: Some(remaining),
        } => assert!(
            remaining <= request.lease,
            "{RULE}: the lease has {remaining:?} left, more than the {:?} it was given",
            request.lease
        ),
        KeyState::InFlight {
            lease_remaining: None,
        } => {}
        other => panic!(
            "{RULE}: a duplicate of a claim in flight must be in flight, got {}",
            describe(&other)
        ),
    }
    another_payload_is_a_mismatch(RULE, store, &request, "in flight").await;
}

pub(super) async fn a_completed_key_replays_its_record_exactly<St: Store>(store: &St, keys: &Keys) {
    const RULE: &str = "a completed key replays its record exactly";
    for (i, kept) in records().into_iter().enumerate() {
        let request = keys.request(LONG, LONG);
        let claim = acquire(RULE, store, &request).await;
        held(RULE, "complete", store.complete(&claim, &kept).await);
        for _ in 0..2 {
            match ok(RULE, "claim", store.claim(&request).await) {
                KeyState::Completed { record, expires_in } => {
                    assert_eq!(record, kept, "{RULE}: record {i} came back changed");
                    let order = |r: &Record| {
                        r.headers()
                            .iter()
                            .map(|(n, v)| (n.clone(), v.clone()))
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(
                        order(&record),
                        order(&kept),
                        "{RULE}: record {i}'s headers came back in another order"
                    );
                    if let Some(expires_in) = expires_in {
                        assert!(
                            expires_in <= request.ttl,
                            "{RULE}: the record expires in {expires_in:?}, beyond its TTL of {:?}",
                            request.ttl
                        );
                    }
                }
                other => panic!(
                    "{RULE}: a completed key must replay, got {}",
                    describe(&other)
                ),
            }
        }
        another_payload_is_a_mismatch(RULE, store, &request, "completed").await;
    }
}

pub(super) async fn a_released_key_is_free_and_its_claim_fenced_out<St: Store>(
    store: &St,
    keys: &Keys,
) {
    const RULE: &str = "a released key is free for any payload and its claim fenced out";
    let request = keys.request(LONG, LONG);
    let released = acquire(RULE, store, &request).await;
    held(RULE, "release", store.release(&released).await);
    let other = other_payload(&request);
    let answer = ok(RULE, "claim", store.claim(&other).await);
    let KeyState::Acquired {
        claim: next,
        takeover: false,
    } = answer
    else {
        panic!(
            "{RULE}: a released key must be new to another payload, got {}",
            describe(&answer)
        );
    };
    fenced_out(RULE, store, &released).await;
    held(RULE, "complete", store.complete(&next, &record()).await);
    replays_the_record(RULE, store, &other).await;
}

pub(super) async fn a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out<St: Store>(
    store: &St,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "a lapsed lease is taken over and the stale holder fenced out";
    let request = keys.request(short, LONG);
    let stale = acquire(RULE, store, &request).await;
    tokio::time::sleep(short).await;
    // Until the store sees the lease as lapsed, a duplicate is in flight.
    let (fresh, takeover) = poll(RULE, short, || async {
        match ok(RULE, "claim", store.claim(&request).await) {
            KeyState::Acquired { claim, takeover } => Some((claim, takeover)),
            KeyState::InFlight { .. } => None,
            other => panic!(
                "{RULE}: a claim in flight must be in flight or taken over, got {}",
                describe(&other)
            ),
        }
    })
    .await;
    assert!(
        takeover,
        "{RULE}: acquiring a key whose holder's lease lapsed must say `takeover: true`"
    );
    same_generation(RULE, &stale, &fresh, true);
    another_payload_is_a_mismatch(RULE, store, &request, "taken over").await;
    fenced_out(RULE, store, &stale).await;
    held(RULE, "complete", store.complete(&fresh, &record()).await);
    replays_the_record(RULE, store, &request).await;

    // Another payload may not take over a lapsed lease: the key is still that request's.
    let request = keys.request(short, LONG);
    acquire(RULE, store, &request).await;
    tokio::time::sleep(short * 2).await;
    another_payload_is_a_mismatch(RULE, store, &request, "whose lease lapsed").await;
}

pub(super) async fn an_abandoned_claim_is_taken_over_at_once<St: Store>(store: &St, keys: &Keys) {
    const RULE: &str = "an abandoned claim is taken over at once";
    let request = keys.request(LONG, LONG);
    let stopped = acquire(RULE, store, &request).await;
    held(RULE, "abandon", store.abandon(&stopped).await);
    // Its lease was long: only the abandonment frees the key now.
    match ok(RULE, "claim", store.claim(&request).await) {
        KeyState::Acquired {
            claim,
            takeover: true,
        } => {
            same_generation(RULE, &stopped, &claim, true);
            fenced_out(RULE, store, &stopped).await;
            held(RULE, "complete", store.complete(&claim, &record()).await);
        }
        other => panic!(
            "{RULE}: the retry of a stopped handler's key must take it over (`takeover: true`), \
             got {}",
            describe(&other)
        ),
    }
    replays_the_record(RULE, store, &request).await;
}

pub(super) async fn a_renewed_lease_does_not_lapse<St: Store>(
    store: &St,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "a renewed lease does not lapse";
    let request = keys.request(short, LONG);
    let claim = acquire(RULE, store, &request).await;
    held(RULE, "renew", store.renew(&claim, LONG).await);
    tokio::time::sleep(short * 2).await;
    let answer = ok(RULE, "claim", store.claim(&request).await);
    assert!(
        matches!(answer, KeyState::InFlight { .. }),
        "{RULE}: a claim renewed for {LONG:?} must be in flight after its first lease, got {}",
        describe(&answer)
    );
    held(RULE, "release", store.release(&claim).await);
}

pub(super) async fn a_completed_claim_is_final<St: Store>(store: &St, keys: &Keys) {
    const RULE: &str = "a completed claim cannot be completed again, released or renewed";
    let request = keys.request(LONG, LONG);
    let claim = acquire(RULE, store, &request).await;
    held(RULE, "complete", store.complete(&claim, &record()).await);
    let other = Record::from_parts(StatusCode::INTERNAL_SERVER_ERROR, HeaderMap::new(), None);
    lost(RULE, "complete", store.complete(&claim, &other).await);
    lost(RULE, "release", store.release(&claim).await);
    lost(RULE, "renew", store.renew(&claim, LONG).await);
    replays_the_record(RULE, store, &request).await;
}

pub(super) async fn an_expired_record_is_new<St: Store>(store: &St, keys: &Keys, short: Duration) {
    const RULE: &str = "a record past its TTL is new, in a new generation, whatever its payload";
    // Long enough a TTL that the record is completed well before it expires.
    let ttl = short * 3;
    let (request, reused) = (keys.request(short, ttl), keys.request(short, ttl));
    let mut expired = Vec::new();
    for request in [&request, &reused] {
        let claim = acquire(RULE, store, request).await;
        held(RULE, "complete", store.complete(&claim, &record()).await);
        expired.push(claim);
    }
    tokio::time::sleep(ttl).await;
    // Another payload, then the same one (a client reusing its key: a new operation too).
    for (request, expired) in [
        (other_payload(&request), &expired[0]),
        (reused, &expired[1]),
    ] {
        let (claim, takeover) = poll(RULE, short, || async {
            match ok(RULE, "claim", store.claim(&request).await) {
                KeyState::Acquired { claim, takeover } => Some((claim, takeover)),
                KeyState::Mismatch | KeyState::Completed { .. } => None,
                answer => panic!(
                    "{RULE}: a claim of a completed key must be answered from it until it \
                     expires, then be new; got {}",
                    describe(&answer)
                ),
            }
        })
        .await;
        assert!(
            !takeover,
            "{RULE}: an expired record's key must be new, not a takeover"
        );
        same_generation(RULE, expired, &claim, false);
    }
}

pub(super) async fn a_claim_past_its_ttl_is_in_flight_until_its_lease_lapses<St: Store>(
    store: &St,
    keys: &Keys,
    short: Duration,
) {
    const RULE: &str = "a claim past its TTL is in flight until its lease lapses, then new";
    let request = keys.request(short * 3, short);
    let stale = acquire(RULE, store, &request).await;
    tokio::time::sleep(short * 2).await;
    let answer = ok(RULE, "claim", store.claim(&request).await);
    assert!(
        matches!(answer, KeyState::InFlight { .. }),
        "{RULE}: a claim past its TTL under a live lease must be in flight, got {}",
        describe(&answer)
    );
    // Renewed past its TTL, it holds the key for the new lease.
    held(RULE, "renew", store.renew(&stale, short * 2).await);
    tokio::time::sleep(short).await;
    another_payload_is_a_mismatch(RULE, store, &request, "renewed past its TTL").await;
    tokio::time::sleep(short).await;
    let other = other_payload(&request);
    let takeover = poll(RULE, short, || async {
        match ok(RULE, "claim", store.claim(&other).await) {
            KeyState::Acquired { takeover, .. } => Some(takeover),
            KeyState::Mismatch => None,
            answer => panic!(
                "{RULE}: another payload for a claim past its TTL must be a mismatch until its \
                 lease lapses, then new; got {}",
                describe(&answer)
            ),
        }
    })
    .await;
    assert!(
        !takeover,
        "{RULE}: a lapsed claim past its TTL is gone: its key must be new, not a takeover"
    );
    fenced_out(RULE, store, &stale).await;
}

/// Asserts that a later claim of a key carries the generation of an earlier one (`same`: a
/// takeover) or another (a claim after the key expired), for a store that fences its claims.
fn same_generation<C: ClaimHandle>(rule: &str, earlier: &C, later: &C, same: bool) {
    let (Some(earlier), Some(later)) = (earlier.fence(), later.fence()) else {
        return;
    };
    let (earlier, later) = (earlier.generation, later.generation);
    if same {
        assert_eq!(
            earlier, later,
            "{rule}: a takeover keeps the key's generation"
        );
    } else {
        assert_ne!(
            earlier, later,
            "{rule}: a claim after the key expired starts a new generation"
        );
    }
}

pub(super) async fn racing_requests_acquire_a_key_once<St: Store + Clone>(store: &St, keys: &Keys) {
    const RULE: &str = "racing requests acquire a key exactly once";
    for mixed in [false, true] {
        let request = keys.request(LONG, LONG);
        let bystander = keys.request(LONG, LONG);
        let bystander_claim = acquire(RULE, store, &bystander).await;
        let racers: Vec<_> = (0..RACERS)
            .map(|i| {
                let request = if mixed && i % 2 == 1 {
                    other_payload(&request)
                } else {
                    request.clone()
                };
                let store = store.clone();
                tokio::spawn(async move {
                    let answer = store.claim(&request).await;
                    (request.fingerprint, answer)
                })
            })
            .collect();
        let mut winner = None;
        let mut answers = Vec::new();
        for racer in racers {
            let (fingerprint, answer) = racer.await.expect("a racing claim panicked");
            let answer = ok(RULE, "claim", answer);
            if let KeyState::Acquired { .. } = answer {
                assert!(
                    winner.is_none(),
                    "{RULE}: {RACERS} racing begins acquired one key twice"
                );
                winner = Some(fingerprint);
            }
            answers.push((fingerprint, answer));
        }
        let winner = winner
            .unwrap_or_else(|| panic!("{RULE}: none of {RACERS} racing begins acquired a new key"));
        for (fingerprint, answer) in &answers {
            match answer {
                KeyState::Acquired { .. } => {}
                KeyState::InFlight { .. } if *fingerprint == winner => {}
                KeyState::Mismatch if *fingerprint != winner => {}
                other => panic!(
                    "{RULE}: a loser must be in flight (same payload as the winner) or a \
                     mismatch (another payload), got {}",
                    describe(other)
                ),
            }
        }
        held(
            RULE,
            "complete",
            store.complete(&bystander_claim, &record()).await,
        );
    }
}

/// Checks that `request` with another payload is refused while the key is `state`.
pub(super) async fn another_payload_is_a_mismatch<St: Store>(
    rule: &str,
    store: &St,
    request: &ClaimRequest,
    state: &str,
) {
    let answer = ok(rule, "claim", store.claim(&other_payload(request)).await);
    assert!(
        matches!(answer, KeyState::Mismatch),
        "{rule}: another payload for a key {state} must be a mismatch, got {}",
        describe(&answer)
    );
}

/// Checks that `request`'s key replays [`record`].
pub(super) async fn replays_the_record<St: Store>(rule: &str, store: &St, request: &ClaimRequest) {
    let answer = ok(rule, "claim", store.claim(request).await);
    assert!(
        matches!(&answer, KeyState::Completed { record: r, .. } if *r == record()),
        "{rule}: the record completed last must replay, got {}",
        describe(&answer)
    );
}

/// Checks that `claim`, taken over or released, can no longer write.
pub(super) async fn fenced_out<St: Store>(rule: &str, store: &St, claim: &St::Claim) {
    lost(rule, "renew", store.renew(claim, LONG).await);
    lost(rule, "complete", store.complete(claim, &record()).await);
    lost(rule, "release", store.release(claim).await);
}
