//! The retries a payments API sees, sent to each server over real HTTP, with a fresh key each:
//! how many times the handler ran, and what the client got back.

use std::time::Duration;

use futures_util::future::join_all;
use reqwest::{Client, StatusCode};
use serde_json::json;

use crate::servers::{LOGIN, Server, session_cookie};

/// The cases, in the order they are reported.
pub(crate) const CASES: [Case; 6] = [
    Case::LostResponseNoCookies,
    Case::LostResponseWithSession,
    Case::DoubleClick,
    Case::ChangedPayload,
    Case::HangUp,
    Case::OtherAccount,
];

/// One situation.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Case {
    /// The response is lost, the client retries: an API client that keeps no cookies, as
    /// Stripe's SDKs and most server-to-server clients.
    LostResponseNoCookies,
    /// The same from a client that opened a session first and sends its cookie.
    LostResponseWithSession,
    /// Ten copies of one request at once (a double click, an impatient retry loop).
    DoubleClick,
    /// The key reused with another amount after the first completed.
    ChangedPayload,
    /// The client hangs up while the handler runs, then retries.
    HangUp,
    /// Another account sends the same key (with a session of its own).
    OtherAccount,
}

impl Case {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::LostResponseNoCookies => {
                "retry after a lost response, client without a cookie jar (Stripe's SDKs)"
            }
            Self::LostResponseWithSession => {
                "retry after a lost response, client sending its session cookie"
            }
            Self::DoubleClick => "10 identical requests at once (session cookie sent)",
            Self::ChangedPayload => "the key reused with another amount (session cookie sent)",
            Self::HangUp => "client hangs up mid-handler, then retries (session cookie sent)",
            Self::OtherAccount => "another account sends the same key",
        }
    }

    /// What a payments API needs to see.
    pub(crate) fn expected(self) -> &'static str {
        match self {
            Self::LostResponseNoCookies | Self::LostResponseWithSession | Self::HangUp => {
                "1 run, the retry replays it"
            }
            Self::DoubleClick => "1 run; the others 409 or replays",
            Self::ChangedPayload => "1 run, the reuse refused (422)",
            Self::OtherAccount => "2 runs: each account its own",
        }
    }
}

/// What one case did on one server.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// Handler runs for the case's key(s).
    pub(crate) runs: u32,
    /// The answers, in order: status, and `(replay)` when marked `Idempotent-Replayed`.
    pub(crate) answers: Vec<String>,
}

/// A client of one server: an account, and the session cookie once it has one.
struct Caller<'a> {
    http: &'a Client,
    server: &'a Server,
    account: &'static str,
    cookie: Option<String>,
}

impl<'a> Caller<'a> {
    fn new(http: &'a Client, server: &'a Server, account: &'static str) -> Self {
        Self {
            http,
            server,
            account,
            cookie: None,
        }
    }

    /// Opens a session (the peer sets its cookie; the others answer 204 and set none).
    async fn sign_in(&mut self) -> reqwest::Result<()> {
        let response = self
            .http
            .post(self.server.url(LOGIN))
            .bearer_auth(self.account)
            .send()
            .await?
            .error_for_status()?;
        self.cookie = session_cookie(&response);
        Ok(())
    }

    /// Posts a charge of `amount` with `key`; `None` when the client gave up (`timeout`).
    async fn charge(&self, key: &str, amount: i64, timeout: Option<Duration>) -> Option<String> {
        let mut request = self
            .http
            .post(self.server.url(crate::servers::CHARGES))
            .bearer_auth(self.account)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": amount, "currency": "usd" }));
        if let Some(cookie) = &self.cookie {
            request = request.header(reqwest::header::COOKIE, cookie);
        }
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        match request.send().await {
            Ok(response) => {
                let replayed = response.headers().contains_key("idempotent-replayed");
                Some(describe(response.status(), replayed))
            }
            Err(error) if error.is_timeout() => None,
            Err(error) => Some(format!("error: {error}")),
        }
    }
}

fn describe(status: StatusCode, replayed: bool) -> String {
    if replayed {
        format!("{} (replay)", status.as_u16())
    } else {
        status.as_u16().to_string()
    }
}

/// Runs `case` against `server` with a key of its own, `delay` being the handler's duration.
pub(crate) async fn run(
    case: Case,
    server: &Server,
    http: &Client,
    key: &str,
    delay: Duration,
) -> reqwest::Result<Outcome> {
    let mut caller = Caller::new(http, server, "acct_a");
    if !matches!(case, Case::LostResponseNoCookies) {
        caller.sign_in().await?;
    }
    let mut answers = Vec::new();
    let mut push = |answer: Option<String>| answers.push(answer.unwrap_or("hung up".to_owned()));
    match case {
        Case::LostResponseNoCookies | Case::LostResponseWithSession => {
            push(caller.charge(key, 1000, None).await);
            push(caller.charge(key, 1000, None).await);
        }
        Case::DoubleClick => {
            let all = join_all((0..10).map(|_| caller.charge(key, 1000, None))).await;
            for answer in all {
                push(answer);
            }
            // Then one more retry, once everything settled.
            push(caller.charge(key, 1000, None).await);
        }
        Case::ChangedPayload => {
            push(caller.charge(key, 1000, None).await);
            push(caller.charge(key, 9999, None).await);
        }
        Case::HangUp => {
            let before = server.ledger.finished_runs();
            push(caller.charge(key, 1000, Some(delay / 4)).await);
            // The retry comes once the first run could have finished (it may have been
            // dropped with the connection: then this waits out the limit).
            server
                .ledger
                .finished(before + 1, delay * 2 + Duration::from_millis(500))
                .await;
            push(caller.charge(key, 1000, None).await);
        }
        Case::OtherAccount => {
            push(caller.charge(key, 1000, None).await);
            let mut other = Caller::new(http, server, "acct_b");
            other.sign_in().await?;
            push(other.charge(key, 1000, None).await);
        }
    }
    Ok(Outcome {
        runs: server.ledger.executions(key),
        answers,
    })
}
