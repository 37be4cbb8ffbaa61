//! Answering a retry: the stored record as a response (see [`Record`](crate::Record#replays)).

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, header};

use crate::{problem::PROBLEM_JSON, record::Record};

/// The problem `type` of a replay whose body was not stored.
pub const BODY_NOT_STORED_TYPE: &str = "https://docs.rs/tower-idempotency/latest/tower_idempotency/struct.Record.html#responses-too-large-to-store";

/// The `Idempotent-Replay-Body` response header: `omitted` on a replay whose original body was
/// too large to keep, so a client tells the problem document standing in for it from the
/// original body without reading it (see [`Record`](crate::Record#responses-too-large-to-store)).
pub static IDEMPOTENT_REPLAY_BODY: HeaderName = HeaderName::from_static("idempotent-replay-body");

/// The replay of `record`, marked by the header `replayed`.
pub(crate) fn response<B: From<Bytes>>(record: &Record, replayed: &HeaderName) -> Response<B> {
    let mut response = Response::new(B::from(Bytes::new()));
    *response.status_mut() = record.status();
    *response.headers_mut() = record.headers().clone();
    let body = match record.body() {
        Some(body) => body.clone(),
        None => {
            let headers = response.headers_mut();
            // Every header that describes the body that was not kept.
            for name in [
                header::CONTENT_TYPE,
                header::CONTENT_ENCODING,
                header::CONTENT_RANGE,
                header::CONTENT_LANGUAGE,
                header::CONTENT_LOCATION,
                header::CONTENT_DISPOSITION,
                header::ETAG,
                header::LAST_MODIFIED,
            ] {
                headers.remove(name);
            }
            for name in ["content-digest", "repr-digest", "digest", "content-md5"] {
                headers.remove(name);
            }
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
            headers.insert(&IDEMPOTENT_REPLAY_BODY, HeaderValue::from_static("omitted"));
            body_not_stored(record)
        }
    };
    *response.body_mut() = B::from(body);
    response
        .headers_mut()
        .insert(replayed, HeaderValue::from_static("true"));
    response
}

fn body_not_stored(record: &Record) -> Bytes {
    let status = record.status();
    let problem = serde_json::json!({
        "type": BODY_NOT_STORED_TYPE,
        "title": "Original response body was not stored",
        "status": status.as_u16(),
        "detail": "The request with this Idempotency-Key was processed; its response was \
                   delivered once but was too large to keep for replay. The status is the \
                   original one.",
    });
    serde_json::to_vec(&problem)
        .map(Bytes::from)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, StatusCode};
    use http_body_util::{BodyExt, Full};

    use super::*;
    use crate::record::IDEMPOTENT_REPLAYED;

    #[tokio::test]
    async fn replays_status_headers_and_exact_bytes() {
        let mut headers = HeaderMap::new();
        headers.append("x-multi", "1".parse().unwrap());
        headers.append("x-multi", "2".parse().unwrap());
        let body = Bytes::from_static(b"\x00\xffnot utf-8");
        let record = Record::from_parts(StatusCode::ACCEPTED, headers, Some(body.clone()));
        let response = response::<Full<Bytes>>(&record, &IDEMPOTENT_REPLAYED);
        assert_eq!(response.status(), StatusCode::ACCEPTED);
        assert!(!response.headers().contains_key(&IDEMPOTENT_REPLAY_BODY));
        let multi: Vec<_> = response.headers().get_all("x-multi").iter().collect();
        assert_eq!(multi, ["1", "2"]);
        assert_eq!(
            response.into_body().collect().await.unwrap().to_bytes(),
            body
        );
    }

    #[tokio::test]
    async fn a_body_not_stored_keeps_the_status_and_says_why() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/json".parse().unwrap());
        headers.insert("location", "/v1/exports/1".parse().unwrap());
        for (name, value) in [
            ("content-digest", "sha-256=:AAAA:"),
            ("content-md5", "Q2hlY2sgSW50ZWdyaXR5IQ=="),
            ("content-disposition", "attachment; filename=export.csv"),
            ("content-location", "/v1/exports/1.csv"),
        ] {
            headers.insert(name, value.parse().unwrap());
        }
        let record = Record::from_parts(StatusCode::CREATED, headers, None);
        let response = response::<Full<Bytes>>(&record, &IDEMPOTENT_REPLAYED);
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["content-type"], PROBLEM_JSON);
        assert_eq!(response.headers()["location"], "/v1/exports/1");
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        assert_eq!(response.headers()["idempotent-replay-body"], "omitted");
        // Issue 28.11: nothing that described the dropped body is replayed with the problem.
        for name in [
            "content-digest",
            "content-md5",
            "content-disposition",
            "content-location",
        ] {
            assert!(!response.headers().contains_key(name), "{name} replayed");
        }
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["type"], BODY_NOT_STORED_TYPE);
        assert_eq!(json["status"], 201);
    }
}
