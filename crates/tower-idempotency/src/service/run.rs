//! The handler, under a claim kept alive by a heartbeat, and what becomes of its response.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::{Pin, pin},
    sync::Arc,
    task::Poll,
    time::Duration,
};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response, request::Parts, response};

use super::{
    HttpBody, Inner, Keyed,
    held::{Completion, HeldKey},
    outcome::{Outcome, outcome, panic_message, reject},
};
use crate::{
    body::{self, Buffered, RequestBody, ResponseBody},
    chain::Chain,
    context::IdempotencyContext,
    future::Served,
    metrics,
    policy::Retention,
    problem::Rejection,
    record::Record,
    settings::Config,
    steps::{self, Steps},
    store::{ClaimHandle, ClaimStatus, Store},
};

/// What the handler came to: its response head and buffered body, its error, or its panic.
type Handled<B, E> =
    Result<Result<(response::Parts, Buffered<B>), E>, Box<dyn std::any::Any + Send>>;

impl<S: Inner<ReqBody>, St: Store, ReqBody: HttpBody> Keyed<S, St, ReqBody> {
    /// The handler, under a held claim kept alive by a heartbeat; then record or release.
    #[expect(
        clippy::manual_async_fn,
        reason = "the future stays small (see the service module)"
    )]
    pub(super) fn run(
        self,
        claim: St::Claim,
        mut context: IdempotencyContext,
        mut parts: Parts,
        body: Bytes,
    ) -> impl Future<Output = Served<S::ResBody, S::Error>> {
        async move {
            let Keyed {
                mut inner, shared, ..
            } = self;
            let takeover = context.takeover;
            let (store, config) = (shared.store, shared.config);
            claim.attach(&mut parts.extensions);
            let secret = config.step_secret.as_ref();
            context.steps = steps::offer(secret, &*store, &claim, context.fingerprint);
            let steps = context.steps.as_ref().ok().cloned();
            let guard = HeldKey::new(Arc::clone(&store), claim);
            parts.extensions.insert(context);
            let request = Request::from_parts(parts, RequestBody::buffered(body));
            let max_response_bytes = config.limits.max_response_bytes;
            let handler = async move {
                let response = inner.call(request).await?;
                let (parts, body) = response.into_parts();
                Ok((
                    parts,
                    body::buffer(Box::pin(body), max_response_bytes).await,
                ))
            };
            let heartbeat = Heartbeat {
                lease: config.lease,
                max_time: config.limits.max_handler_time,
            };
            let handled = {
                // Pinned here and lent to the heartbeat (see the service module); dropped at the
                // end of this block, so a stopped handler lets go of what it holds first.
                let handling = pin!(AssertUnwindSafe(handler).catch_unwind());
                heartbeat.run(&*store, guard.claim(), handling).await
            };
            let Some(handled) = handled else {
                tracing::error!(
                    max = ?config.limits.max_handler_time,
                    "handler ran past its maximum time; stopped, and its key given up"
                );
                guard.abandon().await;
                outcome(Outcome::Abandoned);
                return Ok(reject(
                    &config,
                    Rejection::handler_timed_out(config.limits.max_handler_time),
                ));
            };
            let settled = Settled {
                guard,
                takeover,
                steps,
            };
            settle(&config, settled, handled).await
        }
    }
}

/// A held key with what its handler did under it, to be settled.
struct Settled<St: Store> {
    guard: HeldKey<St>,
    takeover: bool,
    steps: Option<Steps>,
}

impl<St: Store> Settled<St> {
    /// Frees the key, or gives it up part-way when a downstream key was handed out: its
    /// retry or the completer then goes on with the same downstream keys.
    async fn release(self) {
        if self.steps.as_ref().is_some_and(Steps::handed_out) {
            outcome(Outcome::Abandoned);
            self.guard.abandon().await;
        } else {
            outcome(Outcome::Released);
            self.guard.release().await;
        }
    }
}

/// What the handler came to, settled: its response recorded (or its key released) and
/// delivered, or the refusal that takes its place.
#[expect(
    clippy::manual_async_fn,
    reason = "the future stays small (see the service module)"
)]
fn settle<'a, St: Store, B: HttpBody, E: 'a>(
    config: &'a Config,
    settled: Settled<St>,
    handled: Handled<Pin<Box<B>>, E>,
) -> impl Future<Output = Served<B, E>> + 'a {
    async move {
        let (mut parts, buffered) = match handled {
            Ok(Ok(handled)) => handled,
            Ok(Err(error)) => {
                settled.release().await;
                return Err(error);
            }
            Err(panic) => {
                tracing::error!(
                    panic = panic_message(&*panic),
                    "handler panicked; key released"
                );
                settled.release().await;
                return Ok(reject(config, Rejection::handler_panicked()));
            }
        };
        let chosen = parts.extensions.remove::<Retention>();
        let decided = chosen.unwrap_or_else(|| config.retention.decide(parts.status));
        let mut retention = decided;
        let (kept_body, body) =
            split_body(buffered, config.limits.max_response_bytes, &mut retention);
        // Said by the handler itself, or a refusal whose answer arrived whole: nothing was done.
        let nothing_done = chosen == Some(Retention::Release)
            || (parts.status.is_client_error() && retention == decided);
        if settled.steps.as_ref().is_some_and(Steps::lost) {
            // Made after the claim was lost: never stored, so the next holder resumes the steps.
            tracing::warn!(status = %parts.status, "a step found the claim lost; response not stored");
            retention = Retention::Abandon;
        }
        match retention {
            Retention::Keep => {
                let record = Record::capture_without(&parts, kept_body, &config.unstored_headers);
                let Settled {
                    guard, takeover, ..
                } = settled;
                let completion = guard.complete(record, config.lease, config.ttl).await;
                if let Some(rejection) = completed(completion, &parts, takeover) {
                    return Ok(reject(config, rejection));
                }
            }
            Retention::Release if nothing_done => {
                outcome(Outcome::Released);
                settled.guard.release().await;
            }
            Retention::Release => settled.release().await,
            Retention::Abandon => {
                outcome(Outcome::Abandoned);
                settled.guard.abandon().await;
            }
        }
        Ok(Response::from_parts(parts, body))
    }
}
/// The body to keep for replays (none when too large or failed) and the body to deliver. A
/// body that failed is never kept: its outcome is unknown, so a retry runs again rather than
/// replay half an answer.
fn split_body<B>(
    buffered: Buffered<Pin<Box<B>>>,
    limit: usize,
    retention: &mut Retention,
) -> (Option<Bytes>, ResponseBody<B>) {
    match buffered {
        Buffered::Complete(bytes, trailers) => {
            (Some(bytes.clone()), ResponseBody::full(bytes, trailers))
        }
        Buffered::TooLarge { prefix, rest } => {
            tracing::warn!(
                limit,
                "response too large to store: delivered, but a retry gets its status only"
            );
            (None, ResponseBody::prefixed(prefix, rest))
        }
        Buffered::Failed { prefix, error } => {
            tracing::warn!(error = %Chain(&*error), "response body failed; key released");
            *retention = Retention::Release;
            (None, ResponseBody::failed(prefix, error))
        }
    }
}

/// The outcome of storing the record of a response with head `parts`: `None` to deliver the
/// response, or the refusal that takes its place.
fn completed(completion: Completion, parts: &response::Parts, takeover: bool) -> Option<Rejection> {
    match completion {
        Completion::Stored => {
            outcome(if takeover {
                Outcome::Takeover
            } else {
                Outcome::Acquired
            });
            None
        }
        Completion::NotCommitted => {
            // The handler's writes were to commit with the record, and may not have.
            outcome(Outcome::StoreError);
            Some(Rejection::not_committed())
        }
        Completion::RolledBack => {
            outcome(Outcome::Released);
            if parts.status.is_success() || parts.status.is_redirection() {
                // A success nothing backs: answering it would be a lie.
                tracing::error!(
                    status = %parts.status,
                    "the handler answered success over a failed transaction; nothing was \
                     committed"
                );
                return Some(Rejection::transaction_aborted());
            }
            tracing::info!(
                status = %parts.status,
                "the handler answered over a failed transaction: delivered, nothing committed, \
                 key released"
            );
            None
        }
    }
}

/// The lease a running handler's claim keeps, and how long the handler may run.
pub(crate) struct Heartbeat {
    pub(crate) lease: Duration,
    pub(crate) max_time: Duration,
}

impl Heartbeat {
    /// Runs `future` (the handler, or storing its response) while renewing `claim`'s lease
    /// every third of the lease; `None` when it runs past the maximum time (it is then dropped,
    /// and its claim no longer renewed).
    /// Renewal runs beside the handler, never blocking it; a renewal that fails or finds the
    /// claim lost is logged, and the handler goes on (fencing keeps a lost claim from writing
    /// its record). After a failed renewal the next comes sooner, so a lease outlives an outage
    /// shorter than itself.
    pub(crate) async fn run<St: Store, F: Future>(
        &self,
        store: &St,
        claim: &St::Claim,
        mut future: Pin<&mut F>,
    ) -> Option<F::Output> {
        // A handler that answers without waiting needs no heartbeat: don't even start the timer.
        if let Poll::Ready(output) = poll_once(future.as_mut()).await {
            return Some(output);
        }
        let period = self.lease / 3;
        let started = tokio::time::Instant::now();
        let deadline = later(started, self.max_time);
        let mut next = later(started, period);
        loop {
            tokio::select! {
                biased;
                output = &mut future => return Some(output),
                () = tokio::time::sleep_until(deadline) => return None,
                () = tokio::time::sleep_until(next) => {}
            }
            let renewal = pin!(metrics::timed("renew", store.renew(claim, self.lease)));
            let renewed = tokio::select! {
                biased;
                output = &mut future => return Some(output),
                renewed = renewal => renewed,
            };
            let now = tokio::time::Instant::now();
            next = match renewed {
                Ok(ClaimStatus::Held) => {
                    metrics::renewal("held");
                    later(now, period)
                }
                Ok(_) => {
                    metrics::renewal("lost");
                    tracing::warn!(
                        "lease lost (another request took the key over); this response will not \
                         be stored"
                    );
                    later(now, period)
                }
                Err(error) => {
                    metrics::renewal("error");
                    tracing::warn!(error = %Chain(&error), "lease renewal failed");
                    later(now, period.min(RETRY_WHILE_UNREACHABLE))
                }
            };
        }
    }
}

pub(super) use crate::settings::later;

/// How soon a store that failed is tried again while a claim must be kept alive: an outage
/// shorter than the lease never lets the lease lapse.
pub(super) const RETRY_WHILE_UNREACHABLE: Duration = Duration::from_millis(500);

/// Polls `future` once, in the task's context: `Pending` leaves it to be awaited on. Used to skip
/// setting up a timer for work that turns out to be done already.
pub(super) async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
}
