//! The simulated card processor: decides a charge from Stripe's test tokens, taking its time.
//!
//! | source | outcome |
//! |---|---|
//! | `tok_chargeDeclined` | declined, `generic_decline` |
//! | `tok_chargeDeclinedInsufficientFunds` | declined, `insufficient_funds` |
//! | any other `tok_...` (`tok_visa`, `tok_mastercard`...) | approved |
//!
//! Every authorisation, and every refund, takes the configured delay (`--processing-delay-ms`),
//! the latency of a real card network, so that a duplicate request can arrive while the first is
//! still being processed and meet the idempotency layer's `409`. The network takes every refund:
//! whether a charge can be refunded is the [ledger](crate::ledger)'s to decide.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use futures_util::future::BoxFuture;

/// Why a card was declined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decline {
    /// Stripe's `decline_code`, such as `generic_decline`.
    pub code: &'static str,
    /// The message for the customer.
    pub message: &'static str,
}

/// The processor's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authorization {
    /// The charge succeeded.
    Approved,
    /// The card was declined.
    Declined(Decline),
}

type Hook = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// The simulated processor; see the [module documentation](self).
#[derive(Clone, Default)]
pub struct CardProcessor {
    delay: Duration,
    hook: Option<Hook>,
}

impl CardProcessor {
    /// A processor that takes `delay` to answer each authorisation.
    pub fn new(delay: Duration) -> Self {
        Self { delay, hook: None }
    }

    /// Runs `hook` at the start of every authorisation and refund, before the delay, and waits
    /// for it.
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

    /// The simulated latency.
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Authorises a charge on `source` (a validated `tok_...` token).
    pub async fn authorize(&self, source: &str) -> Authorization {
        self.process().await;
        decide(source)
    }

    /// Sends a refund to the card network, which takes its time and accepts it.
    pub async fn refund(&self) {
        self.process().await;
    }

    async fn process(&self) {
        if let Some(hook) = &self.hook {
            hook().await;
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
    }
}

fn decide(source: &str) -> Authorization {
    match source {
        "tok_chargeDeclined" => Authorization::Declined(Decline {
            code: "generic_decline",
            message: "Your card was declined.",
        }),
        "tok_chargeDeclinedInsufficientFunds" => Authorization::Declined(Decline {
            code: "insufficient_funds",
            message: "Your card has insufficient funds.",
        }),
        _ => Authorization::Approved,
    }
}

impl fmt::Debug for CardProcessor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CardProcessor")
            .field("delay", &self.delay)
            .field("hook", &self.hook.as_ref().map(|_| ".."))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn test_tokens_decide_the_outcome() {
        let processor = CardProcessor::default();
        assert_eq!(
            processor.authorize("tok_visa").await,
            Authorization::Approved
        );
        assert_eq!(
            processor.authorize("tok_mastercard").await,
            Authorization::Approved
        );
        assert!(matches!(
            processor.authorize("tok_chargeDeclined").await,
            Authorization::Declined(Decline {
                code: "generic_decline",
                ..
            })
        ));
        assert!(matches!(
            processor
                .authorize("tok_chargeDeclinedInsufficientFunds")
                .await,
            Authorization::Declined(Decline {
                code: "insufficient_funds",
                ..
            })
        ));
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
        processor.authorize("tok_visa").await;
        assert!(start.elapsed() >= Duration::from_secs(3));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        processor.refund().await;
        assert!(start.elapsed() >= Duration::from_secs(6));
        assert_eq!(calls.load(Ordering::SeqCst), 2, "refunds too");
    }
}
