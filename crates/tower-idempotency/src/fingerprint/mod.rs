//! The request fingerprint: see [`Fingerprint`].

#[cfg(test)]
mod bounds;
mod canon;
#[cfg(test)]
mod equivalence;
mod fingerprinting;
mod form;
mod json;
#[cfg(test)]
mod oracle;
mod pointer;
#[cfg(test)]
mod properties;
mod token;

use std::fmt;

use http::{HeaderMap, HeaderValue, Method, Uri};
use sha2::{Digest, Sha256};

pub use fingerprinting::Fingerprinting;
pub(crate) use fingerprinting::compute_for_request;
#[doc(hidden)]
pub use form::{FormPair, canonical_form_pairs};
use form::{excluded_names, put_pairs, put_pairs_without};
#[doc(hidden)]
pub use json::{CanonicalJsonError, canonical_json};
use json::{hash_json, hash_json_excluding};
use pointer::Exclusions;

/// How request bodies are compared; see the [`Fingerprint`](crate::Fingerprint).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintMode {
    /// Compare parameters: canonical JSON, sorted form pairs, raw bytes otherwise.
    #[default]
    Semantic,
    /// Compare the exact bytes of the query string and body.
    Raw,
}

/// The SHA-256 fingerprint of a request.
///
/// ```
/// use http::{Method, Uri, HeaderValue};
/// use tower_idempotency::{Fingerprint, FingerprintMode};
///
/// let uri: Uri = "/v1/charges".parse().unwrap();
/// let json = HeaderValue::from_static("application/json");
/// let a = Fingerprint::compute(FingerprintMode::Semantic, &Method::POST, &uri, Some(&json),
///     br#"{"amount": 100, "currency": "usd"}"#);
/// let b = Fingerprint::compute(FingerprintMode::Semantic, &Method::POST, &uri, Some(&json),
///     br#"{"currency":"usd","amount":100}"#);
/// assert_eq!(a, b);
/// ```
///
/// A key reused with a different payload is a client bug, and replaying the first response to it
/// would be wrong; the layer answers `422` instead. The fingerprint is the SHA-256 of the method,
/// the path, the query and the body.
///
/// In the default [`FingerprintMode::Semantic`] mode, as in Stripe's practice, parameters are
/// compared, not bytes:
///
/// * a JSON body (`application/json` or any `+json` type) is hashed in canonical form: object
///   members sorted by name (members with the same name keep their order), insignificant
///   whitespace removed, strings re-escaped minimally, numbers compared as IEEE-754 doubles as
///   in RFC 8785 (`1`, `1.0` and `1e0` are the same number; integers are exact up to 2^53);
/// * an `application/x-www-form-urlencoded` body, and the query string, as the decoded name/value
///   pairs stably sorted by name (values of a repeated name keep their order);
/// * any other body, or a JSON body that does not parse, as its raw bytes.
///
/// [`FingerprintMode::Raw`] hashes the body bytes exactly, for APIs where the bytes are the
/// meaning (signed payloads, binary uploads).
///
/// # What it covers
///
/// By default: the method, the path, the query and the body, and no request header. Two
/// parts of [`Fingerprinting`] change that, for APIs whose retries legitimately differ, or whose
/// identical bodies mean different things:
///
/// * [`Fingerprinting::excluding`] leaves
///   body fields out, by JSON Pointer (`/client_sent_at`, `/metadata/trace_id`); for a form
///   body, a top-level pointer (`/trace_id`) names a field. A client timestamp or trace id that
///   changes on every retry then does not make the retry a `422`. (Not in
///   [`FingerprintMode::Raw`], where the bytes are the meaning: refused there.)
/// * [`Fingerprinting::with_headers`] takes
///   request headers in (`Stripe-Version`, `Accept`): a retry under another API version is then
///   a `422` rather than the replay of a body of the old version.
///
/// # Bounded work
///
/// A fingerprint costs time and memory linear in the request, whatever the request holds:
///
/// * A JSON body is canonicalised in one pass over its bytes, without building a tree of
///   its values, with or without fields left out: runs already in canonical form are copied
///   as they are, and an object whose members arrive out of order is not moved but emitted
///   once in sorted order from a record of its members' places. Nesting deeper than 127 (the
///   limit of serde_json, whose reading the canonical form follows) is not JSON: the body is
///   hashed as its raw bytes, the same way on every retry.
/// * A form body or query string of more than 10,000 pairs is hashed as its raw bytes, not
///   decoded and sorted (Django's `DATA_UPLOAD_MAX_NUMBER_FIELDS` and PHP's `max_input_vars`
///   cap fields likewise, at 1,000). The pairs are counted first, without decoding; a retry
///   with the same bytes still matches, a reordered one is a `422`. Fields left out of a form
///   are found without decoding a copy of it.
/// * A JSON body whose out-of-order objects total more than 4 × its length plus 64 KiB (objects
///   out of order at every level of a deep nesting) is hashed as its raw bytes, as a body that
///   is not JSON is; this limit bounded the work of an earlier canonicaliser, and is kept so
///   that such a body keeps the fingerprint it had. Within it, the canonical form is the one
///   described above.
/// * A body over 64 KiB is fingerprinted on Tokio's blocking thread pool
///   ([`spawn_blocking`](tokio::task::spawn_blocking)), so it does not hold up the async
///   worker threads that serve other requests; as many at once as there are cores, the others
///   waiting their turn, so that concurrent hostile bodies do not multiply the memory held.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints a request from its method, URI, `Content-Type` and complete body.
    pub fn compute(
        mode: FingerprintMode,
        method: &Method,
        uri: &Uri,
        content_type: Option<&HeaderValue>,
        body: &[u8],
    ) -> Self {
        let mut hasher = Self::head(mode, method, uri);
        match mode {
            FingerprintMode::Raw => put_raw(&mut hasher, body),
            FingerprintMode::Semantic => match BodyKind::of(content_type) {
                BodyKind::Json if hash_json(&mut hasher, body) => {}
                BodyKind::Form => {
                    hasher.update(b"form\0");
                    put_pairs(&mut hasher, body);
                }
                BodyKind::Json | BodyKind::Other => put_raw(&mut hasher, body),
            },
        }
        Self(hasher.finalize().into())
    }

    /// The hasher after the method, the path and the query: what every body follows.
    fn head(mode: FingerprintMode, method: &Method, uri: &Uri) -> Sha256 {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/v1\0");
        put_field(&mut hasher, method.as_str().as_bytes());
        put_field(&mut hasher, uri.path().as_bytes());
        let query = uri.query().unwrap_or("").as_bytes();
        match mode {
            FingerprintMode::Raw => put_field(&mut hasher, query),
            FingerprintMode::Semantic => put_pairs(&mut hasher, query),
        }
        hasher
    }

    /// [`compute`](Self::compute) with the body fields at the JSON Pointers `excluded` left
    /// out, as [`Fingerprinting::excluding`]
    /// computes it; for benchmarks and fuzzing.
    #[doc(hidden)]
    pub fn compute_excluding(
        mode: FingerprintMode,
        method: &Method,
        uri: &Uri,
        content_type: Option<&HeaderValue>,
        body: &[u8],
        excluded: &[String],
    ) -> Self {
        let mut headers = HeaderMap::new();
        if let Some(content_type) = content_type {
            headers.insert(http::header::CONTENT_TYPE, content_type.clone());
        }
        // A raw fingerprint leaves nothing out (the layer refuses to be told otherwise).
        let fingerprinting = match mode {
            FingerprintMode::Raw => Fingerprinting::raw(),
            FingerprintMode::Semantic => {
                Fingerprinting::semantic().excluding(excluded.iter().cloned())
            }
        };
        fingerprinting.fingerprint(method, uri, &headers, body)
    }

    /// Rebuilds a fingerprint from its 32 bytes, as a store reads it back.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint(")?;
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        f.write_str(")")
    }
}

enum BodyKind {
    Json,
    Form,
    Other,
}

impl BodyKind {
    fn of(content_type: Option<&HeaderValue>) -> Self {
        let Some(value) = content_type.and_then(|v| v.to_str().ok()) else {
            return Self::Other;
        };
        let essence = value.split(';').next().unwrap_or("").trim();
        let (kind, subtype) = essence.split_once('/').unwrap_or((essence, ""));
        if !kind.eq_ignore_ascii_case("application") {
            Self::Other
        } else if subtype.eq_ignore_ascii_case("json")
            || subtype.len() > 5 && subtype[subtype.len() - 5..].eq_ignore_ascii_case("+json")
        {
            Self::Json
        } else if subtype.eq_ignore_ascii_case("x-www-form-urlencoded") {
            Self::Form
        } else {
            Self::Other
        }
    }
}

fn put_raw(hasher: &mut Sha256, body: &[u8]) {
    hasher.update(b"raw\0");
    hasher.update(body);
}

fn put_field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// What the tests of the fingerprint's parts share.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub(crate) fn canon(s: &str) -> String {
        String::from_utf8(canonical_json(s.as_bytes()).unwrap()).unwrap()
    }

    pub(crate) fn fp(
        mode: FingerprintMode,
        uri: &str,
        content_type: Option<&'static str>,
        body: &str,
    ) -> Fingerprint {
        Fingerprint::compute(
            mode,
            &Method::POST,
            &uri.parse().unwrap(),
            content_type.map(HeaderValue::from_static).as_ref(),
            body.as_bytes(),
        )
    }

    pub(crate) const JSON: Option<&str> = Some("application/json");
    pub(crate) const FORM: Option<&str> = Some("application/x-www-form-urlencoded");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::testing::*;

    /// Stored records are matched by fingerprint, so a new version must compute the same
    /// fingerprint as the last for the same request, or a rolling deploy would answer retries
    /// of keys claimed before it with `422`. Changing these values is a breaking change.
    #[test]
    fn fingerprints_stay_the_same_between_versions() {
        let cases = [
            (
                "/v1/charges",
                JSON,
                r#"{"amount":1000,"currency":"usd","description":"idempotency-bench"}"#,
                "776fe25707a4e836da7829bda75984d5d8700da8b7a2223ab1868f48125efd45",
            ),
            (
                "/v1/charges?expand[]=customer",
                Some("application/json; charset=utf-8"),
                r#" {"z":[1.50,-0,1e2,"caf\u00e9\n"],"a":{"y":null,"x":true},"a":false} "#,
                "b8eb5258ee8bef6c6e3dbf6ba53a57b47db222fe942f2084a693cd584f16bad7",
            ),
            (
                "/v1/charges",
                FORM,
                "currency=usd&amount=1000&metadata%5Border%5D=6735+x",
                "cd517df44308996e6f5bc1afd5f315f66347ea8845613de6df78064a94d04a4b",
            ),
            (
                "/v1/charges",
                Some("text/plain"),
                "hello",
                "5e4921329eb6e4393876af72a304dd694896256f6a4001a6a1bf6d93a63ebf68",
            ),
            (
                "/v1/charges",
                JSON,
                "{not json",
                "eabaac70d1783ebefacc1ef31f55e95bff29a8621bf4823e3fd8867b114bacd8",
            ),
        ];
        for (uri, content_type, body, expected) in cases {
            let fingerprint = fp(FingerprintMode::Semantic, uri, content_type, body);
            assert_eq!(
                format!("{fingerprint:?}"),
                format!("Fingerprint({expected})"),
                "{body}"
            );
        }
    }

    #[test]
    fn semantic_json_ignores_member_order_and_whitespace() {
        assert_eq!(
            fp(FingerprintMode::Semantic, "/", JSON, r#"{"a":1,"b":2}"#),
            fp(
                FingerprintMode::Semantic,
                "/",
                Some("application/vnd.api+json; charset=utf-8"),
                "{ \"b\":2,\n\"a\":1 }"
            ),
        );
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", JSON, r#"{"a":1,"b":2}"#),
            fp(FingerprintMode::Semantic, "/", JSON, r#"{"a":1,"b":3}"#),
        );
    }

    #[test]
    fn raw_mode_compares_bytes() {
        assert_ne!(
            fp(FingerprintMode::Raw, "/", JSON, r#"{"a":1,"b":2}"#),
            fp(FingerprintMode::Raw, "/", JSON, r#"{"b":2,"a":1}"#),
        );
        assert_ne!(
            fp(FingerprintMode::Raw, "/?a=1&b=2", None, ""),
            fp(FingerprintMode::Raw, "/?b=2&a=1", None, ""),
        );
    }

    #[test]
    fn invalid_json_falls_back_to_raw_bytes() {
        let broken = fp(FingerprintMode::Semantic, "/", JSON, "{\"a\":1");
        assert_eq!(
            broken,
            fp(
                FingerprintMode::Semantic,
                "/",
                Some("text/plain"),
                "{\"a\":1"
            )
        );
        assert_ne!(
            broken,
            fp(FingerprintMode::Semantic, "/", JSON, "{\"a\":1 ")
        );
    }

    #[test]
    fn query_pairs_are_compared_semantically() {
        assert_eq!(
            fp(FingerprintMode::Semantic, "/x?a=1&b=2", None, ""),
            fp(FingerprintMode::Semantic, "/x?b=2&a=1", None, ""),
        );
        assert_ne!(
            fp(FingerprintMode::Semantic, "/x?a=1", None, ""),
            fp(FingerprintMode::Semantic, "/y?a=1", None, ""),
        );
    }

    #[test]
    fn json_and_form_bodies_never_collide() {
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", JSON, "{}"),
            fp(FingerprintMode::Semantic, "/", Some("text/plain"), "{}"),
        );
    }
}
