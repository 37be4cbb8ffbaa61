//! Answering a retry: the stored [`Record`] as a response.
//!
//! A replay carries the original status, the kept headers (see [`record`](crate::record)) and
//! the exact body bytes, plus `Idempotent-Replayed: true`; `Content-Length` is computed from the
//! body and `Date` is added by the server, as for any response. Trailers reach the first
//! response's client but are not stored: a replay carries none, so an API whose outcome is in
//! its trailers (gRPC's `grpc-status`) cannot rely on replays for it.
//!
//! ```
//! use http::{HeaderMap, StatusCode};
//! use tower_idempotency::{Record, replay};
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("content-type", "application/json".parse().unwrap());
//! let record = Record::from_parts(StatusCode::OK, headers, Some(r#"{"id":"ch_1"}"#.into()));
//!
//! let response = replay::response::<http_body_util::Full<bytes::Bytes>>(&record);
//! assert_eq!(response.status(), StatusCode::OK);
//! assert_eq!(response.headers()["idempotent-replayed"], "true");
//! assert_eq!(response.headers()["content-type"], "application/json");
//! ```
//!
//! # Responses too large to store
//!
//! A response larger than the layer's `max_response_bytes` is delivered to its client in full
//! but only its status and headers are recorded. A retry still never runs the handler again:
//! it gets the **original status** (so a `201` still says the operation succeeded) and the
//! original headers that describe the outcome (`Location`, `ETag`...), with the body replaced by
//! an `application/problem+json` document whose `type` links here and whose `detail` says the
//! original body was not kept. Fetch the resource (for example at its `Location`) to see it.

use bytes::Bytes;
use http::{HeaderValue, Response, header};

use crate::{
    problem::PROBLEM_JSON,
    record::{IDEMPOTENT_REPLAYED, Record},
};

/// The problem `type` of a replay whose body was not stored.
pub const BODY_NOT_STORED_TYPE: &str = "https://docs.rs/tower-idempotency/latest/tower_idempotency/replay/index.html#responses-too-large-to-store";

/// The replay of `record`.
pub fn response<B: From<Bytes>>(record: &Record) -> Response<B> {
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
            body_not_stored(record)
        }
    };
    *response.body_mut() = B::from(body);
    response
        .headers_mut()
        .insert(&IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
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

    #[tokio::test]
    async fn replays_status_headers_and_exact_bytes() {
        let mut headers = HeaderMap::new();
        headers.append("x-multi", "1".parse().unwrap());
        headers.append("x-multi", "2".parse().unwrap());
        let body = Bytes::from_static(b"\x00\xffnot utf-8");
        let record = Record::from_parts(StatusCode::ACCEPTED, headers, Some(body.clone()));
        let response = response::<Full<Bytes>>(&record);
        assert_eq!(response.status(), StatusCode::ACCEPTED);
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
        let response = response::<Full<Bytes>>(&record);
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["content-type"], PROBLEM_JSON);
        assert_eq!(response.headers()["location"], "/v1/exports/1");
        assert_eq!(response.headers()["idempotent-replayed"], "true");
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
