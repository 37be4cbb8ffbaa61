//! Webhooks received exactly once (issue 37.2) on every store: a delivery is verified before
//! anything is claimed (signature, stale and future timestamps, missing headers, a bad id),
//! twenty concurrent redeliveries apply the effect once, a redelivery with another body is a
//! mismatch, and a handler's failure is not recorded as done. On PostgreSQL the effect's rows
//! commit with the inbox record.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::HeaderMap;
use idempotency_tests::{bounded, db::TestDb, init_tracing, store::ObservedStore};
use tokio::sync::Semaphore;
use tower_idempotency::{
    InFlightWait, KeyError, MAX_KEY_LEN, Once, OnceError,
    store::{MemoryStore, PostgresStore, Store},
    webhook::{ReceiveError, SecretError, VerifyError, WebhookReceiver, WebhookVerifier},
};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OTHER_SECRET: &str = "whsec_Y2hhcmdlcy1kZW1vIHdlYmhvb2sgdGVzdA==";

#[derive(Debug)]
struct NoSuchCharge;

impl std::fmt::Display for NoSuchCharge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no such charge")
    }
}

impl std::error::Error for NoSuchCharge {}

fn now() -> i64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    i64::try_from(since.as_secs()).unwrap()
}

/// A delivery of `body` as event `id`, signed with `secret` at `timestamp`.
fn delivery(secret: &str, id: &str, timestamp: i64, body: &str) -> (HeaderMap, Bytes) {
    let signer = standardwebhooks::Webhook::new(secret).unwrap();
    let signature = signer.sign(id, timestamp, body.as_bytes()).unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("webhook-id", id.parse().unwrap());
    headers.insert("webhook-timestamp", timestamp.to_string().parse().unwrap());
    headers.insert("webhook-signature", signature.parse().unwrap());
    (headers, Bytes::from(body.to_owned()))
}

fn settled(id: &str, charge: &str) -> String {
    format!(r#"{{"id":"{id}","type":"charge.settled","data":{{"object":{{"id":"{charge}"}}}}}}"#)
}

/// A receiver on `store`, observed, and the database it lives in.
struct Fixture<St> {
    receiver: WebhookReceiver<ObservedStore<St>>,
    _db: Option<TestDb>,
}

impl<St: Store + Clone> Fixture<St> {
    fn new(store: St, db: Option<TestDb>) -> Self {
        let once = Once::new(ObservedStore::new(store))
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(30)))
            .unwrap();
        let verifier = WebhookVerifier::new(SECRET).unwrap();
        Self {
            receiver: WebhookReceiver::new(once, "acquirer", verifier).unwrap(),
            _db: db,
        }
    }

    fn observed(&self) -> &ObservedStore<St> {
        self.receiver.once().store()
    }
}

async fn memory() -> Fixture<MemoryStore> {
    init_tracing();
    Fixture::new(MemoryStore::new(), None)
}

async fn postgres(transactional: bool) -> Fixture<PostgresStore> {
    init_tracing();
    let db = TestDb::new().await;
    let mut store = PostgresStore::new(db.pool().clone());
    store.migrate().await.expect("migrate");
    if transactional {
        store = store.transactional();
    }
    Fixture::new(store, Some(db))
}

/// Every refusal of verification is a 400 and claims nothing; then a good delivery of the
/// same event still runs.
async fn bad_deliveries_claim_nothing<St: Store + Clone>(fixture: Fixture<St>) {
    let receiver = &fixture.receiver;
    let body = settled("evt_1", "ch_1");
    let refused =
        |(headers, body): (HeaderMap, Bytes)| receiver.verify(&headers, body).unwrap_err();

    let forged = refused(delivery(OTHER_SECRET, "evt_1", now(), &body));
    assert!(matches!(forged, VerifyError::BadSignature), "{forged:?}");
    let (headers, _) = delivery(SECRET, "evt_1", now(), &body);
    let tampered = refused((headers, Bytes::from(settled("evt_1", "ch_2"))));
    assert!(
        matches!(tampered, VerifyError::BadSignature),
        "{tampered:?}"
    );
    // Signed under another id: the id is part of what is signed.
    let (mut headers, bytes) = delivery(SECRET, "evt_1", now(), &body);
    headers.insert("webhook-id", "evt_2".parse().unwrap());
    assert!(matches!(
        refused((headers, bytes)),
        VerifyError::BadSignature
    ));

    let stale = refused(delivery(SECRET, "evt_1", now() - 301, &body));
    assert!(matches!(stale, VerifyError::Stale), "{stale:?}");
    let future = refused(delivery(SECRET, "evt_1", now() + 301, &body));
    assert!(matches!(future, VerifyError::FromTheFuture), "{future:?}");
    let (mut headers, bytes) = delivery(SECRET, "evt_1", now(), &body);
    headers.insert("webhook-timestamp", "yesterday".parse().unwrap());
    assert!(matches!(
        refused((headers, bytes)),
        VerifyError::InvalidTimestamp
    ));

    for header in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        let (mut headers, bytes) = delivery(SECRET, "evt_1", now(), &body);
        headers.remove(header);
        let missing = refused((headers, bytes));
        assert!(
            matches!(missing, VerifyError::MissingHeader(name) if name == header),
            "{missing:?}"
        );
        assert_eq!(missing.status(), 400);
    }
    let long_id = "e".repeat(MAX_KEY_LEN + 1);
    let too_long = refused(delivery(
        SECRET,
        &long_id,
        now(),
        &settled(&long_id, "ch_1"),
    ));
    assert!(
        matches!(too_long, VerifyError::InvalidId(KeyError::TooLong(_))),
        "{too_long:?}"
    );
    let as_error = ReceiveError::<NoSuchCharge>::from(too_long);
    assert_eq!(as_error.status(), Some(http::StatusCode::BAD_REQUEST));

    assert_eq!(
        fixture.observed().begins(),
        0,
        "a refused delivery claimed a key"
    );
    let (headers, bytes) = delivery(SECRET, "evt_1", now(), &body);
    let webhook = receiver.verify(&headers, bytes).unwrap();
    let applied = receiver.run(&webhook, || async { Ok::<_, NoSuchCharge>(1u32) });
    assert_eq!(applied.await.unwrap(), 1);
}

/// A forged `webhook-timestamp` at the ends of `i64` (or far off, or not a number) is a `400`
/// refusal, never a panic in the verifier's arithmetic, and the handler never runs (issue 44).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_timestamps_are_refused_and_run_nothing() {
    let fixture = memory().await;
    let receiver = &fixture.receiver;
    let body = settled("evt_ts", "ch_1");
    let runs = &AtomicUsize::new(0);
    let handle = |headers: HeaderMap, bytes: Bytes| async move {
        let webhook = receiver.verify(&headers, bytes)?;
        let effect = || async { Ok::<_, NoSuchCharge>(runs.fetch_add(1, Ordering::SeqCst)) };
        Ok::<_, ReceiveError<NoSuchCharge>>(receiver.run(&webhook, effect).await?)
    };
    let year = 365 * 86_400;
    let forged = [
        i64::MIN.to_string(),
        (i64::MIN + 1).to_string(),
        i64::MAX.to_string(),
        (now() - 100 * year).to_string(),
        (now() + 100 * year).to_string(),
        "1e10".to_owned(),
    ];
    for timestamp in forged {
        let (mut headers, bytes) =
            delivery(SECRET, "evt_ts", timestamp.parse().unwrap_or(0), &body);
        headers.insert("webhook-timestamp", timestamp.parse().unwrap());
        let refused = handle(headers, bytes).await.expect_err(&timestamp);
        assert!(
            matches!(refused, ReceiveError::Refused(_)),
            "{timestamp}: {refused:?}"
        );
        assert_eq!(
            refused.status(),
            Some(http::StatusCode::BAD_REQUEST),
            "{timestamp}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a refused delivery ran");
    assert_eq!(
        fixture.observed().begins(),
        0,
        "a refused delivery claimed a key"
    );

    let (headers, bytes) = delivery(SECRET, "evt_ts", now(), &body);
    assert_eq!(handle(headers, bytes).await.unwrap(), 0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Twenty concurrent redeliveries of one event (each signed anew, as a sender retries): the
/// effect runs once and every delivery gets its result.
async fn concurrent_redeliveries_apply_once<St: Store + Clone>(fixture: Fixture<St>) {
    let body = settled("evt_20", "ch_1");
    let runs = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(Semaphore::new(0));
    let mut deliveries = Vec::new();
    for attempt in 0..20 {
        let (headers, bytes) = delivery(SECRET, "evt_20", now() - attempt, &body);
        let (receiver, runs, go) = (fixture.receiver.clone(), runs.clone(), go.clone());
        deliveries.push(tokio::spawn(async move {
            let webhook = receiver.verify(&headers, bytes).unwrap();
            let effect = || async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let _ = go.acquire().await;
                Ok::<_, NoSuchCharge>(format!("settled by run {run}"))
            };
            receiver.run(&webhook, effect).await
        }));
    }
    // The other nineteen found the event in flight before the first may finish.
    fixture.observed().found_in_flight(19).await;
    go.add_permits(1);
    for delivery in deliveries {
        assert_eq!(delivery.await.unwrap().unwrap(), "settled by run 1");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The same `webhook-id` with another body, validly signed: a mismatch (422), never run.
async fn another_body_is_a_mismatch<St: Store + Clone>(fixture: Fixture<St>) {
    let receiver = &fixture.receiver;
    let (headers, bytes) = delivery(SECRET, "evt_3", now(), &settled("evt_3", "ch_1"));
    let first = receiver.verify(&headers, bytes).unwrap();
    let applied = receiver.run(&first, || async { Ok::<_, NoSuchCharge>(1u32) });
    assert_eq!(applied.await.unwrap(), 1);

    let (headers, bytes) = delivery(SECRET, "evt_3", now(), &settled("evt_3", "ch_2"));
    let other = receiver.verify(&headers, bytes).unwrap();
    let refused: Result<u32, OnceError<NoSuchCharge>> =
        receiver.run(&other, || async { panic!("ran twice") }).await;
    let refused = refused.unwrap_err();
    assert!(matches!(refused, OnceError::Mismatch), "{refused:?}");
    let refused = ReceiveError::from(refused);
    assert_eq!(
        refused.status(),
        Some(http::StatusCode::UNPROCESSABLE_ENTITY)
    );
}

/// A handler's failure (an unknown charge) is not recorded as done: the key is released, and a
/// later delivery of the same event runs the effect.
async fn a_failure_is_not_recorded<St: Store + Clone>(fixture: Fixture<St>) {
    let receiver = &fixture.receiver;
    let body = settled("evt_4", "ch_later");
    let (headers, bytes) = delivery(SECRET, "evt_4", now(), &body);
    let webhook = receiver.verify(&headers, bytes).unwrap();
    let failed = receiver
        .run(&webhook, || async { Err::<u32, _>(NoSuchCharge) })
        .await
        .unwrap_err();
    assert!(
        matches!(failed, OnceError::Failed(NoSuchCharge)),
        "{failed:?}"
    );
    assert_eq!(ReceiveError::from(failed).status(), None);
    assert_eq!(fixture.observed().released(), 1);

    let (headers, bytes) = delivery(SECRET, "evt_4", now(), &body);
    let webhook = receiver.verify(&headers, bytes).unwrap();
    let applied = receiver.run(&webhook, || async { Ok::<_, NoSuchCharge>(7u32) });
    assert_eq!(applied.await.unwrap(), 7);
    assert_eq!(fixture.observed().completed(), 1);
}

macro_rules! suite {
    ($module:ident, $fixture:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn bad_deliveries_claim_nothing() {
                bounded(super::bad_deliveries_claim_nothing($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_redeliveries_apply_once() {
                bounded(super::concurrent_redeliveries_apply_once($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn another_body_is_a_mismatch() {
                bounded(super::another_body_is_a_mismatch($fixture)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_failure_is_not_recorded() {
                bounded(super::a_failure_is_not_recorded($fixture)).await;
            }
        }
    };
}

suite!(memory_store, memory().await);
suite!(postgres_lease, postgres(false).await);

#[test]
fn bad_secrets_are_config_errors() {
    let missing = WebhookVerifier::new("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap_err();
    assert!(matches!(missing, SecretError::MissingPrefix), "{missing:?}");
    let garbled = WebhookVerifier::new("whsec_not base64!").unwrap_err();
    assert!(matches!(garbled, SecretError::NotBase64(_)), "{garbled:?}");
    let short = WebhookVerifier::new("whsec_c2hvcnQ=").unwrap_err();
    assert!(matches!(short, SecretError::TooShort(5)), "{short:?}");
    assert!(WebhookVerifier::new("whsec_").is_err());
    let once = Once::new(MemoryStore::new());
    let verifier = WebhookVerifier::new(SECRET).unwrap();
    assert!(WebhookReceiver::new(once, "", verifier).is_err());
}

/// The inbox: twenty concurrent redeliveries on a transactional store credit once, and the
/// credit commits with the record; a failed delivery leaves no row and no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inbox_commits_the_effect_with_the_record() {
    init_tracing();
    bounded(async {
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone());
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE credits (event text NOT NULL, amount bigint NOT NULL)")
            .execute(db.pool())
            .await
            .unwrap();
        let once = Once::new(store.transactional())
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(30)))
            .unwrap();
        let verifier = WebhookVerifier::new(SECRET).unwrap();
        let receiver = WebhookReceiver::new(once, "acquirer", verifier).unwrap();

        let failed = deliver(&receiver, "evt_fail", true).await;
        assert!(
            matches!(failed, Err(OnceError::Failed(NoSuchCharge))),
            "{failed:?}"
        );
        let mut deliveries = Vec::new();
        for _ in 0..20 {
            let receiver = receiver.clone();
            deliveries.push(tokio::spawn(async move {
                deliver(&receiver, "evt_5", false).await
            }));
        }
        for delivery in deliveries {
            assert_eq!(delivery.await.unwrap().unwrap(), 2000);
        }
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT event, amount FROM credits")
            .fetch_all(db.pool())
            .await
            .unwrap();
        assert_eq!(rows, vec![("evt_5".to_owned(), 2000)]);
    })
    .await;
}

/// One delivery of `id` whose effect inserts a credit, then fails when `fail`.
async fn deliver(
    receiver: &WebhookReceiver<PostgresStore>,
    id: &str,
    fail: bool,
) -> Result<i64, OnceError<NoSuchCharge>> {
    let (headers, bytes) = delivery(SECRET, id, now(), &settled(id, "ch_1"));
    let webhook = receiver.verify(&headers, bytes).unwrap();
    let event = webhook.id().to_owned();
    receiver
        .run_in_transaction(&webhook, move |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO credits VALUES ($1, 2000)")
                    .bind(&event)
                    .execute(&mut *tx)
                    .await
                    .expect("insert");
                if fail { Err(NoSuchCharge) } else { Ok(2000) }
            })
        })
        .await
}
