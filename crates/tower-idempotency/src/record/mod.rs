//! What is kept of a response: see [`Record`].

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, StatusCode, header, response};

mod encoding;

pub use encoding::RecordBytesError;

/// The `Idempotent-Replayed` response header marking a replay.
pub static IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A completed key's response, as stored and replayed.
///
/// ```
/// use http::{Response, StatusCode};
/// use tower_idempotency::Record;
///
/// let response = Response::builder()
///     .status(StatusCode::CREATED)
///     .header("location", "/v1/charges/ch_1")
///     .header("set-cookie", "session=secret")
///     .body(())
///     .unwrap();
/// let (parts, ()) = response.into_parts();
/// let record = Record::capture(&parts, Some(bytes::Bytes::from_static(b"{}")));
/// assert_eq!(record.status(), StatusCode::CREATED);
/// assert!(record.headers().contains_key("location"));
/// assert!(!record.headers().contains_key("set-cookie"));
/// ```
///
/// The layer records the handler's status, headers and body bytes. Headers that describe one
/// delivery rather than the outcome are dropped before anything reaches the store:
///
/// | dropped | why |
/// |---|---|
/// | `Date` | the replay is a new message; hyper adds a fresh one |
/// | `Set-Cookie`, `Set-Cookie2` | session secrets never go to the store, and a replay must not re-establish a session |
/// | `Authentication-Info` | authentication state of the original exchange (RFC 9110), not of the retry |
/// | `Clear-Site-Data` | an instruction to the client of one response; replayed, it would log out or wipe a later session |
/// | `Age` | how long a cache held that delivery |
/// | `Content-Length` | recomputed from the body on replay |
/// | hop-by-hop: `Connection`, `Keep-Alive`, `Proxy-Connection`, `Transfer-Encoding`, `TE`, `Trailer`, `Upgrade`, `Proxy-Authenticate`, and any field named in `Connection` | they belong to one connection |
/// | `Idempotent-Replayed` | set by the replay itself |
///
/// Everything else, `Content-Type`, `Location`, `ETag`, `Cache-Control` and custom headers
/// included, is kept in order, repeated fields too. An app adds headers of its own to the
/// dropped ones with
/// [`IdempotencyLayer::with_unstored_headers`](crate::IdempotencyLayer::with_unstored_headers).
///
/// # Replays
///
/// A replay carries the original status, the kept headers (above) and the exact body bytes,
/// plus `Idempotent-Replayed: true`; `Content-Length` is computed from the body and `Date` is
/// added by the server, as for any response. Trailers reach the first response's client but are
/// not stored: a replay carries none, so an API whose outcome is in its trailers (gRPC's
/// `grpc-status`) cannot rely on replays for it.
///
/// ## Responses too large to store
///
/// A response larger than the layer's `max_response_bytes` is delivered to its client in full
/// but only its status and headers are recorded. A retry still never runs the handler again:
/// it gets the **original status** (so a `201` still says the operation succeeded) and the
/// original headers that describe the outcome (`Location`, `ETag`...), with the body replaced by
/// an `application/problem+json` document whose `type` links here and whose `detail` says the
/// original body was not kept. Fetch the resource (for example at its `Location`) to see it.
///
/// Such a replay also carries `Idempotent-Replay-Body: omitted`
/// ([`IDEMPOTENT_REPLAY_BODY`](crate::IDEMPOTENT_REPLAY_BODY)), so a client that reads a `200`
/// or `201` never mistakes the problem document for the original body. The alternative, an
/// empty body with the original status, was not chosen: a client that parses the body it
/// expects would fail on it without saying why, where a problem document explains itself to a
/// person and the header to a program.
#[derive(Debug, Clone, PartialEq)]
pub struct Record(Arc<Parts>);

/// Shared, so that the copies a store, a [`CachingStore`](crate::store::CachingStore) and a
/// replay make cost a count.
#[derive(Debug, PartialEq)]
struct Parts {
    status: StatusCode,
    headers: HeaderMap,
    body: Option<Bytes>,
}

impl Record {
    /// Captures a response for storage, dropping the headers listed in the
    /// [`Record`] documentation. `body` is `None` when the body was not kept (it was larger
    /// than the layer's `max_response_bytes`, or failed while being read).
    pub fn capture(parts: &response::Parts, body: Option<Bytes>) -> Self {
        Self::capture_without(parts, body, &[])
    }

    /// [`capture`](Self::capture), dropping `unstored` headers too.
    pub(crate) fn capture_without(
        parts: &response::Parts,
        body: Option<Bytes>,
        unstored: &[HeaderName],
    ) -> Self {
        let mut headers = HeaderMap::with_capacity(parts.headers.len());
        let connection_listed: Vec<HeaderName> = parts
            .headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        for (name, value) in &parts.headers {
            if !is_unrepeatable(name)
                && !connection_listed.contains(name)
                && !unstored.contains(name)
            {
                headers.append(name.clone(), value.clone());
            }
        }
        Self::from_parts(parts.status, headers, body)
    }

    /// Rebuilds a record a store read back. The headers are taken as they are.
    pub fn from_parts(status: StatusCode, headers: HeaderMap, body: Option<Bytes>) -> Self {
        Self(Arc::new(Parts {
            status,
            headers,
            body,
        }))
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// The kept headers, in order.
    pub fn headers(&self) -> &HeaderMap {
        &self.0.headers
    }

    /// The body bytes, or `None` when the body was not kept.
    pub fn body(&self) -> Option<&Bytes> {
        self.0.body.as_ref()
    }

    /// Approximate bytes this record occupies: body plus header names and values.
    pub fn size(&self) -> usize {
        let headers: usize = self
            .headers()
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len())
            .sum();
        headers + self.body().map_or(0, Bytes::len)
    }
}

fn is_unrepeatable(name: &HeaderName) -> bool {
    use http::header::{
        AGE, CONNECTION, CONTENT_LENGTH, DATE, PROXY_AUTHENTICATE, SET_COOKIE, TE, TRAILER,
        TRANSFER_ENCODING, UPGRADE,
    };
    [
        &AGE,
        &DATE,
        &SET_COOKIE,
        &CONTENT_LENGTH,
        &CONNECTION,
        &TRANSFER_ENCODING,
        &TE,
        &TRAILER,
        &UPGRADE,
        &PROXY_AUTHENTICATE,
        &IDEMPOTENT_REPLAYED,
    ]
    .contains(&name)
        || matches!(
            name.as_str(),
            "set-cookie2"
                | "keep-alive"
                | "proxy-connection"
                | "authentication-info"
                | "clear-site-data"
        )
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, Response};

    use super::*;

    fn parts(headers: &[(&str, &str)]) -> response::Parts {
        let mut builder = Response::builder().status(StatusCode::OK);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn keeps_descriptive_headers_in_order_with_repeats() {
        let record = Record::capture(
            &parts(&[
                ("content-type", "application/json"),
                ("link", "<a>; rel=a"),
                ("location", "/x"),
                ("link", "<b>; rel=b"),
                ("etag", "\"v1\""),
            ]),
            None,
        );
        let links: Vec<&HeaderValue> = record.headers().get_all("link").iter().collect();
        assert_eq!(links, ["<a>; rel=a", "<b>; rel=b"]);
        assert_eq!(record.headers()["etag"], "\"v1\"");
        assert_eq!(record.headers().len(), 5);
    }

    #[test]
    fn drops_delivery_headers() {
        let record = Record::capture(
            &parts(&[
                ("date", "Sat, 21 Nov 2026 00:00:00 GMT"),
                ("set-cookie", "s=1"),
                ("set-cookie", "t=2"),
                ("content-length", "2"),
                ("connection", "keep-alive, x-conn-private"),
                ("x-conn-private", "1"),
                ("keep-alive", "timeout=5"),
                ("transfer-encoding", "chunked"),
                ("idempotent-replayed", "true"),
                ("authentication-info", "nextnonce=\"abc\""),
                ("clear-site-data", "\"cookies\""),
                ("age", "30"),
                ("x-request-cost", "3"),
            ]),
            Some(Bytes::from_static(b"{}")),
        );
        let names: Vec<&str> = record.headers().keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-request-cost"]);
        assert_eq!(record.size(), "x-request-cost".len() + 1 + 2);
    }

    /// Issue 28.11: an app's own headers can be kept out of the store too.
    #[test]
    fn an_apps_unstored_headers_are_dropped() {
        let record = Record::capture_without(
            &parts(&[("x-session-token", "secret"), ("x-request-id", "r1")]),
            None,
            &[HeaderName::from_static("x-session-token")],
        );
        let names: Vec<&str> = record.headers().keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-request-id"]);
    }
}
