//! The protocol every store must keep, as scenarios over real HTTP.
//!
//! Each scenario is generic over a [`Backend`]; [`store_suite!`](crate::store_suite) turns them
//! into tests for one backend. A store in this repository passes it by implementing `Backend`
//! for it and invoking the macro; a store outside it runs the store-level checks this crate is
//! not published with, `tower_idempotency::store::conformance`.
//!
//! This module holds the harness (the [`Backend`] a store implements, the [`Harness`] a scenario
//! runs in, the [`Reply`] it reads) and the macro; the scenarios live in one submodule a concern,
//! all re-exported here, where the macro finds them by name.

mod disconnects;
mod fingerprints;
mod keys;
mod leases;
mod outages;
mod postgres;
mod replay;
mod retention;
mod scopes;
mod waiting;

use std::{future::Future, time::Duration};

use http::{HeaderValue, Method, StatusCode};
use tower_idempotency::{
    Fingerprint, FingerprintMode, IdempotencyKey, IdempotencyLayer, Principal, ScopeKey,
    store::{ClaimRequest, Store},
};

pub use self::{
    disconnects::*, fingerprints::*, keys::*, leases::*, outages::*, postgres::*, replay::*,
    retention::*, scopes::*, waiting::*,
};
use crate::{
    app::{Probe, app},
    server::TestServer,
    store::ObservedStore,
};

/// A store under test, with the means to move its clock.
pub trait Backend: Send + Sync + Sized + 'static {
    /// The store.
    type Store: Store + Clone;

    /// A fresh, empty, isolated store.
    fn start() -> impl Future<Output = Self> + Send;

    /// The store (a handle to the same data each time).
    fn store(&self) -> Self::Store;

    /// Makes every in-flight lease lapse now, as if its holder had stopped renewing it.
    fn lapse_leases(&self) -> impl Future<Output = ()> + Send;

    /// Makes every record pass its TTL now.
    fn expire_records(&self) -> impl Future<Output = ()> + Send;

    /// Makes `by` pass for every record and claim: each is that much older, leases included.
    fn pass_time(&self, by: Duration) -> impl Future<Output = ()> + Send;

    /// Whether a claim in flight is an open transaction (PostgreSQL's transactional mode) rather
    /// than a lease: it then ends with its holder, with no lease to lapse.
    const TRANSACTIONAL: bool = false;

    /// The store the suite's layer is given: the observed store as users get it by default,
    /// behind a [`CachingStore`](tower_idempotency::store::CachingStore) for PostgreSQL (as
    /// `IdempotencyLayer::postgres` puts it), bare for a store that is in process already.
    type Layered: Store;

    /// [`Layered`](Self::Layered) around `store`.
    fn layered(store: ObservedStore<Self::Store>) -> Self::Layered;
}

/// The layer users get by default for the backend's store.
type Layer<B> = IdempotencyLayer<<B as Backend>::Layered>;

/// One backend, one app on a real socket, one HTTP client.
pub struct Harness<B: Backend> {
    /// The backend.
    pub backend: B,
    /// The backend's store, observed: what reaches it past any cache in front.
    pub store: ObservedStore<B::Store>,
    /// What the handlers did.
    pub probe: Probe,
    /// The server.
    pub server: TestServer,
    /// A keep-alive client.
    pub client: reqwest::Client,
}

impl<B: Backend> Harness<B> {
    /// The app with the default layer settings.
    pub async fn start() -> Self {
        Self::with(|layer| layer).await
    }

    /// The app with the default layer as `configure` makes it.
    pub async fn with(configure: impl FnOnce(Layer<B>) -> Layer<B>) -> Self {
        Self::serving(|store| configure(IdempotencyLayer::new(B::layered(store)))).await
    }

    /// The app with the layer `make` builds on the observed store: for a scenario that needs
    /// another store in front than users get by default (none, or a cache).
    pub async fn serving<St: Store>(
        make: impl FnOnce(ObservedStore<B::Store>) -> IdempotencyLayer<St>,
    ) -> Self {
        let backend = B::start().await;
        let store = ObservedStore::new(backend.store());
        let probe = Probe::default();
        let layer = make(store.clone());
        let server = TestServer::start(app(layer, probe.clone())).await;
        Self {
            backend,
            store,
            probe,
            server,
            client: reqwest::Client::new(),
        }
    }

    /// `POST path` as account `acct_a`, with `key` if given.
    pub fn post(&self, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        self.post_as("acct_a", path, key)
    }

    /// `POST path` as `account`, with `key` if given.
    pub fn post_as(&self, account: &str, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        let request = self.client.post(self.server.url(path)).bearer_auth(account);
        match key {
            Some(key) => request.header("idempotency-key", key),
            None => request,
        }
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: http::HeaderMap,
    /// Body bytes.
    pub body: bytes::Bytes,
}

impl Reply {
    /// Sends `request` and reads the response.
    pub async fn of(request: reqwest::RequestBuilder) -> Self {
        let response = request.send().await.expect("request sent");
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("body read");
        Self {
            status,
            headers,
            body,
        }
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Whether `Idempotent-Replayed: true` is set.
    pub fn replayed(&self) -> bool {
        crate::requests::replayed(&self.headers)
    }

    /// Asserts an RFC 9457 problem of `kind` with `status`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, kind: &str) {
        assert_eq!(self.status.as_u16(), status, "status; body {:?}", self.body);
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let json = self.json();
        let ty = json["type"].as_str().expect("type");
        assert!(
            ty.ends_with(&format!("#variant.{kind}")),
            "type {ty} is not {kind}"
        );
        assert_eq!(json["status"], status);
        assert!(!json["title"].as_str().expect("title").is_empty());
        assert!(!json["detail"].as_str().expect("detail").is_empty());
    }
}

/// A charge's JSON body.
pub const CHARGE: &str = r#"{"amount":100,"currency":"usd"}"#;

fn charge_json(amount: u64) -> serde_json::Value {
    serde_json::json!({ "amount": amount, "currency": "usd" })
}

/// The claim the layer makes for `POST /charges` as `acct_a` with `key` and a JSON `body`
/// (a 30 s lease, a 24 h TTL): for claiming a key directly, as a holder that then crashes.
pub fn claim_request(key: &str, body: &str) -> ClaimRequest {
    let json = HeaderValue::from_static("application/json");
    ClaimRequest {
        key: ScopeKey::new(
            &Principal::new("acct_a").expect("principal"),
            &Method::POST,
            "/charges",
            &IdempotencyKey::new(key).expect("key"),
        ),
        fingerprint: Fingerprint::compute(
            FingerprintMode::Semantic,
            &Method::POST,
            &"/charges".parse().expect("uri"),
            Some(&json),
            body.as_bytes(),
        ),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(24 * 3600),
        waiting: false,
        keeps_request: false,
    }
}

/// Instantiates the suite for a [`Backend`]:
///
/// ```ignore
/// idempotency_tests::store_suite!(MyBackend);
/// // For a backend that needs something not every machine has (its tests then do nothing):
/// idempotency_tests::store_suite!(MyBackend, run_if: my_backend_is_installed());
/// ```
#[macro_export]
macro_rules! store_suite {
    ($backend:ty) => {
        $crate::store_suite!($backend, run_if: async { true });
    };
    ($backend:ty, run_if: $available:expr) => {
        $crate::store_suite!(@tests $backend, $available;
            current_thread:
                retry_replays_the_response_verbatim,
                cookies_are_not_replayed,
                reused_key_with_another_payload_is_422,
                reordered_parameters_are_the_same_request,
                raw_fingerprints_compare_bytes,
                quoted_and_bare_keys_are_one_key,
                malformed_keys_are_400,
                missing_key_is_400_when_required,
                keyless_and_uncovered_requests_pass_through,
                oversize_bodies_are_413,
                principals_never_share_a_key,
                missing_principal_is_refused,
                retention_follows_the_policy,
                a_rejected_request_can_be_corrected,
                server_errors_can_be_kept,
                a_panicking_handler_releases_the_key,
                a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out,
                expired_records_are_new,
                a_ttl_shorter_than_the_lease_still_expires_records,
                a_hung_handler_is_stopped_and_its_key_taken_over,
                a_response_body_that_fails_releases_the_key,
                a_waiting_duplicate_gets_the_first_ones_replay,
                a_waiting_duplicate_runs_when_the_first_is_released,
                a_wait_that_runs_out_is_409,
                waiters_that_hang_up_hold_nothing,
                a_takeover_by_a_waiter_that_hung_up_stays_a_takeover,
                a_waiter_takes_a_stopped_handlers_key_over_at_once,
                a_failed_read_while_waiting_is_409,
                a_response_being_stored_keeps_its_lease,
                a_key_in_the_apis_own_header_is_honoured,
                a_webhook_keyed_by_its_event_id_is_applied_once,
                a_key_that_breaks_the_rule_is_400_and_stores_nothing,
                a_key_reaches_across_endpoints_only_when_scoped_so,
                fingerprints_leave_out_fields_and_take_in_headers,
                repeated_replays_skip_the_store,
                a_disconnected_client_still_gets_its_charge_on_retry,
                cancel_on_disconnect_releases_the_key,
                a_store_outage_fails_closed_or_open,
                a_response_too_large_to_store_is_never_rerun;
            multi_thread:
                concurrent_duplicates_execute_once
        );
    };
    (@tests $backend:ty, $available:expr; current_thread: $($c:ident),*; multi_thread: $($m:ident),*) => {
        $(
            #[tokio::test(flavor = "current_thread")]
            async fn $c() {
                $crate::init_tracing();
                if $available.await {
                    $crate::suite::$c::<$backend>().await;
                }
            }
        )*
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $m() {
                $crate::init_tracing();
                if $available.await {
                    $crate::suite::$m::<$backend>().await;
                }
            }
        )*
    };
}
