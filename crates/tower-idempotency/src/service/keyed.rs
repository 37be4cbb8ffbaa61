//! A keyed request on its way: its body buffered and fingerprinted, its key looked up (the
//! replay cache, then the store's atomic claim), and the handler run, the replay sent, or the
//! request refused.

use super::*;

impl<S: Inner<ReqBody>, St: Store, ReqBody: HttpBody> Keyed<S, St, ReqBody> {
    /// Body and fingerprint, then the claim. Unless the app chose [`Disconnect::Cancel`], the
    /// response future hands this future to a task of its own if it is dropped unfinished (the
    /// client hung up), so a handler is never stopped half-way.
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
            let limit = config.max_body_bytes;
            let timeout = config.body_timeout;
            let body = pin!(body);
            let mut buffering = pin!(body::buffer(body, limit));
            // A small body has usually arrived with the head: only a body still on its way gets a
            // timer (which costs a clock read and a count on the runtime handle shared by every
            // worker thread).
            let buffered = match poll_once(buffering.as_mut()).await {
                Poll::Ready(buffered) => buffered,
                Poll::Pending => match tokio::time::timeout(timeout, buffering).await {
                    Ok(buffered) => buffered,
                    Err(_) => {
                        return Ok(reject(
                            config,
                            Rejection::new(
                                RejectionKind::BodyTimeout,
                                format!(
                                    "the request body did not arrive within {timeout:?}; nothing was \
                             processed"
                                ),
                            ),
                        ));
                    }
                },
            };
            let body = match buffered {
                Buffered::Complete(body, _trailers) => body,
                Buffered::TooLarge { .. } => {
                    return Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::BodyTooLarge,
                            format!(
                                "the request body exceeds {limit} bytes; nothing was processed"
                            ),
                        ),
                    ));
                }
                Buffered::Failed { error, .. } => {
                    tracing::debug!(error = %Chain(&*error), "request body could not be read");
                    return Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::BodyUnreadable,
                            "the request body could not be read; nothing was processed",
                        ),
                    ));
                }
            };
            let key = match self.key.take() {
                Some(key) => key,
                None => match config.key_from_request(&parts, &body) {
                    Ok(Some(key)) => key,
                    Ok(None) => {
                        // No key, not required: the handler runs unprotected, as with no header.
                        let mut inner = self.inner;
                        let request = Request::from_parts(parts, RequestBody::buffered(body));
                        return Ok(inner.call(request).await?.map(ResponseBody::passthrough));
                    }
                    Err(rejection) => return Ok(reject(config, rejection)),
                },
            };
            let uri = request_uri(&parts.extensions, &parts.uri);
            let scope_key = config
                .scope
                .key(&self.principal, &parts.method, uri.path(), &key);
            tracing::Span::current().record("key", tracing::field::display(scope_key));
            let fingerprint = crate::fingerprint::compute_for_request(
                &config.fingerprint,
                &parts.method,
                uri,
                &parts.headers,
                &body,
            )
            .await;

            // Claim, then run, replay or refuse.
            let begin = match self.shared.cached(scope_key, fingerprint) {
                Some(begin) => begin,
                None if self.shared.overloaded() => {
                    // Handlers still finishing for clients that hung up may hold what any store
                    // work needs (in transactional mode, every pooled connection): refuse at
                    // once rather than queue behind them.
                    outcome(Outcome::Overloaded);
                    return Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::Overloaded,
                            "too many requests are still finishing for clients that went away; \
                             nothing was processed, retry with the same Idempotency-Key",
                        )
                        .with_retry_after(1),
                    ));
                }
                None => match self.shared.claim(scope_key, fingerprint).await {
                    Ok(begin) => begin,
                    Err(error) => return self.store_failed(&error, parts, body).await,
                },
            };
            let begin = match begin {
                KeyState::InFlight { .. } if !config.in_flight_wait.is_zero() => {
                    let hang_up = self.hang_up.as_deref();
                    match self
                        .shared
                        .wait_while_in_flight(scope_key, fingerprint, hang_up)
                        .await
                    {
                        Some(begin) => begin,
                        // Its client left: nobody reads this answer.
                        None => return Ok(config.rendering.render(in_flight_rejection())),
                    }
                }
                begin => begin,
            };
            match begin {
                KeyState::Acquired { claim, takeover } => {
                    if takeover {
                        tracing::warn!(
                            "took over an idempotency key whose holder's lease lapsed; \
                         its handler may have run in part"
                        );
                    }
                    let context = IdempotencyContext {
                        key,
                        scope_key,
                        takeover,
                    };
                    self.run(claim, context, parts, body).await
                }
                KeyState::Completed { record, .. } => Ok(replayed(&record)),
                KeyState::InFlight { .. } => {
                    outcome(Outcome::Conflict);
                    Ok(reject(config, in_flight_rejection()))
                }
                KeyState::Mismatch => Ok(mismatch(config)),
            }
        }
    }

    /// The store failed at claim time: `503`, or the handler without protection (fail-open).
    pub(super) async fn store_failed(
        mut self,
        error: &St::Error,
        parts: Parts,
        body: Bytes,
    ) -> Served<S::ResBody, S::Error> {
        outcome(Outcome::StoreError);
        tracing::error!(error = %Chain(error), "idempotency store unavailable");
        let config = Arc::clone(&self.shared.config);
        match config.store_failure {
            StoreFailure::FailClosed { retry_after_secs } => Ok(reject(
                &config,
                Rejection::new(
                    RejectionKind::StoreUnavailable,
                    "the idempotency store is unavailable, so the request was not processed; \
                     retry with the same Idempotency-Key",
                )
                .with_retry_after(retry_after_secs),
            )),
            StoreFailure::FailOpen => {
                tracing::warn!("failing open: running the handler without idempotency protection");
                let response = self
                    .inner
                    .call(Request::from_parts(parts, RequestBody::buffered(body)))
                    .await?;
                Ok(response.map(ResponseBody::passthrough))
            }
        }
    }
}

/// The `409` for a key in flight.
fn in_flight_rejection() -> Rejection {
    Rejection::new(
        RejectionKind::InFlight,
        "a request with this Idempotency-Key is still being processed; retry after the \
         Retry-After delay to get its response",
    )
}

impl<St: Store> Shared<St> {
    /// Whether as many handlers run for clients that hung up as the layer allows: the smaller
    /// of [`with_max_detached`](crate::IdempotencyLayer::with_max_detached) and the store's
    /// [`detached_limit`](crate::store::Capabilities::detached_limit).
    pub(super) fn overloaded(&self) -> bool {
        let configured = self.config.max_detached;
        let limit = self
            .store
            .capabilities()
            .detached_limit()
            .map_or(configured, |store| store.min(configured));
        self.detached.count() >= limit
    }

    /// The key's state if the replay cache knows it.
    pub(super) fn cached(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
    ) -> Option<KeyState<St::Claim>> {
        match self.cache.get(&key, &fingerprint)? {
            Hit::Replay(record) => Some(KeyState::Completed {
                record,
                expires_in: None,
            }),
            Hit::Mismatch => Some(KeyState::Mismatch),
        }
    }

    /// The key's state from the store's atomic claim; a completed record it returns is cached
    /// for the next retry.
    pub(super) async fn claim(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
    ) -> Result<KeyState<St::Claim>, St::Error> {
        self.claim_as(key, fingerprint, false).await
    }

    /// [`claim`](Self::claim), by a duplicate waiting for the key when `waiting`
    /// ([`ClaimRequest::waiting`]).
    pub(super) async fn claim_as(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        waiting: bool,
    ) -> Result<KeyState<St::Claim>, St::Error> {
        let request = ClaimRequest {
            key,
            fingerprint,
            lease: self.config.lease,
            ttl: self.config.ttl,
            waiting,
        };
        let begin = metrics::timed("claim", self.store.claim(&request)).await?;
        if let KeyState::Completed {
            record,
            expires_in: Some(expires_in),
        } = &begin
        {
            self.cache.insert(key, fingerprint, record, *expires_in);
        }
        Ok(begin)
    }
}
