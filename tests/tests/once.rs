//! `Once` off the request path (issue 37.1) on every store: the layer's protocol for a function
//! (runs once under concurrency, waits or is told the key is in flight, replays the typed
//! result, refuses another payload, releases the key after a failure, a panic or a
//! cancellation), its refusals of bad input, and `run_in_transaction`'s writes committing with
//! the record on PostgreSQL.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use idempotency_tests::{bounded, db::TestDb, init_tracing, store::ObservedStore};
use tokio::sync::Semaphore;
use tower_idempotency::{
    InFlightWait, KeyError, MAX_KEY_LEN, MAX_SCOPE_LEN, Once, OnceError, ScopeError,
    store::{MemoryStore, PostgresStore, Store},
};

const SCOPE: &str = "payments-consumer";

#[derive(Debug)]
struct Declined;

impl std::fmt::Display for Declined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("declined")
    }
}

impl std::error::Error for Declined {}

/// A `Once` over `store`, observed, and a fixture that keeps its database alive.
struct Fixture<St> {
    once: Once<ObservedStore<St>>,
    _db: Option<TestDb>,
}

impl<St: Store + Clone> Fixture<St> {
    fn observed(&self) -> &ObservedStore<St> {
        self.once.store()
    }
}

async fn memory() -> Fixture<MemoryStore> {
    init_tracing();
    Fixture {
        once: Once::new(ObservedStore::new(MemoryStore::new())),
        _db: None,
    }
}

async fn postgres(transactional: bool) -> Fixture<PostgresStore> {
    init_tracing();
    let db = TestDb::new().await;
    let mut store = PostgresStore::new(db.pool().clone());
    store.migrate().await.expect("migrate");
    if transactional {
        store = store.transactional();
    }
    Fixture {
        once: Once::new(ObservedStore::new(store)),
        _db: Some(db),
    }
}

fn payload(amount: u64) -> serde_json::Value {
    serde_json::json!({ "account": "acct_1", "amount": amount })
}

/// Twenty concurrent calls of one key, waiting for it: the closure runs once and every caller
/// gets its result.
async fn concurrent_callers_share_one_run<St: Store + Clone>(fixture: Fixture<St>) {
    let once = fixture
        .once
        .clone()
        .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(30)))
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(Semaphore::new(0));
    let mut callers = Vec::new();
    for _ in 0..20 {
        let (once, runs, go) = (once.clone(), Arc::clone(&runs), Arc::clone(&go));
        callers.push(tokio::spawn(async move {
            once.run(SCOPE, "evt_1", &payload(100), || async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let _ = go.acquire().await;
                Ok::<_, Declined>(format!("applied by run {run}"))
            })
            .await
        }));
    }
    // The other nineteen found the key in flight before the first may finish.
    fixture.observed().found_in_flight(19).await;
    go.add_permits(1);
    for caller in callers {
        assert_eq!(caller.await.unwrap().unwrap(), "applied by run 1");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Without a wait, a duplicate is told the key is in flight; once the first finished, its
/// typed result is replayed, another payload is refused, and another type is an error.
async fn in_flight_then_replay_then_mismatch<St: Store + Clone>(fixture: Fixture<St>) {
    let once = fixture.once.clone();
    let (entered, go) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let first = tokio::spawn({
        let (once, entered, go) = (once.clone(), Arc::clone(&entered), Arc::clone(&go));
        async move {
            once.run(SCOPE, "evt_2", &payload(100), || async move {
                entered.add_permits(1);
                let _ = go.acquire().await;
                Ok::<_, Declined>(vec![7u64, 8])
            })
            .await
        }
    });
    let _ = entered.acquire().await.unwrap();
    let duplicate = once
        .run(SCOPE, "evt_2", &payload(100), || async {
            Ok::<_, Declined>(vec![0u64])
        })
        .await;
    assert!(
        matches!(duplicate, Err(OnceError::InFlight)),
        "{duplicate:?}"
    );
    go.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap(), vec![7, 8]);

    let replayed: Vec<u64> = once
        .run(SCOPE, "evt_2", &payload(100), || async {
            panic!("ran twice")
        })
        .await
        .map_err(|e: OnceError<Declined>| e)
        .unwrap();
    assert_eq!(replayed, vec![7, 8]);
    // The same meaning in another field order is the same payload.
    let reordered = serde_json::json!({ "amount": 100, "account": "acct_1" });
    let again: Vec<u64> = once
        .run(SCOPE, "evt_2", &reordered, || async { panic!("ran twice") })
        .await
        .map_err(|e: OnceError<Declined>| e)
        .unwrap();
    assert_eq!(again, vec![7, 8]);
    let other = once
        .run(SCOPE, "evt_2", &payload(999), || async {
            panic!("ran twice")
        })
        .await
        .map(|_: Vec<u64>| ())
        .map_err(|e: OnceError<Declined>| e);
    assert!(matches!(other, Err(OnceError::Mismatch)), "{other:?}");
    let wrong_type = once
        .run(SCOPE, "evt_2", &payload(100), || async {
            panic!("ran twice")
        })
        .await
        .map(|_: String| ())
        .map_err(|e: OnceError<Declined>| e);
    assert!(
        matches!(wrong_type, Err(OnceError::Output(_))),
        "{wrong_type:?}"
    );
    // Another scope is another key.
    let elsewhere: Vec<u64> = once
        .run("refunds-consumer", "evt_2", &payload(999), || async {
            Ok::<_, Declined>(vec![1])
        })
        .await
        .unwrap();
    assert_eq!(elsewhere, vec![1]);
}

/// A failed closure releases the key: the next call runs again and its result is kept.
async fn a_failure_releases_the_key<St: Store + Clone>(fixture: Fixture<St>) {
    let once = &fixture.once;
    let failed = once
        .run(SCOPE, "evt_3", &payload(1), || async {
            Err::<u64, _>(Declined)
        })
        .await;
    assert!(
        matches!(failed, Err(OnceError::Failed(Declined))),
        "{failed:?}"
    );
    assert_eq!(fixture.observed().released(), 1);
    let ran = once
        .run(SCOPE, "evt_3", &payload(1), || async {
            Ok::<u64, Declined>(2)
        })
        .await
        .unwrap();
    assert_eq!(ran, 2);
    let replayed = once
        .run(SCOPE, "evt_3", &payload(1), || async {
            Ok::<u64, Declined>(3)
        })
        .await
        .unwrap();
    assert_eq!(replayed, 2);
}

/// A panicking closure releases the key before the panic goes on; a cancelled call releases
/// it when dropped.
async fn a_panic_or_cancel_releases_the_key<St: Store + Clone>(fixture: Fixture<St>) {
    let once = fixture.once.clone();
    let panicked = tokio::spawn({
        let once = once.clone();
        async move {
            once.run(SCOPE, "evt_4", &payload(1), || async {
                if true {
                    panic!("the closure panicked");
                }
                Ok::<u64, Declined>(0)
            })
            .await
        }
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    assert_eq!(fixture.observed().released(), 1);
    fixture.observed().settled(1).await;

    let entered = Arc::new(Semaphore::new(0));
    let cancelled = tokio::spawn({
        let (once, entered) = (once.clone(), Arc::clone(&entered));
        async move {
            once.run(SCOPE, "evt_4", &payload(1), || async move {
                entered.add_permits(1);
                std::future::pending::<Result<u64, Declined>>().await
            })
            .await
        }
    });
    let _ = entered.acquire().await.unwrap();
    cancelled.abort();
    assert!(cancelled.await.unwrap_err().is_cancelled());
    fixture.observed().settled(1).await;
    assert_eq!(fixture.observed().released(), 2);
    let ran = once
        .run(SCOPE, "evt_4", &payload(1), || async {
            Ok::<u64, Declined>(5)
        })
        .await
        .unwrap();
    assert_eq!(ran, 5);
}

/// Bad scopes, keys and payloads are refused before anything is claimed.
async fn bad_input_claims_nothing<St: Store + Clone>(fixture: Fixture<St>) {
    let once = &fixture.once;
    let call = |scope: String, key: String| async move {
        once.run(&scope, &key, &payload(1), || async {
            Ok::<u64, Declined>(1)
        })
        .await
    };
    let long_scope = "s".repeat(MAX_SCOPE_LEN + 1);
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    assert!(matches!(
        call(String::new(), "k".into()).await,
        Err(OnceError::InvalidScope(ScopeError::Empty))
    ));
    assert!(matches!(
        call(long_scope, "k".into()).await,
        Err(OnceError::InvalidScope(ScopeError::TooLong(len))) if len == MAX_SCOPE_LEN + 1
    ));
    assert!(matches!(
        call(SCOPE.into(), String::new()).await,
        Err(OnceError::InvalidKey(KeyError::Empty))
    ));
    assert!(matches!(
        call(SCOPE.into(), long_key).await,
        Err(OnceError::InvalidKey(KeyError::TooLong(_)))
    ));
    assert!(matches!(
        call(SCOPE.into(), "evt\n1".into()).await,
        Err(OnceError::InvalidKey(KeyError::InvalidCharacter(b'\n')))
    ));
    // JSON object keys must be strings: this payload has no JSON.
    let unserializable = BTreeMap::from([(vec![1u8], 1)]);
    let refused = once
        .run(SCOPE, "evt_5", &unserializable, || async {
            Ok::<u64, Declined>(1)
        })
        .await;
    assert!(matches!(refused, Err(OnceError::Payload(_))), "{refused:?}");
    assert_eq!(fixture.observed().begins(), 0);
    // The maximum lengths themselves are fine.
    let (scope, key) = ("s".repeat(MAX_SCOPE_LEN), "k".repeat(MAX_KEY_LEN));
    assert_eq!(call(scope, key).await.unwrap(), 1);
}

/// A store that fails is a `Store` error with its source, and the closure does not run.
async fn a_store_failure_is_typed<St: Store + Clone>(fixture: Fixture<St>) {
    fixture.observed().set_down(true);
    let failed = fixture
        .once
        .run(SCOPE, "evt_6", &payload(1), || async {
            panic!("ran without a claim")
        })
        .await
        .map(|_: u64| ())
        .map_err(|e: OnceError<Declined>| e);
    let Err(OnceError::Store(source)) = failed else {
        panic!("{failed:?}")
    };
    assert_eq!(source.to_string(), "test store is switched off");
}

/// A call that outlives its lease many times over keeps its key: the lease is renewed.
async fn the_lease_is_renewed_while_running<St: Store + Clone>(fixture: Fixture<St>) {
    let lease = Duration::from_millis(200);
    let once = fixture.once.clone().with_lease(lease).unwrap();
    let (entered, go) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let first = tokio::spawn({
        let (once, entered, go) = (once.clone(), Arc::clone(&entered), Arc::clone(&go));
        async move {
            once.run(SCOPE, "evt_7", &payload(1), || async move {
                entered.add_permits(1);
                let _ = go.acquire().await;
                Ok::<u64, Declined>(1)
            })
            .await
        }
    });
    let _ = entered.acquire().await.unwrap();
    // The passing of time is what is tested: five leases.
    tokio::time::sleep(lease * 5).await;
    let duplicate = once
        .run(SCOPE, "evt_7", &payload(1), || async {
            Ok::<u64, Declined>(2)
        })
        .await;
    assert!(
        matches!(duplicate, Err(OnceError::InFlight)),
        "{duplicate:?}"
    );
    go.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap(), 1);
}

macro_rules! suite {
    ($module:ident, $fixture:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_callers_share_one_run() {
                bounded(super::concurrent_callers_share_one_run($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn in_flight_then_replay_then_mismatch() {
                bounded(super::in_flight_then_replay_then_mismatch($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_failure_releases_the_key() {
                bounded(super::a_failure_releases_the_key($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_panic_or_cancel_releases_the_key() {
                bounded(super::a_panic_or_cancel_releases_the_key($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn bad_input_claims_nothing() {
                bounded(super::bad_input_claims_nothing($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_store_failure_is_typed() {
                bounded(super::a_store_failure_is_typed($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn the_lease_is_renewed_while_running() {
                bounded(super::the_lease_is_renewed_while_running($fixture)).await;
            }
        }
    };
}

suite!(memory_store, memory().await);
suite!(postgres_lease, postgres(false).await);
suite!(postgres_transactional, postgres(true).await);
