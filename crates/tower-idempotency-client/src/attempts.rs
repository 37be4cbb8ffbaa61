//! One operation's attempts: its key, their count, the deadline, and what comes after each.
//! The reqwest middleware and the Tower service both run their loop on it.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use tokio::time::Instant;

use crate::{
    classify::{self, Verdict},
    error::{BoxError, Error},
    key::{self, IdempotencyKey, OperationId},
    outcome::{Outcome, StopReason},
    policy::Policy,
};

/// Whether a request may be sent more than once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retries {
    /// It carries a key: the server runs it once however often it is sent.
    Keyed,
    /// Its method is idempotent by itself (RFC 9110 §9.2.2).
    Idempotent,
    /// Neither: sent once.
    Never,
}

/// What comes after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Another attempt, after this wait.
    Retry(Duration),
    /// No other attempt: the last one's answer or failure is the operation's.
    Stop(StopReason),
    /// The server refused the key as used with another payload.
    KeyReused,
}

/// One operation under a [`Policy`].
#[derive(Debug)]
pub(crate) struct Attempts {
    policy: Arc<Policy>,
    key: Option<IdempotencyKey>,
    retries: Retries,
    started: Instant,
    made: u32,
}

impl Attempts {
    /// Starts the operation of a request: gives it its key in `headers` if its method gets one.
    /// A key the caller set on any unsafe method is kept and makes it retryable.
    pub(crate) fn begin(
        policy: Arc<Policy>,
        method: &Method,
        headers: &mut HeaderMap,
        operation: Option<&OperationId>,
    ) -> Self {
        let keyed = policy.methods().contains(method)
            || (!method.is_safe() && headers.contains_key(policy.key_header()));
        let key = keyed.then(|| {
            let (name, format) = (policy.key_header(), policy.key_format());
            key::attach(headers, name, format, policy.namespace(), operation)
        });
        let retries = if keyed {
            Retries::Keyed
        } else if method.is_idempotent() {
            Retries::Idempotent
        } else {
            Retries::Never
        };
        Self {
            policy,
            key,
            retries,
            started: Instant::now(),
            made: 0,
        }
    }

    /// Whether a retry is possible at all: worth keeping a copy of the request for.
    pub(crate) fn may_retry(&self) -> bool {
        self.retries != Retries::Never
    }

    /// Counts an attempt about to be sent; returns the time it has before the deadline.
    pub(crate) fn start_attempt(&mut self) -> Duration {
        self.made += 1;
        self.remaining()
    }

    /// How many attempts were started.
    #[cfg(feature = "tower")]
    pub(crate) fn made(&self) -> u32 {
        self.made
    }

    fn remaining(&self) -> Duration {
        self.policy
            .deadline()
            .saturating_sub(self.started.elapsed())
    }

    /// What follows an answer; `replayable`: a copy of the request is at hand.
    pub(crate) fn after_response(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        replayable: bool,
    ) -> Next {
        let keyed = self.key.is_some();
        match classify::verdict(status, headers, keyed, self.policy.retries_500()) {
            Verdict::Final => Next::Stop(StopReason::Final),
            Verdict::KeyReused => Next::KeyReused,
            Verdict::Retry { after } => self.retry(after, replayable),
        }
    }

    /// What follows a failure to get an answer; `transient`: a new attempt may not meet it.
    pub(crate) fn after_error(&self, transient: bool, replayable: bool) -> Next {
        if transient {
            self.retry(None, replayable)
        } else {
            Next::Stop(StopReason::NotTransient)
        }
    }

    /// A retry after the server's `after` (if any) and the backoff, unless something stops it.
    fn retry(&self, after: Option<Duration>, replayable: bool) -> Next {
        let stop = |reason| Next::Stop(reason);
        if self.retries == Retries::Never {
            return stop(StopReason::NotIdempotent);
        }
        if !replayable {
            return stop(StopReason::StreamingBody);
        }
        if self.made >= self.policy.max_attempts() {
            return stop(StopReason::AttemptsExhausted);
        }
        let remaining = self.remaining();
        if after.is_some_and(|after| after > remaining) {
            return stop(StopReason::RetryAfterPastDeadline);
        }
        let backoff = self.policy.backoff.delay(self.made.saturating_sub(1));
        let wait = after.unwrap_or_default().max(backoff);
        if wait >= remaining {
            return stop(StopReason::Deadline);
        }
        Next::Retry(wait)
    }

    /// The [`Outcome`] of an answer with these `headers`, the last for `stop`.
    pub(crate) fn outcome(&self, headers: &HeaderMap, stop: StopReason) -> Outcome {
        Outcome {
            key: self.key.clone(),
            attempts: self.made,
            replayed: classify::replayed(headers, self.policy.replay_header()),
            stop,
        }
    }

    /// [`Error::KeyReused`], with the server's answer body if read.
    pub(crate) fn key_reused(&self, problem: Option<Bytes>) -> Error {
        match &self.key {
            Some(key) => Error::KeyReused {
                key: key.clone(),
                attempts: self.made,
                problem,
            },
            // A `422` is only a reused key for a keyed request (see `classify::verdict`).
            None => self.gave_up(StopReason::Final, "422 without a key".into()),
        }
    }

    /// [`Error::Transport`]: the last attempt failed with `source`.
    pub(crate) fn gave_up(&self, reason: StopReason, source: BoxError) -> Error {
        Error::Transport {
            key: self.key.clone(),
            attempts: self.made,
            reason,
            source,
        }
    }

    /// [`Error::DeadlineExceeded`]: the deadline passed during the last attempt.
    pub(crate) fn deadline_exceeded(&self) -> Error {
        Error::DeadlineExceeded {
            key: self.key.clone(),
            attempts: self.made,
            deadline: self.policy.deadline(),
        }
    }

    /// [`Error::NotReady`]: the service failed getting ready for the next attempt.
    #[cfg(feature = "tower")]
    pub(crate) fn not_ready(&self, source: BoxError) -> Error {
        Error::NotReady {
            key: self.key.clone(),
            attempts: self.made,
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, header::RETRY_AFTER};

    fn policy() -> Arc<Policy> {
        let policy = Policy::new()
            .with_max_attempts(3)
            .and_then(|p| p.with_deadline(Duration::from_secs(10)))
            .and_then(|p| p.with_backoff(Duration::from_millis(100), Duration::from_secs(1)));
        Arc::new(policy.expect("valid"))
    }

    fn begin(method: Method) -> (Attempts, HeaderMap) {
        let mut headers = HeaderMap::new();
        let attempts = Attempts::begin(policy(), &method, &mut headers, None);
        (attempts, headers)
    }

    fn retry_after(seconds: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static(seconds));
        headers
    }

    #[test]
    fn posts_get_keys_and_safe_methods_none() {
        let (post, headers) = begin(Method::POST);
        assert!(post.key.is_some() && headers.contains_key("idempotency-key"));
        let (get, headers) = begin(Method::GET);
        assert!(get.key.is_none() && headers.is_empty());
        assert!(get.may_retry(), "GET is idempotent by itself");
        let (connect, _) = begin(Method::CONNECT);
        assert!(!connect.may_retry());
    }

    #[tokio::test(start_paused = true)]
    async fn retries_stop_at_the_attempt_limit() {
        let (mut attempts, _) = begin(Method::POST);
        let unavailable = StatusCode::SERVICE_UNAVAILABLE;
        for _ in 0..2 {
            attempts.start_attempt();
            let next = attempts.after_response(unavailable, &HeaderMap::new(), true);
            assert!(matches!(next, Next::Retry(wait) if wait <= Duration::from_secs(1)));
        }
        attempts.start_attempt();
        let last = attempts.after_response(unavailable, &HeaderMap::new(), true);
        assert_eq!(last, Next::Stop(StopReason::AttemptsExhausted));
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_is_a_floor_and_past_the_deadline_a_stop() {
        let (mut attempts, _) = begin(Method::POST);
        attempts.start_attempt();
        let conflict = StatusCode::CONFLICT;
        let next = attempts.after_response(conflict, &retry_after("2"), true);
        assert_eq!(next, Next::Retry(Duration::from_secs(2)));
        tokio::time::advance(Duration::from_secs(9)).await;
        let next = attempts.after_response(conflict, &retry_after("2"), true);
        assert_eq!(next, Next::Stop(StopReason::RetryAfterPastDeadline));
        tokio::time::advance(Duration::from_millis(999)).await;
        let next = attempts.after_error(true, true);
        assert_eq!(next, Next::Stop(StopReason::Deadline));
    }

    #[test]
    fn what_cannot_be_sent_again_is_not() {
        let (mut post, _) = begin(Method::POST);
        post.start_attempt();
        assert_eq!(
            post.after_error(true, false),
            Next::Stop(StopReason::StreamingBody)
        );
        assert_eq!(
            post.after_error(false, true),
            Next::Stop(StopReason::NotTransient)
        );
        let gone = StatusCode::GONE;
        assert_eq!(
            post.after_response(gone, &HeaderMap::new(), true),
            Next::Stop(StopReason::Final)
        );
        let reused = StatusCode::UNPROCESSABLE_ENTITY;
        assert_eq!(
            post.after_response(reused, &HeaderMap::new(), true),
            Next::KeyReused
        );
        let (mut connect, _) = begin(Method::CONNECT);
        connect.start_attempt();
        assert_eq!(
            connect.after_error(true, true),
            Next::Stop(StopReason::NotIdempotent)
        );
    }

    #[test]
    fn a_callers_key_on_put_makes_it_keyed() {
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", HeaderValue::from_static("mine"));
        let attempts = Attempts::begin(policy(), &Method::PUT, &mut headers, None);
        assert_eq!(attempts.key.as_ref().map(|k| k.as_str()), Some("mine"));
    }
}
