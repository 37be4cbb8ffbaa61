//! The reqwest side: [`IdempotentMiddleware`], for `reqwest-middleware`'s client.

use std::{error::Error as StdError, io, sync::Arc};

use bytes::{Bytes, BytesMut};
use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use crate::{
    attempts::{Attempts, Next as Step},
    error::Error,
    key::OperationId,
    outcome::StopReason,
    policy::Policy,
};

/// The most of a `422`'s body kept in [`Error::KeyReused`].
const PROBLEM_LIMIT: usize = 64 * 1024;

/// Gives each request its operation's key and sends it until the protocol says stop; see
/// [the crate docs](crate).
///
/// Add it with `reqwest_middleware::ClientBuilder::with`, before middleware that should see
/// each attempt (the ones added after it run inside its loop, once per attempt). An
/// [`OperationId`] given with `RequestBuilder::with_extension` derives the key.
#[derive(Debug, Clone)]
pub struct IdempotentMiddleware {
    policy: Arc<Policy>,
}

impl IdempotentMiddleware {
    /// The middleware under `policy`.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }

    /// Its policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

impl Default for IdempotentMiddleware {
    fn default() -> Self {
        Self::new(Policy::default())
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotentMiddleware {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let operation = extensions.get::<OperationId>().cloned();
        let policy = Arc::clone(&self.policy);
        let method = request.method().clone();
        let headers = request.headers_mut();
        let mut attempts = Attempts::begin(policy, &method, headers, operation.as_ref());
        loop {
            // `None` for a streaming body: it is sent once.
            let spare = attempts.may_retry().then(|| request.try_clone()).flatten();
            let replayable = spare.is_some();
            let bound = attempts.start_attempt();
            let sending = next.clone().run(request, extensions);
            let Ok(sent) = tokio::time::timeout(bound, sending).await else {
                return Err(fail(attempts.deadline_exceeded()));
            };
            let step = match &sent {
                Ok(answer) => {
                    attempts.after_response(answer.status(), answer.headers(), replayable)
                }
                Err(error) => attempts.after_error(is_transient(error), replayable),
            };
            let (wait, spare) = match (step, spare) {
                (Step::Retry(wait), Some(spare)) => (wait, spare),
                // Not reached: a retry is only planned with a copy at hand.
                (Step::Retry(_), None) => {
                    return finish(&attempts, StopReason::StreamingBody, sent);
                }
                (Step::Stop(reason), _) => return finish(&attempts, reason, sent),
                (Step::KeyReused, _) => {
                    let problem = match sent {
                        Ok(answer) => problem(answer).await,
                        Err(_) => None,
                    };
                    return Err(fail(attempts.key_reused(problem)));
                }
            };
            // The answer is let go before the wait, so that it holds no connection through it.
            drop(sent);
            tokio::time::sleep(wait).await;
            request = spare;
        }
    }
}

/// The last attempt's answer with its [`Outcome`](crate::Outcome), or its failure as an
/// [`Error::Transport`].
fn finish(
    attempts: &Attempts,
    reason: StopReason,
    sent: reqwest_middleware::Result<Response>,
) -> reqwest_middleware::Result<Response> {
    match sent {
        Ok(mut answer) => {
            let outcome = attempts.outcome(answer.headers(), reason);
            answer.extensions_mut().insert(outcome);
            Ok(answer)
        }
        Err(error) => Err(fail(attempts.gave_up(reason, Box::new(error)))),
    }
}

fn fail(error: Error) -> reqwest_middleware::Error {
    reqwest_middleware::Error::Middleware(anyhow::Error::new(error))
}

/// Whether a new attempt may get past `error`: reqwest's connection errors, timeouts and
/// failures sending the request; another middleware's I/O failures and timeouts.
fn is_transient(error: &reqwest_middleware::Error) -> bool {
    match error {
        reqwest_middleware::Error::Reqwest(error) => {
            error.is_connect() || error.is_timeout() || error.is_request()
        }
        reqwest_middleware::Error::Middleware(error) => is_transient_chain(error.as_ref()),
    }
}

/// Whether `error`'s chain holds a failure that a new attempt may not meet: an I/O error of a
/// dropped or refused connection, or a timeout.
fn is_transient_chain(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(io) = error.downcast_ref::<io::Error>()
            && is_transient_io(io.kind())
        {
            return true;
        }
        if error.is::<tokio::time::error::Elapsed>() {
            return true;
        }
        next = error.source();
    }
    false
}

fn is_transient_io(kind: io::ErrorKind) -> bool {
    use io::ErrorKind::{
        BrokenPipe, ConnectionAborted, ConnectionRefused, ConnectionReset, NotConnected, TimedOut,
        UnexpectedEof,
    };
    matches!(
        kind,
        BrokenPipe
            | ConnectionAborted
            | ConnectionRefused
            | ConnectionReset
            | NotConnected
            | TimedOut
            | UnexpectedEof
    )
}

/// The first [`PROBLEM_LIMIT`] bytes of `answer`'s body; `None` if it cannot be read.
async fn problem(mut answer: Response) -> Option<Bytes> {
    let mut body = BytesMut::new();
    while body.len() < PROBLEM_LIMIT {
        match answer.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            Ok(None) => break,
            Err(_) => return None,
        }
    }
    body.truncate(PROBLEM_LIMIT);
    Some(body.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapped(#[source] io::Error);

    #[test]
    fn transient_failures_are_found_down_the_chain() {
        let reset = Wrapped(io::Error::from(io::ErrorKind::ConnectionReset));
        assert!(is_transient_chain(&reset));
        let denied = Wrapped(io::Error::from(io::ErrorKind::PermissionDenied));
        assert!(!is_transient_chain(&denied));
        let invalid = http::Method::from_bytes(b"\n").expect_err("invalid");
        assert!(!is_transient_chain(&invalid));
    }
}
