//! What the charge came to, as one JSON line and an exit status: see [`Report`].

use std::error::Error as StdError;

use serde_json::{Value, json};
use tower_idempotency_client::{Error, Outcome};

/// The charge's answer (or why there is none), its key and attempts.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Report {
    status: Option<u16>,
    key: Option<String>,
    attempts: u32,
    replayed: bool,
    body: Value,
    /// Why there is no usable answer, with its causes.
    error: Option<String>,
}

impl Report {
    /// The report of what the middleware returned.
    pub(crate) async fn of(sent: reqwest_middleware::Result<reqwest::Response>) -> Self {
        let error = match sent {
            Ok(response) => return Self::answered(response).await,
            Err(reqwest_middleware::Error::Middleware(error)) => error,
            Err(other) => return Self::failed(None, 0, chain(&other)),
        };
        match error.downcast_ref::<Error>() {
            Some(Error::KeyReused {
                key,
                attempts,
                problem,
            }) => Self {
                status: Some(422),
                key: Some(key.to_string()),
                attempts: *attempts,
                replayed: false,
                body: problem.as_deref().map_or(Value::Null, parse),
                error: Some(error.to_string()),
            },
            Some(typed) => {
                let key = typed.key().map(ToString::to_string);
                Self::failed(key, typed.attempts(), chain(typed))
            }
            None => Self::failed(None, 0, chain(error.as_ref())),
        }
    }

    /// An answer: its status, body and [`Outcome`].
    async fn answered(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let outcome = response.extensions().get::<Outcome>().cloned();
        let (key, attempts, replayed) = match &outcome {
            Some(o) => (o.key().map(ToString::to_string), o.attempts(), o.replayed()),
            None => (None, 1, false),
        };
        let (body, error) = match response.bytes().await {
            Ok(body) => (parse(&body), None),
            Err(cut) => (
                Value::Null,
                Some(format!("the answer's body was cut: {cut}")),
            ),
        };
        Self {
            status: Some(status),
            key,
            attempts,
            replayed,
            body,
            error,
        }
    }

    fn failed(key: Option<String>, attempts: u32, error: String) -> Self {
        Self {
            status: None,
            key,
            attempts,
            replayed: false,
            body: Value::Null,
            error: Some(error),
        }
    }

    /// Nothing was sent: the client could not be set up.
    pub(crate) fn unsent(why: &str) -> Self {
        Self::failed(None, 0, why.to_owned())
    }

    /// The JSON line (`error` only when there is one).
    pub(crate) fn line(&self) -> String {
        let mut line = json!({
            "status": self.status,
            "key": self.key,
            "attempts": self.attempts,
            "replayed": self.replayed,
            "body": self.body,
        });
        if let (Some(error), Some(fields)) = (&self.error, line.as_object_mut()) {
            fields.insert("error".to_owned(), Value::from(error.as_str()));
        }
        line.to_string()
    }

    /// `0` for a whole `2xx` or `402` answer, `2` for a `422`, `1` otherwise.
    pub(crate) fn exit_code(&self) -> u8 {
        match (self.status, &self.error) {
            (Some(422), _) => 2,
            (Some(status), None) if (200..300).contains(&status) || status == 402 => 0,
            _ => 1,
        }
    }
}

/// The body as JSON, or as a string if it is not.
fn parse(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::from(String::from_utf8_lossy(body).into_owned()))
}

/// `error` and its causes, joined by `: `.
fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16) -> Report {
        Report {
            status: Some(status),
            key: Some("k".to_owned()),
            attempts: 1,
            replayed: false,
            body: Value::Null,
            error: None,
        }
    }

    #[test]
    fn exit_codes_follow_the_status() {
        for (status, code) in [(200, 0), (201, 0), (402, 0), (422, 2), (400, 1), (409, 1)] {
            assert_eq!(answered(status).exit_code(), code, "{status}");
        }
        assert_eq!(Report::unsent("no client").exit_code(), 1);
        let cut = Report {
            error: Some("cut".to_owned()),
            ..answered(200)
        };
        assert_eq!(cut.exit_code(), 1, "an answer without its body");
    }

    #[test]
    fn the_line_has_the_five_fields_and_an_error_only_when_there_is_one() {
        let line: Value = serde_json::from_str(&answered(200).line()).expect("JSON");
        let mut fields: Vec<_> = line
            .as_object()
            .expect("an object")
            .keys()
            .cloned()
            .collect();
        fields.sort();
        assert_eq!(fields, ["attempts", "body", "key", "replayed", "status"]);
        let line: Value = serde_json::from_str(&Report::unsent("why").line()).expect("JSON");
        assert_eq!(
            (&line["status"], &line["error"]),
            (&Value::Null, &json!("why"))
        );
    }
}
