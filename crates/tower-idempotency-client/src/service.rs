//! The Tower side's service: see [`Idempotent`].

use std::{
    future::poll_fn,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use tower_service::Service;

use crate::{
    attempts::{Attempts, Next},
    body::ReplayBody,
    error::{BoxError, Error},
    future::ResponseFuture,
    key::OperationId,
    outcome::StopReason,
    policy::Policy,
};

/// A Tower HTTP client whose requests get their operation's key and are sent until the
/// protocol says stop; made by [`IdempotentLayer`](crate::IdempotentLayer).
///
/// Every error of the inner service is taken for a transport failure (it never answered, or
/// its answer was lost), which a keyed request may retry. The inner service is cloned for
/// each operation and polled ready again before each retry.
#[derive(Debug, Clone)]
pub struct Idempotent<S> {
    inner: S,
    policy: Arc<Policy>,
}

impl<S> Idempotent<S> {
    pub(crate) fn new(inner: S, policy: Arc<Policy>) -> Self {
        Self { inner, policy }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, B, R> Service<Request<B>> for Idempotent<S>
where
    S: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: ReplayBody + Send + 'static,
    R: Send + 'static,
{
    type Response = Response<R>;
    type Error = Error;
    type Future = ResponseFuture<R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx).map_err(|source| Error::NotReady {
            key: None,
            attempts: 0,
            source: source.into(),
        })
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service polled ready is the one to call; its clone waits for the next request
        // (https://docs.rs/tower/latest/tower/trait.Service.html#be-careful-when-cloning-inner-services).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(send(inner, Arc::clone(&self.policy), request))
    }
}

/// The operation: attempts until the protocol says stop.
async fn send<S, B, R>(
    mut inner: S,
    policy: Arc<Policy>,
    mut request: Request<B>,
) -> Result<Response<R>, Error>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: ReplayBody,
{
    let operation = request.extensions().get::<OperationId>().cloned();
    let method = request.method().clone();
    let headers = request.headers_mut();
    let mut attempts = Attempts::begin(policy, &method, headers, operation.as_ref());
    loop {
        let spare = attempts.may_retry().then(|| copy(&request)).flatten();
        let replayable = spare.is_some();
        if attempts.made() > 0
            && let Err(error) = poll_fn(|cx| inner.poll_ready(cx)).await
        {
            return Err(attempts.not_ready(error.into()));
        }
        let bound = attempts.start_attempt();
        let Ok(sent) = tokio::time::timeout(bound, inner.call(request)).await else {
            return Err(attempts.deadline_exceeded());
        };
        let sent = sent.map_err(Into::<BoxError>::into);
        let step = match &sent {
            Ok(answer) => attempts.after_response(answer.status(), answer.headers(), replayable),
            Err(_) => attempts.after_error(true, replayable),
        };
        let (wait, spare) = match (step, spare) {
            (Next::Retry(wait), Some(spare)) => (wait, spare),
            // Not reached: a retry is only planned with a copy at hand.
            (Next::Retry(_), None) => return finish(&attempts, StopReason::StreamingBody, sent),
            (Next::Stop(reason), _) => return finish(&attempts, reason, sent),
            (Next::KeyReused, _) => return Err(attempts.key_reused(None)),
        };
        // The answer is let go before the wait, so that it holds no connection through it.
        drop(sent);
        tokio::time::sleep(wait).await;
        request = spare;
    }
}

/// The last attempt's answer with its [`Outcome`](crate::Outcome), or its failure as an
/// [`Error::Transport`].
fn finish<R>(
    attempts: &Attempts,
    reason: StopReason,
    sent: Result<Response<R>, BoxError>,
) -> Result<Response<R>, Error> {
    match sent {
        Ok(mut answer) => {
            let outcome = attempts.outcome(answer.headers(), reason);
            answer.extensions_mut().insert(outcome);
            Ok(answer)
        }
        Err(error) => Err(attempts.gave_up(reason, error)),
    }
}

/// A copy of `request` to send again, if its body gives one.
fn copy<B: ReplayBody>(request: &Request<B>) -> Option<Request<B>> {
    let body = request.body().try_replay()?;
    let mut copy = Request::new(body);
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    *copy.extensions_mut() = request.extensions().clone();
    Some(copy)
}
