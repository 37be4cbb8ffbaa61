//! The card network client: authorizes a charge at the [`acquirer`] under the charge's
//! downstream key, then takes the configured processing delay.
//!
//! The acquirer is another service (`--acquirer-url`), or, by default, the [`acquirer`] crate's
//! app in this process, called through its router with the same requests. Either way the call
//! carries the charge's [`DownstreamKey`](tower_idempotency::DownstreamKey) as its `Idempotency-Key`: a call interrupted and sent
//! again under that key is authorized once. A refund is not sent to the acquirer; it takes the
//! processing delay, the latency of a real card network.
//!
//! The processing delay (`--processing-delay-ms`) is taken after the authorization and before
//! the ledger write: the worst place for a crash, which the demo's steps make safe.
//!
//! ```
//! use charges_demo::{params::ChargeParams, processor::{Authorization, CardProcessor}};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let processor = CardProcessor::default();
//! let params = ChargeParams::parse(None, b"amount=500&currency=usd").unwrap();
//! let key = "5f0c7a52-3b1e-4a6c-9d2f-8e7b6a5c4d3e";
//! let authorized = processor.authorize(&params, key).await.unwrap();
//! assert_eq!(authorized.authorization(), Authorization::Approved);
//! # }
//! ```

use std::{fmt, future::Future, sync::Arc, time::Duration};

use acquirer::Acquirer;
use axum::{Router, body::Body};
use futures_util::future::BoxFuture;
use http::{Request, StatusCode, header};
use serde::{Deserialize, Serialize};
use tower::ServiceExt;

use crate::params::ChargeParams;

pub use acquirer::{Decision as Authorization, Decline};

/// How long a call to a remote acquirer may take before it counts as failed.
const ACQUIRER_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest acquirer answer read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

type Hook = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// The card network client; see the [module documentation](self).
#[derive(Clone)]
pub struct CardProcessor {
    network: Network,
    delay: Duration,
    hook: Option<Hook>,
}

#[derive(Clone)]
enum Network {
    InProcess(Router),
    Remote {
        client: reqwest::Client,
        url: String,
    },
}

/// What the acquirer answered, as a charge's `authorize` step records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Authorized {
    /// The acquirer's `auth_...` id.
    pub id: String,
    /// For a declined card, its `decline_code`.
    pub decline_code: Option<String>,
}

impl Authorized {
    /// The decision: approved, or declined with the acquirer's reason (a code this demo does
    /// not know reads as a generic decline).
    pub fn authorization(&self) -> Authorization {
        match &self.decline_code {
            None => Authorization::Approved,
            Some(code) => Authorization::Declined(
                Decline::from_code(code)
                    .or_else(|| Decline::from_code("generic_decline"))
                    .unwrap_or(Decline {
                        code: "generic_decline",
                        message: "Your card was declined.",
                    }),
            ),
        }
    }
}

impl Default for CardProcessor {
    fn default() -> Self {
        Self::new(Duration::ZERO)
    }
}

impl CardProcessor {
    /// A processor with an acquirer of its own in this process, taking `delay` after each
    /// authorization and for each refund.
    pub fn new(delay: Duration) -> Self {
        Self::in_process(Acquirer::new(acquirer::Settings::default()), delay)
    }

    /// A processor calling `acquirer` in this process (the tests read its authorizations).
    pub fn in_process(acquirer: Acquirer, delay: Duration) -> Self {
        Self {
            network: Network::InProcess(acquirer::app(acquirer)),
            delay,
            hook: None,
        }
    }

    /// A processor calling the acquirer at `url` (`http://host:port`).
    pub fn remote(url: &str, delay: Duration) -> Self {
        let client = reqwest::Client::builder()
            .timeout(ACQUIRER_TIMEOUT)
            .build()
            .unwrap_or_default();
        Self {
            network: Network::Remote {
                client,
                url: format!("{}/v1/authorizations", url.trim_end_matches('/')),
            },
            delay,
            hook: None,
        }
    }

    /// Runs `hook` at the start of every authorization and refund, before anything else, and
    /// waits for it.
    ///
    /// It sees (and can hold) charges while they are in flight: the demo's tests use it to send
    /// a duplicate request exactly while the first is being processed, with no timing involved.
    #[must_use]
    pub fn with_hook<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.hook = Some(Arc::new(move || Box::pin(hook())));
        self
    }

    /// The processing delay.
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Authorizes a charge at the acquirer, sending `key` (the charge's downstream key) as its
    /// `Idempotency-Key`.
    ///
    /// # Errors
    ///
    /// A [`NetworkError`] when the acquirer could not be reached or did not answer `200`:
    /// nothing is known to be authorized, and a retry sends the same key.
    pub async fn authorize(
        &self,
        params: &ChargeParams,
        key: &str,
    ) -> Result<Authorized, NetworkError> {
        if let Some(hook) = &self.hook {
            hook().await;
        }
        let form = {
            let mut form = form_urlencoded::Serializer::new(String::new());
            form.append_pair("amount", &params.amount.to_string())
                .append_pair("currency", &params.currency)
                .append_pair("source", &params.source);
            // The charge's id, for the acquirer's `charge.settled` event.
            if let Some(charge) = crate::ledger::charge_id_for(key) {
                form.append_pair("reference", &charge);
            }
            form.finish()
        };
        let (status, body) = match &self.network {
            Network::InProcess(router) => call_in_process(router, key, form).await?,
            Network::Remote { client, url } => call_remote(client, url, key, form).await?,
        };
        if status != StatusCode::OK {
            return Err(NetworkError::Status(status));
        }
        let answer: Answer = serde_json::from_slice(&body).map_err(NetworkError::Answer)?;
        Ok(Authorized {
            id: answer.id,
            decline_code: answer.decline_code,
        })
    }

    /// Takes the processing delay: between a charge's authorization and its ledger write.
    pub async fn processing(&self) {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
    }

    /// Sends a refund to the card network, which takes its time and accepts it.
    pub async fn refund(&self) {
        if let Some(hook) = &self.hook {
            hook().await;
        }
        self.processing().await;
    }
}

/// The part of the acquirer's answer the demo reads.
#[derive(Deserialize)]
struct Answer {
    id: String,
    decline_code: Option<String>,
}

async fn call_in_process(
    router: &Router,
    key: &str,
    form: String,
) -> Result<(StatusCode, bytes::Bytes), NetworkError> {
    let request = Request::post("/v1/authorizations")
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(form))
        .map_err(|error| NetworkError::InProcess(error.to_string()))?;
    let response = match router.clone().oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), MAX_ANSWER_BYTES)
        .await
        .map_err(|error| NetworkError::InProcess(error.to_string()))?;
    Ok((status, body))
}

async fn call_remote(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    form: String,
) -> Result<(StatusCode, bytes::Bytes), NetworkError> {
    let response = client
        .post(url)
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(form)
        .send()
        .await
        .map_err(NetworkError::Transport)?;
    let status = response.status();
    if response.content_length().unwrap_or(0) > MAX_ANSWER_BYTES as u64 {
        return Err(NetworkError::Status(StatusCode::PAYLOAD_TOO_LARGE));
    }
    let body = response.bytes().await.map_err(NetworkError::Transport)?;
    Ok((status, body))
}

/// Why an authorization has no answer: a retry sends it again under the same key.
#[derive(Debug)]
#[non_exhaustive]
pub enum NetworkError {
    /// The acquirer could not be reached, or its answer not read.
    Transport(reqwest::Error),
    /// The acquirer answered something else than `200`.
    Status(StatusCode),
    /// The answer is not an authorization.
    Answer(serde_json::Error),
    /// The in-process acquirer's request or answer failed.
    InProcess(String),
}

impl fmt::Display for NetworkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Transport(_) => f.write_str("the acquirer could not be reached"),
            Self::Status(status) => write!(f, "the acquirer answered {status}"),
            Self::Answer(_) => f.write_str("the acquirer's answer is not an authorization"),
            Self::InProcess(error) => write!(f, "the in-process acquirer failed: {error}"),
        }
    }
}

impl std::error::Error for NetworkError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Transport(error) => Some(error),
            Self::Answer(error) => Some(error),
            Self::Status(_) | Self::InProcess(_) => None,
        }
    }
}

impl fmt::Debug for CardProcessor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let network = match &self.network {
            Network::InProcess(_) => "in process",
            Network::Remote { url, .. } => url.as_str(),
        };
        f.debug_struct("CardProcessor")
            .field("network", &network)
            .field("delay", &self.delay)
            .field("hook", &self.hook.as_ref().map(|_| ".."))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn key(n: u8) -> String {
        format!("00000000-0000-4000-8000-0000000000{n:02}")
    }

    #[tokio::test]
    async fn the_acquirer_decides_and_one_key_authorizes_once() {
        let acquirer = Acquirer::new(acquirer::Settings::default());
        let processor = CardProcessor::in_process(acquirer.clone(), Duration::ZERO);
        let visa = ChargeParams::parse(None, b"amount=5&currency=usd").unwrap();
        let first = processor.authorize(&visa, &key(1)).await.unwrap();
        assert_eq!(first.authorization(), Authorization::Approved);
        assert_eq!(processor.authorize(&visa, &key(1)).await.unwrap(), first);
        let declined =
            ChargeParams::parse(None, b"amount=5&currency=usd&source=tok_chargeDeclined");
        let answer = processor.authorize(&declined.unwrap(), &key(2)).await;
        let Authorization::Declined(decline) = answer.unwrap().authorization() else {
            panic!("declined");
        };
        assert_eq!(decline.code, "generic_decline");
        assert_eq!(acquirer.authorizations().len(), 2);
    }

    #[tokio::test]
    async fn a_failing_acquirer_is_an_error_not_a_decline() {
        let acquirer = Acquirer::new(acquirer::Settings {
            fail_rate: 1.0,
            ..acquirer::Settings::default()
        });
        let processor = CardProcessor::in_process(acquirer, Duration::ZERO);
        let visa = ChargeParams::parse(None, b"amount=5&currency=usd").unwrap();
        let error = processor.authorize(&visa, &key(1)).await.unwrap_err();
        assert!(matches!(
            error,
            NetworkError::Status(StatusCode::SERVICE_UNAVAILABLE)
        ));
        let unreachable = CardProcessor::remote("http://127.0.0.1:1", Duration::ZERO);
        let error = unreachable.authorize(&visa, &key(1)).await.unwrap_err();
        assert!(matches!(error, NetworkError::Transport(_)), "{error:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn takes_its_delay_and_runs_its_hook() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&calls);
        let processor = CardProcessor::new(Duration::from_secs(3)).with_hook(move || {
            seen.fetch_add(1, Ordering::SeqCst);
            async {}
        });
        let start = tokio::time::Instant::now();
        processor.processing().await;
        assert!(start.elapsed() >= Duration::from_secs(3));
        processor.refund().await;
        assert!(start.elapsed() >= Duration::from_secs(6));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "refunds run the hook");
    }
}
