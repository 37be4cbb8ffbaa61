//! `--webhook-url`: the network tells the merchant that a charge settled, as a Standard
//! Webhooks `charge.settled` event signed with `standardwebhooks`, `--settle-after-ms` after
//! its authorization. A delivery not answered `2xx` is retried with backoff, signed anew each
//! time; `--duplicate-rate` sends some events twice on purpose, one copy at once (concurrent)
//! and one after the first was answered (a redelivery), so receivers must handle each once.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use rand::{RngExt, SeedableRng, rngs::SmallRng};
use standardwebhooks::Webhook;

/// How many times one delivery is tried before the event is given up.
const ATTEMPTS: u32 = 8;
/// The first pause between attempts; it doubles each time, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Where and how settlements are reported.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookSettings {
    /// The merchant's endpoint, e.g. `http://127.0.0.1:3000/v1/webhooks/acquirer`.
    pub url: String,
    /// The `whsec_...` secret the events are signed with.
    pub secret: String,
    /// How long after its authorization a charge settles.
    pub settle_after: Duration,
    /// The share of events sent twice, from 0 to 1.
    pub duplicate_rate: f64,
}

/// Sends `charge.settled` events; clones share the client and the random choices.
#[derive(Clone)]
pub struct WebhookSender {
    settings: Arc<WebhookSettings>,
    signer: Arc<Webhook>,
    client: reqwest::Client,
    rng: Arc<Mutex<SmallRng>>,
}

impl std::fmt::Debug for WebhookSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSender")
            .field("url", &self.settings.url)
            .finish_non_exhaustive()
    }
}

impl WebhookSender {
    /// A sender for `settings`.
    ///
    /// # Errors
    ///
    /// When the secret is not `whsec_` and base64.
    pub fn new(settings: WebhookSettings) -> Result<Self, standardwebhooks::WebhookError> {
        let seed = u64::from(uuid::Uuid::new_v4().as_fields().0);
        Ok(Self {
            signer: Arc::new(Webhook::new(&settings.secret)?),
            settings: Arc::new(settings),
            client: reqwest::Client::new(),
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
        })
    }

    /// Reports, after the settlement delay, that `charge` settled; in the background.
    pub fn settle_later(&self, charge: String) {
        let sender = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(sender.settings.settle_after).await;
            sender.settle(&charge).await;
        });
    }

    /// Sends one `charge.settled` event for `charge` (twice when drawn to).
    async fn settle(&self, charge: &str) {
        let event = format!("evt_{}", uuid::Uuid::new_v4().simple());
        let body = serde_json::json!({
            "id": event,
            "object": "event",
            "type": "charge.settled",
            "data": {"object": {"id": charge, "object": "charge"}},
        })
        .to_string();
        if !self.duplicate() {
            self.deliver(&event, &body).await;
            return;
        }
        // One copy at once, racing the first; one more once the first was answered.
        let (first, concurrent) =
            tokio::join!(self.deliver(&event, &body), self.deliver(&event, &body));
        if first || concurrent {
            self.deliver(&event, &body).await;
        }
    }

    fn duplicate(&self) -> bool {
        let rate = self.settings.duplicate_rate;
        rate > 0.0 && {
            let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
            rng.random::<f64>() < rate
        }
    }

    /// Delivers until answered `2xx`, or gives up after [`ATTEMPTS`]: whether it was accepted.
    async fn deliver(&self, event: &str, body: &str) -> bool {
        let mut backoff = FIRST_BACKOFF;
        for attempt in 1..=ATTEMPTS {
            match self.send(event, body).await {
                Ok(status) if status.is_success() => return true,
                Ok(status) => tracing::warn!(event, attempt, %status, "webhook refused; retrying"),
                Err(error) => {
                    tracing::warn!(event, attempt, %error, "webhook not delivered; retrying")
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        tracing::error!(event, "webhook given up after {ATTEMPTS} attempts");
        false
    }

    /// One attempt, signed now: a redelivery has a fresh timestamp and signature.
    async fn send(&self, event: &str, body: &str) -> Result<http::StatusCode, reqwest::Error> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        let timestamp = i64::try_from(now).unwrap_or(i64::MAX);
        // A body of text always signs.
        let signature = self
            .signer
            .sign(event, timestamp, body.as_bytes())
            .unwrap_or_default();
        let response = self
            .client
            .post(&self.settings.url)
            .header("content-type", "application/json")
            .header("webhook-id", event)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(body.to_owned())
            .timeout(Duration::from_secs(30))
            .send()
            .await?;
        Ok(response.status())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(secret: &str) -> WebhookSettings {
        WebhookSettings {
            url: "http://127.0.0.1:9/v1/webhooks/acquirer".to_owned(),
            secret: secret.to_owned(),
            settle_after: Duration::ZERO,
            duplicate_rate: 0.0,
        }
    }

    #[test]
    fn a_secret_that_is_not_base64_is_refused() {
        assert!(WebhookSender::new(settings("whsec_not base64!")).is_err());
        assert!(WebhookSender::new(settings(crate::DEV_WEBHOOK_SECRET)).is_ok());
    }
}
