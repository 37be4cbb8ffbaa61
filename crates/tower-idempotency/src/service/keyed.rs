//! A keyed request on its way: its body buffered and fingerprinted, its key claimed in the
//! store's atomic step, and the handler run, the replay sent, or the request refused.

use std::{future::Future, pin::pin, sync::Arc, task::Poll};

use bytes::Bytes;
use http::{Request, Response, request::Parts};

use super::{
    HttpBody, Inner, Keyed, Shared,
    completing::{Refusal, refuse},
    outcome::{Outcome, mismatch, outcome, reject, replayed},
    request_uri,
    run::poll_once,
};
use crate::{
    body::{self, Buffered, RequestBody, ResponseBody},
    chain::Chain,
    completion::{Completing, Keep, Kept},
    context::IdempotencyContext,
    fingerprint::Fingerprint,
    future::{HangUp, Served},
    key::IdempotencyKey,
    metrics,
    policy::StoreFailure,
    problem::Rejection,
    scope::{Principal, ScopeKey},
    settings::Config,
    steps,
    store::{ClaimRequest, KeyState, RecordUnopenable, Store},
};

impl<S: Inner<ReqBody>, St: Store, ReqBody: HttpBody> Keyed<S, St, ReqBody> {
    /// Body and fingerprint, then the claim. Unless the app chose
    /// [`Disconnect::Cancel`](crate::Disconnect::Cancel), the response future hands this future
    /// to a task of its own if it is dropped unfinished (the client hung up), so a handler is
    /// never stopped half-way.
    #[expect(
        clippy::manual_async_fn,
        reason = "the future stays small (see the service module)"
    )]
    pub(super) fn serve(
        mut self,
        parts: Parts,
        body: ReqBody,
    ) -> impl Future<Output = Served<S::ResBody, S::Error>> {
        async move {
            let config = &*self.shared.config;
            let body = match buffer_request(config, body).await {
                Ok(body) => body,
                Err(rejection) => return Ok(reject(config, rejection)),
            };
            let key = match self.key.take() {
                Some(key) => key,
                None => match config.key.find_in_request(
                    &parts,
                    request_uri(&parts.extensions, &parts.uri).path(),
                    &body,
                ) {
                    Ok(Some(key)) => key,
                    Ok(None) if parts.extensions.get::<Completing>().is_some() => {
                        return Ok(reject(config, refuse(Refusal::Unkeyed)));
                    }
                    // No key, not required: the handler runs unprotected, as with no header.
                    Ok(None) => return self.unprotected(parts, body).await,
                    Err(rejection) => return Ok(reject(config, rejection)),
                },
            };
            let uri = request_uri(&parts.extensions, &parts.uri);
            let scope_key = config
                .scope
                .key(&self.principal, &parts.method, uri.path(), &key);
            tracing::Span::current().record("key", tracing::field::display(scope_key));
            let fingerprint = crate::fingerprint::compute_for_request(
                &config.fingerprinting,
                &parts.method,
                uri,
                &parts.headers,
                &body,
            )
            .await;
            if let Some(completing) = parts.extensions.get::<Completing>()
                && let Some(refusal) = Refusal::check(completing, scope_key, fingerprint)
            {
                return Ok(reject(config, refuse(refusal)));
            }
            let hang_up = self.hang_up.as_deref();
            let state = match self.shared.key_state(scope_key, fingerprint, hang_up).await {
                Ok(state) => state,
                Err(Unclaimed::Refused(rejection)) => return Ok(reject(config, rejection)),
                // Its client left: nobody reads this answer.
                Err(Unclaimed::ClientLeft) => {
                    return Ok(config.rendering.render(Rejection::in_flight()));
                }
                Err(Unclaimed::StoreFailed(error)) => {
                    return self.store_failed(&error, parts, body).await;
                }
            };
            let claimed = Claimed {
                key,
                scope_key,
                fingerprint,
            };
            self.answer(state, claimed, parts, body).await
        }
    }

    /// Run the handler under the claim, replay the record, or refuse.
    async fn answer(
        self,
        state: KeyState<St::Claim>,
        claimed: Claimed,
        parts: Parts,
        body: Bytes,
    ) -> Served<S::ResBody, S::Error> {
        match state {
            KeyState::Acquired { claim, takeover } => {
                if takeover {
                    tracing::warn!(
                        "took over an idempotency key whose holder's lease lapsed; its handler \
                         may have run in part"
                    );
                }
                let kept = keep_for_completion(
                    &self.shared,
                    &self.principal,
                    &claim,
                    &claimed,
                    &parts,
                    &body,
                )
                .await;
                match kept {
                    Kept::Yes => {}
                    // Another request holds the key now: this one runs nothing.
                    Kept::Lost => {
                        outcome(Outcome::Conflict);
                        return Ok(reject(&self.shared.config, Rejection::in_flight()));
                    }
                    Kept::Failed => return Ok(self.unkept(claim, takeover).await),
                }
                let context = IdempotencyContext {
                    key: claimed.key,
                    scope_key: claimed.scope_key,
                    takeover,
                    fingerprint: claimed.fingerprint,
                    // Offered by `run`, which has the claim.
                    steps: Err(steps::NO_KEY),
                };
                self.run(claim, context, parts, body).await
            }
            KeyState::Completed { record, .. } => Ok(replayed(&self.shared.config, &record)),
            KeyState::InFlight { .. } => {
                outcome(Outcome::Conflict);
                Ok(reject(&self.shared.config, Rejection::in_flight()))
            }
            KeyState::Mismatch => Ok(mismatch(&self.shared.config)),
        }
    }

    /// A request the completer could not have finished, had it been left half done: refused
    /// before its handler runs, its key released (the lease frees it if that fails too). A key
    /// taken over is given back in flight instead: its first holder may have run in part, and
    /// its kept request and steps are the completer's to finish.
    async fn unkept(self, claim: St::Claim, takeover: bool) -> Response<ResponseBody<S::ResBody>> {
        let retry_after_secs = match self.shared.config.store_failure {
            StoreFailure::FailClosed { retry_after_secs } => retry_after_secs,
            StoreFailure::FailOpen => 1,
        };
        let store = &self.shared.store;
        let (given_back, what) = if takeover {
            (store.abandon(&claim).await, "giving back")
        } else {
            (store.release(&claim).await, "releasing")
        };
        if let Err(error) = given_back {
            tracing::warn!(error = %Chain(&error), "{what} an unkept request's key failed");
        }
        outcome(Outcome::StoreError);
        reject(
            &self.shared.config,
            Rejection::store_unavailable(retry_after_secs),
        )
    }

    /// The handler without protection: no key and none required, or the store down and the
    /// layer failing open.
    async fn unprotected(mut self, parts: Parts, body: Bytes) -> Served<S::ResBody, S::Error> {
        let request = Request::from_parts(parts, RequestBody::buffered(body));
        Ok(self
            .inner
            .call(request)
            .await?
            .map(ResponseBody::passthrough))
    }

    /// The store failed at claim time: `503`, or the handler without protection (fail-open).
    /// A record the store holds but cannot open is `500` under either policy: the request ran.
    pub(super) async fn store_failed(
        self,
        error: &St::Error,
        parts: Parts,
        body: Bytes,
    ) -> Served<S::ResBody, S::Error> {
        if let Some(why) = RecordUnopenable::find(error) {
            outcome(Outcome::Unopenable);
            metrics::record_unopenable();
            tracing::error!(error = %Chain(error), %why, "idempotency record does not open");
            return Ok(reject(&self.shared.config, Rejection::record_unopenable()));
        }
        outcome(Outcome::StoreError);
        tracing::error!(error = %Chain(error), "idempotency store unavailable");
        let config = Arc::clone(&self.shared.config);
        if parts.extensions.get::<Completing>().is_some() {
            return Ok(reject(&config, refuse(Refusal::StoreFailed)));
        }
        match config.store_failure {
            StoreFailure::FailClosed { retry_after_secs } => Ok(reject(
                &config,
                Rejection::store_unavailable(retry_after_secs),
            )),
            StoreFailure::FailOpen => {
                tracing::warn!("failing open: running the handler without idempotency protection");
                self.unprotected(parts, body).await
            }
        }
    }
}

/// Keeps the request for the completer, when the layer does
/// ([`with_completion`](crate::IdempotencyLayer::with_completion)).
async fn keep_for_completion<St: Store>(
    shared: &Shared<St>,
    principal: &Principal,
    claim: &St::Claim,
    claimed: &Claimed,
    parts: &Parts,
    body: &Bytes,
) -> Kept {
    let config = &*shared.config;
    let Some(completion) = &config.completion else {
        return Kept::Yes;
    };
    let keep = Keep {
        completion,
        key_header: config.key.header_name(),
        fingerprinted: config.fingerprinting.headers(),
        principal,
        parts,
        uri: request_uri(&parts.extensions, &parts.uri),
        body,
    };
    // Boxed: only layers with completion on pay for its state in the request's future.
    let kept = Box::pin(keep.under(&*shared.store, claim, &claimed.fingerprint)).await;
    match kept {
        // Failing open, the handler runs unkept, as it would run with the store down.
        Kept::Failed if config.store_failure == StoreFailure::FailOpen => Kept::Yes,
        kept => kept,
    }
}

/// What a keyed request was claimed by: its key, as sent and scoped, and its fingerprint.
struct Claimed {
    key: IdempotencyKey,
    scope_key: ScopeKey,
    fingerprint: Fingerprint,
}

/// Why a keyed request got no state to act on.
enum Unclaimed<E> {
    /// Refused before the store was asked.
    Refused(Rejection),
    /// The store failed.
    StoreFailed(E),
    /// Its client left while it waited for a key in flight.
    ClientLeft,
}

/// The request body, within the layer's size and time limits.
#[expect(
    clippy::manual_async_fn,
    reason = "the future stays small (see the service module)"
)]
fn buffer_request<B: HttpBody>(
    config: &Config,
    body: B,
) -> impl Future<Output = Result<Bytes, Rejection>> + '_ {
    async move {
        let limit = config.limits.max_request_bytes;
        let timeout = config.limits.body_timeout;
        let body = pin!(body);
        let mut buffering = pin!(body::buffer(body, limit));
        // A small body has usually arrived with the head: only a body still on its way gets a
        // timer (which costs a clock read and a count on the runtime handle shared by every
        // worker thread).
        let buffered = match poll_once(buffering.as_mut()).await {
            Poll::Ready(buffered) => buffered,
            Poll::Pending => tokio::time::timeout(timeout, buffering)
                .await
                .map_err(|_| Rejection::body_timed_out(timeout))?,
        };
        match buffered {
            Buffered::Complete(body, _trailers) => Ok(body),
            Buffered::TooLarge { .. } => Err(Rejection::body_too_large(limit)),
            Buffered::Failed { error, .. } => {
                tracing::debug!(error = %Chain(&*error), "request body could not be read");
                Err(Rejection::body_unreadable())
            }
        }
    }
}

impl<St: Store> Shared<St> {
    /// The key's state from the store's claim, waiting for a key in flight as long as the
    /// layer allows.
    #[expect(
        clippy::manual_async_fn,
        reason = "the future stays small (see the service module)"
    )]
    fn key_state<'a>(
        &'a self,
        scope_key: ScopeKey,
        fingerprint: Fingerprint,
        hang_up: Option<&'a HangUp>,
    ) -> impl Future<Output = Result<KeyState<St::Claim>, Unclaimed<St::Error>>> + 'a {
        async move {
            if self.overloaded() {
                // Handlers still finishing for clients that hung up may hold what any store
                // work needs (in transactional mode, every pooled connection): refuse at once
                // rather than queue behind them.
                outcome(Outcome::Overloaded);
                return Err(Unclaimed::Refused(Rejection::overloaded()));
            }
            let state = self
                .claim(scope_key, fingerprint)
                .await
                .map_err(Unclaimed::StoreFailed)?;
            match state {
                KeyState::InFlight { .. } if self.config.in_flight_wait.is_some() => self
                    .wait_while_in_flight(scope_key, fingerprint, hang_up)
                    .await
                    .ok_or(Unclaimed::ClientLeft),
                state => Ok(state),
            }
        }
    }

    /// Whether as many handlers run for clients that hung up as the layer allows: the smaller
    /// of [`Limits::with_max_detached`](crate::Limits::with_max_detached) and the store's
    /// [`detached_limit`](crate::store::Capabilities::detached_limit).
    pub(super) fn overloaded(&self) -> bool {
        let detached = self.detached.count();
        // Every limit is at least one: with none detached, the store need not be asked.
        if detached == 0 {
            return false;
        }
        let configured = self.config.limits.max_detached;
        let limit = self
            .store
            .capabilities()
            .detached_limit()
            .map_or(configured, |store| store.min(configured));
        detached >= limit
    }

    /// The key's state from the store's atomic claim.
    pub(super) async fn claim(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
    ) -> Result<KeyState<St::Claim>, St::Error> {
        self.claim_as(key, fingerprint, false).await
    }

    /// [`claim`](Self::claim), by a duplicate waiting for the key when `waiting`
    /// ([`ClaimRequest::waiting`]).
    pub(crate) async fn claim_as(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        waiting: bool,
    ) -> Result<KeyState<St::Claim>, St::Error> {
        let config = &self.config;
        let request = ClaimRequest {
            key,
            fingerprint,
            lease: config.lease,
            ttl: config.ttl,
            waiting,
            // Failing open, a request whose keeping failed runs anyway: its claim is no orphan.
            keeps_request: config.completion.is_some()
                && config.store_failure != StoreFailure::FailOpen,
        };
        metrics::timed("claim", self.store.claim(&request)).await
    }
}
