//! The background task that finishes abandoned keys: [`Completer`].

use std::{fmt, future::poll_fn, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Extensions, Request};
use http_body_util::Full;
use tower_service::Service;

use super::{Completing, request::KeptRequest};
use crate::{
    chain::Chain,
    metrics,
    scope::Principal,
    settings::{ConfigError, MAX_DURATION},
    store::{Abandoned, PendingLog, PendingLogError, PendingPick, Store},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ExtensionsFn = dyn Fn(&Principal, &mut Extensions) + Send + Sync;

/// Finishes keys whose client left them unfinished, by sending each one's kept request through
/// the app's service again, exactly as the client's retry would; see the
/// [completion guide](crate::guide::completion).
#[must_use]
pub struct Completer<S> {
    service: S,
    log: Arc<dyn PendingLog>,
    grace: Duration,
    concurrency: u32,
    max_attempts: u32,
    extensions: Option<Arc<ExtensionsFn>>,
}

impl<S> fmt::Debug for Completer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("grace", &self.grace)
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .field("extensions", &self.extensions.is_some())
            .finish_non_exhaustive()
    }
}

/// What one round of a [`Completer`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Round {
    /// Abandoned keys picked.
    pub picked: u32,
    /// Picked keys now completed.
    pub completed: u32,
    /// Picked keys still unfinished (tried again after the grace, up to the maximum).
    pub failed: u32,
    /// Picked keys that failed their last allowed attempt and are left alone.
    pub gave_up: u32,
    /// Keys released because they were claimed to keep their request and never kept it (their
    /// process died in between): their handler never ran, and nothing else would finish them.
    pub released_unkept: u32,
}

impl<S> Completer<S> {
    /// A completer for the keys `store` keeps requests of, sending them through `service`: the
    /// app's router *with* the idempotency layer (and without the authentication that the
    /// kept principal stands for). By default it gives a client 10 minutes after its key's
    /// lease lapsed, drives 4 keys at a time and tries each at most 5 times.
    ///
    /// # Errors
    ///
    /// [`ConfigError::CompletionUnsupported`] when `store` keeps no requests.
    pub fn new<St: Store>(store: &St, service: S) -> Result<Self, ConfigError> {
        let log = store
            .capabilities()
            .pending_log()
            .cloned()
            .ok_or(ConfigError::CompletionUnsupported)?;
        Ok(Self {
            service,
            log,
            grace: Duration::from_secs(600),
            concurrency: 4,
            max_attempts: 5,
            extensions: None,
        })
    }

    /// How long after a key's lease lapsed its client has to come back before the completer
    /// takes the key; also the wait between two attempts. Longer ones are taken as
    /// [`MAX_DURATION`].
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero.
    pub fn with_grace(mut self, grace: Duration) -> Result<Self, ConfigError> {
        if grace.is_zero() {
            return Err(ConfigError::Zero("completer grace"));
        }
        self.grace = grace.min(MAX_DURATION);
        Ok(self)
    }

    /// How many keys are picked and driven at a time by this completer.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero.
    pub fn with_concurrency(mut self, concurrency: u32) -> Result<Self, ConfigError> {
        if concurrency == 0 {
            return Err(ConfigError::Zero("completer concurrency"));
        }
        self.concurrency = concurrency;
        Ok(self)
    }

    /// How many times a key is tried before it is left alone (counted across instances).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero.
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Result<Self, ConfigError> {
        if max_attempts == 0 {
            return Err(ConfigError::Zero("completer max_attempts"));
        }
        self.max_attempts = max_attempts;
        Ok(self)
    }

    /// Restores what the app's authentication puts in a request's extensions besides the
    /// [`Principal`] (which the completer restores itself): `f` gets the kept principal and
    /// the rebuilt request's extensions. Not called for a single-tenant scope.
    pub fn with_extensions<F>(mut self, f: F) -> Self
    where
        F: Fn(&Principal, &mut Extensions) + Send + Sync + 'static,
    {
        self.extensions = Some(Arc::new(f));
        self
    }
}

impl<S> Completer<S>
where
    S: Service<Request<Full<Bytes>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    /// Completes abandoned keys forever: a round every `period`, and rounds at once while they
    /// come back full. Errors are logged and the loop goes on.
    ///
    /// ```no_run
    /// # async fn run(store: tower_idempotency::store::PostgresStore, app: axum::Router) {
    /// use std::time::Duration;
    /// use tower_idempotency::Completer;
    ///
    /// let completer = Completer::new(&store, app).unwrap();
    /// tokio::spawn(completer.run(Duration::from_secs(30)));
    /// # }
    /// ```
    pub async fn run(self, period: Duration) {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            loop {
                match self.complete_abandoned().await {
                    Ok(round) if round.picked == self.concurrency => {}
                    Ok(_) => break,
                    Err(error) => {
                        metrics::completion("pick_error");
                        tracing::warn!(
                            error = %Chain(&*error),
                            "picking abandoned idempotency keys failed; retrying next period"
                        );
                        break;
                    }
                }
            }
        }
    }

    /// One round: deletes kept requests no longer pending, releases keys claimed to keep a
    /// request that never was, picks up to the concurrency's worth of abandoned keys and drives
    /// them, all at once.
    ///
    /// # Errors
    ///
    /// The store's error when picking failed (nothing was driven).
    pub async fn complete_abandoned(&self) -> Result<Round, PendingLogError> {
        let batch = self.concurrency.saturating_mul(16);
        if let Err(error) = self.log.purge(batch).await {
            tracing::warn!(error = %Chain(&*error), "purging kept requests failed");
        }
        let released_unkept = self.release_unkept(batch).await;
        let pick = PendingPick {
            limit: self.concurrency,
            grace: self.grace,
            max_attempts: self.max_attempts,
        };
        let picked = self.log.pick(pick).await?;
        let mut round = Round {
            picked: u32::try_from(picked.len()).unwrap_or(u32::MAX),
            released_unkept,
            ..Round::default()
        };
        metrics::completions("picked", picked.len());
        let results = futures_util::stream::iter(picked)
            .map(|abandoned| self.drive(abandoned))
            .buffer_unordered(self.concurrency as usize)
            .collect::<Vec<_>>()
            .await;
        for result in results {
            match result {
                Driven::Completed => round.completed += 1,
                Driven::Failed => round.failed += 1,
                Driven::GaveUp => round.gave_up += 1,
            }
        }
        Ok(round)
    }

    /// Releases at most `batch` keys claimed to keep a request that never was; how many.
    async fn release_unkept(&self, batch: u32) -> u32 {
        match self.log.release_unkept(batch, self.grace).await {
            Ok(0) => 0,
            Ok(released) => {
                metrics::completions("released_unkept", released as usize);
                tracing::warn!(
                    released,
                    "released idempotency keys claimed to keep their request for completion that \
                     never kept it (their process died in between): nothing else would finish them"
                );
                u32::try_from(released).unwrap_or(u32::MAX)
            }
            Err(error) => {
                tracing::warn!(error = %Chain(&*error), "releasing unkept claims failed");
                0
            }
        }
    }

    /// Sends one abandoned key's request through the service, then asks whether it completed.
    async fn drive(&self, abandoned: Abandoned) -> Driven {
        let Abandoned {
            key,
            fingerprint,
            request,
            attempt,
        } = abandoned;
        let completing = Completing {
            attempt,
            scope_key: key,
            fingerprint,
        };
        let sent = match KeptRequest::decode(request) {
            Ok(kept) => self.send(kept, completing).await,
            Err(error) => Err(Box::new(error) as BoxError),
        };
        match sent {
            Ok(()) => tracing::debug!(%key, attempt, "completion request answered"),
            Err(error) => {
                tracing::warn!(%key, attempt, error = %Chain(&*error), "completion request failed")
            }
        }
        match self.log.finish(&key).await {
            Ok(true) => {
                metrics::completion("completed");
                tracing::info!(%key, attempt, "completed an abandoned idempotency key");
                Driven::Completed
            }
            Ok(false) | Err(_) if attempt >= self.max_attempts => {
                metrics::completion("gave_up");
                tracing::warn!(
                    %key, attempt,
                    "gave up completing an abandoned idempotency key; its client's retry can still finish it"
                );
                Driven::GaveUp
            }
            Ok(false) => {
                metrics::completion("failed");
                Driven::Failed
            }
            Err(error) => {
                metrics::completion("failed");
                tracing::warn!(%key, error = %Chain(&*error), "reading a completion's outcome failed");
                Driven::Failed
            }
        }
    }

    /// The kept request, rebuilt with its principal and marker, through the service.
    async fn send(&self, kept: KeptRequest, completing: Completing) -> Result<(), BoxError> {
        let principal = Principal::new(kept.principal.as_str()).ok();
        let mut request: Request<Full<Bytes>> = kept.into_request();
        let extensions = request.extensions_mut();
        extensions.insert(completing);
        if let Some(principal) = principal {
            if let Some(restore) = &self.extensions {
                restore(&principal, extensions);
            }
            extensions.insert(principal);
        }
        let mut service = self.service.clone();
        poll_fn(|cx| service.poll_ready(cx))
            .await
            .map_err(Into::into)?;
        // The answer is the record's, read back by `finish`; the response itself is dropped.
        service.call(request).await.map_err(Into::into)?;
        Ok(())
    }
}

/// What driving one key came to.
enum Driven {
    Completed,
    Failed,
    GaveUp,
}
