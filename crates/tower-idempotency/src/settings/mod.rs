//! The layer's settings, shared by every clone of its service, and what makes one invalid.
//! Related settings travel as one value ([`Limits`], [`InFlightWait`], and beside their
//! concerns [`KeySource`](crate::KeySource), [`Fingerprinting`](crate::Fingerprinting),
//! [`Rendering`](crate::Rendering)), each checked whole when the layer is given it.

use std::{fmt, time::Duration};

use http::{HeaderName, Method};

use crate::{
    fingerprint::Fingerprinting,
    key::KeySource,
    policy::{Disconnect, RetentionPolicy, StoreFailure},
    rendering::Rendering,
    scope::Scope,
};

mod limits;
mod secret;
mod waiting;

pub use limits::Limits;
pub use secret::MIN_STEP_SECRET_BYTES;
pub(crate) use secret::StepSecret;
pub use waiting::InFlightWait;

/// The settings, shared by every clone of the service: each value validated when it was set.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) methods: Vec<Method>,
    pub(crate) key: KeySource,
    pub(crate) scope: Scope,
    pub(crate) fingerprinting: Fingerprinting,
    pub(crate) limits: Limits,
    pub(crate) retention: RetentionPolicy,
    pub(crate) unstored_headers: Vec<HeaderName>,
    pub(crate) store_failure: StoreFailure,
    pub(crate) disconnect: Disconnect,
    pub(crate) rendering: Rendering,
    /// `None`: a duplicate of a key in flight gets `409` at once.
    pub(crate) in_flight_wait: Option<InFlightWait>,
    /// `None`: handlers get no [`Steps`](crate::Steps).
    pub(crate) step_secret: Option<StepSecret>,
    /// `None`: no request is kept for the [`Completer`](crate::Completer).
    pub(crate) completion: Option<crate::completion::Completion>,
}

/// The longest duration a setting takes: longer ones are taken as this, which is forever for
/// every purpose here and keeps clock arithmetic and database intervals far from overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `at + span`, or [`MAX_DURATION`] after `at` when that is past what an `Instant` holds: a
/// TTL or lease of `Duration::MAX` means never, and no request panics on it. (`at` itself only
/// if that overflows too, which a monotonic clock never comes near.)
pub(crate) fn later(at: tokio::time::Instant, span: Duration) -> tokio::time::Instant {
    at.checked_add(span)
        .or_else(|| at.checked_add(MAX_DURATION))
        .unwrap_or(at)
}

/// The shortest lease: it is renewed every third of itself, and a store needs some time to
/// answer a renewal.
pub const MIN_LEASE: Duration = Duration::from_millis(10);

impl Default for Config {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            methods: vec![Method::POST, Method::PATCH],
            key: KeySource::default(),
            scope: Scope::default(),
            fingerprinting: Fingerprinting::default(),
            limits: Limits::default(),
            retention: RetentionPolicy::default(),
            unstored_headers: Vec::new(),
            store_failure: StoreFailure::default(),
            disconnect: Disconnect::default(),
            rendering: Rendering::default(),
            in_flight_wait: None,
            step_secret: None,
            completion: None,
        }
    }
}

impl Config {
    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// Refuses a completion that would keep a credential, whichever setting names it (checked
    /// by both setters, so their order does not matter).
    pub(crate) fn completion_checked(&self) -> Result<(), ConfigError> {
        let Some(completion) = &self.completion else {
            return Ok(());
        };
        let kept = completion.headers().iter();
        match completion.refused_credential(kept.chain(self.fingerprinting.headers())) {
            Some(name) => Err(ConfigError::CredentialKept(name.clone())),
            None => Ok(()),
        }
    }
}

/// An invalid [`IdempotencyLayer`](crate::IdempotencyLayer) setting.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A duration or limit was zero: every one must be positive (to switch a behaviour off,
    /// leave its setting out).
    Zero(&'static str),
    /// A duration shorter than the setting's minimum.
    TooShort {
        /// The setting.
        setting: &'static str,
        /// Its minimum.
        min: Duration,
    },
    /// The layer must cover at least one method.
    NoMethods,
    /// A JSON Pointer must start with `/`.
    InvalidPointer(String),
    /// Fields left out of a raw fingerprint, which hashes the body's bytes and cannot leave
    /// any out.
    RawExcluding,
    /// A step secret shorter than [`MIN_STEP_SECRET_BYTES`].
    ShortSecret {
        /// The minimum, in bytes.
        min: usize,
    },
    /// [`with_completion`](crate::IdempotencyLayer::with_completion) or a
    /// [`Completer`](crate::Completer) on a store that keeps no requests for completion (no
    /// [`PendingLog`](crate::store::PendingLog) in its capabilities).
    CompletionUnsupported,
    /// A credential header among those kept for the [`Completer`](crate::Completer) (named to
    /// [`Completion`](crate::Completion), or covered by the fingerprint) without
    /// [`Completion::storing_credentials`](crate::Completion::storing_credentials).
    CredentialKept(HeaderName),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Zero(setting) => write!(f, "idempotency setting `{setting}` must not be zero"),
            Self::TooShort { setting, min } => {
                write!(
                    f,
                    "idempotency setting `{setting}` must be at least {min:?}"
                )
            }
            Self::NoMethods => f.write_str("idempotency layer must cover at least one method"),
            Self::InvalidPointer(pointer) => {
                write!(
                    f,
                    "`{pointer}` is not a JSON Pointer: it must start with `/`"
                )
            }
            Self::RawExcluding => f.write_str(
                "a raw fingerprint hashes the body's bytes and cannot leave fields out: \
                 exclude fields from `Fingerprinting::semantic()`",
            ),
            Self::ShortSecret { min } => write!(
                f,
                "idempotency setting `step_secret` must be at least {min} random bytes"
            ),
            Self::CompletionUnsupported => f.write_str(
                "this idempotency store keeps no requests for completion: use PostgresStore in \
                 lease mode (or a store whose capabilities offer a PendingLog)",
            ),
            Self::CredentialKept(name) => write!(
                f,
                "`{name}` carries credentials and would be kept in the store for the completer: \
                 the kept principal stands for them; keep it only with \
                 `Completion::storing_credentials`"
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IdempotencyLayer, store::MemoryStore};

    #[test]
    fn invalid_settings_are_errors() {
        let layer = IdempotencyLayer::memory;
        let limits = |f: fn(Limits) -> Limits| layer().with_limits(f(Limits::default()));
        assert_eq!(
            layer().with_ttl(Duration::ZERO).unwrap_err(),
            ConfigError::Zero("ttl")
        );
        assert_eq!(
            layer().with_lease(Duration::ZERO).unwrap_err(),
            ConfigError::Zero("lease")
        );
        assert_eq!(
            layer().with_methods([]).unwrap_err(),
            ConfigError::NoMethods
        );
        for (zero, setting) in [
            (limits(|l| l.with_max_request_bytes(0)), "max_request_bytes"),
            (
                limits(|l| l.with_body_timeout(Duration::ZERO)),
                "body_timeout",
            ),
            (
                limits(|l| l.with_max_response_bytes(0)),
                "max_response_bytes",
            ),
            (
                limits(|l| l.with_max_handler_time(Duration::ZERO)),
                "max_handler_time",
            ),
            (limits(|l| l.with_max_detached(0)), "max_detached"),
        ] {
            assert_eq!(zero.unwrap_err(), ConfigError::Zero(setting));
        }
        let wait = InFlightWait::up_to(Duration::from_secs(1));
        assert_eq!(
            layer()
                .with_in_flight_wait(wait.with_max_waiting(0))
                .unwrap_err(),
            ConfigError::Zero("max_waiting")
        );
        assert_eq!(
            layer()
                .with_in_flight_wait(InFlightWait::up_to(Duration::ZERO))
                .unwrap_err(),
            ConfigError::Zero("in_flight_wait")
        );
        assert_eq!(
            layer().with_lease(Duration::from_nanos(2)).unwrap_err(),
            ConfigError::TooShort {
                setting: "lease",
                min: MIN_LEASE
            }
        );
        let saturated = layer().with_ttl(Duration::MAX).unwrap();
        assert_eq!(saturated.shared.config.ttl, MAX_DURATION);
    }

    /// Fields left out of a raw fingerprint were once ignored without a word; now refused,
    /// whichever order the value was built in.
    #[test]
    fn a_raw_fingerprint_refuses_to_leave_fields_out() {
        let raw = Fingerprinting::raw().excluding(["/client_sent_at"]);
        assert_eq!(
            IdempotencyLayer::memory()
                .with_fingerprint(raw)
                .unwrap_err(),
            ConfigError::RawExcluding
        );
        assert_eq!(
            IdempotencyLayer::memory()
                .with_fingerprint(Fingerprinting::semantic().excluding(["client_sent_at"]))
                .unwrap_err(),
            ConfigError::InvalidPointer("client_sent_at".to_owned())
        );
        assert!(
            IdempotencyLayer::memory()
                .with_fingerprint(Fingerprinting::semantic().excluding(["/client_sent_at"]))
                .is_ok()
        );
    }

    /// Issue 28.9: no setting panics, whatever the duration (`Duration::MAX` included), and a
    /// layer built from those accepted serves a keyed request and its replay.
    mod no_setting_panics {
        use proptest::prelude::*;
        use tower::ServiceExt;

        use super::*;

        fn any_duration() -> impl Strategy<Value = Duration> {
            prop_oneof![
                (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
                (0..10_000_000_000u64).prop_map(Duration::from_nanos),
                Just(Duration::MAX),
                Just(Duration::ZERO),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            #[test]
            fn any_duration_is_refused_or_served(
                ttl in any_duration(),
                lease in any_duration(),
                body_timeout in any_duration(),
                max_handler_time in any_duration(),
            ) {
                let mut layer = IdempotencyLayer::memory().with_scope(Scope::single_tenant());
                for set in [
                    |l: IdempotencyLayer<MemoryStore>, d| l.with_ttl(d),
                    |l: IdempotencyLayer<MemoryStore>, d| l.with_lease(d),
                    |l: IdempotencyLayer<MemoryStore>, d| {
                        l.with_limits(Limits::default().with_body_timeout(d))
                    },
                    |l: IdempotencyLayer<MemoryStore>, d| {
                        l.with_limits(Limits::default().with_max_handler_time(d))
                    },
                ]
                .into_iter()
                .zip([ttl, lease, body_timeout, max_handler_time])
                .map(|(set, d)| move |l| set(l, d))
                {
                    if let Ok(set) = set(layer.clone()) {
                        layer = set;
                    }
                }
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .start_paused(true)
                    .build()
                    .unwrap();
                runtime.block_on(async {
                    // The handler waits once, so the heartbeat starts.
                    let handler = tower::service_fn(|_| async {
                        tokio::task::yield_now().await;
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
                        ))
                    });
                    let service = tower_layer::Layer::layer(&layer, handler);
                    let request = || {
                        http::Request::post("/")
                            .header("idempotency-key", "k")
                            .body(http_body_util::Full::new(bytes::Bytes::new()))
                            .unwrap()
                    };
                    let first = service.clone().oneshot(request()).await.unwrap();
                    assert_eq!(first.status(), http::StatusCode::OK);
                    let retry = service.oneshot(request()).await.unwrap();
                    assert_eq!(retry.headers()["idempotent-replayed"], "true");
                });
            }
        }
    }
}
