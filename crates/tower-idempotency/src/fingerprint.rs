//! Is a retry the same request? The request fingerprint.
//!
//! ```
//! use http::{Method, Uri, HeaderValue};
//! use tower_idempotency::fingerprint::{Fingerprint, FingerprintMode};
//!
//! let uri: Uri = "/v1/charges".parse().unwrap();
//! let json = HeaderValue::from_static("application/json");
//! let a = Fingerprint::compute(FingerprintMode::Semantic, &Method::POST, &uri, Some(&json),
//!     br#"{"amount": 100, "currency": "usd"}"#);
//! let b = Fingerprint::compute(FingerprintMode::Semantic, &Method::POST, &uri, Some(&json),
//!     br#"{"currency":"usd","amount":100}"#);
//! assert_eq!(a, b);
//! ```
//!
//! A key reused with a different payload is a client bug, and replaying the first response to it
//! would be wrong; the layer answers `422` instead. The fingerprint is the SHA-256 of the method,
//! the path, the query and the body.
//!
//! In the default [`FingerprintMode::Semantic`] mode, as in Stripe's practice, parameters are
//! compared, not bytes:
//!
//! * a JSON body (`application/json` or any `+json` type) is hashed in canonical form: object
//!   members sorted by name (members with the same name keep their order), insignificant
//!   whitespace removed, strings re-escaped minimally, numbers compared as IEEE-754 doubles as
//!   in RFC 8785 (`1`, `1.0` and `1e0` are the same number; integers are exact up to 2^53);
//! * an `application/x-www-form-urlencoded` body, and the query string, as the decoded name/value
//!   pairs stably sorted by name (values of a repeated name keep their order);
//! * any other body, or a JSON body that does not parse, as its raw bytes.
//!
//! [`FingerprintMode::Raw`] hashes the body bytes exactly, for APIs where the bytes are the
//! meaning (signed payloads, binary uploads).
//!
//! # What it covers
//!
//! By default: the method, the path, the query and the body, and no request header. Two
//! settings change that, for APIs whose retries legitimately differ, or whose identical bodies
//! mean different things:
//!
//! * [`with_fingerprint_excluding`](crate::IdempotencyLayer::with_fingerprint_excluding) leaves
//!   body fields out, by JSON Pointer (`/client_sent_at`, `/metadata/trace_id`); for a form
//!   body, a top-level pointer (`/trace_id`) names a field. A client timestamp or trace id that
//!   changes on every retry then does not make the retry a `422`. (Not in
//!   [`FingerprintMode::Raw`], where the bytes are the meaning.)
//! * [`with_fingerprint_headers`](crate::IdempotencyLayer::with_fingerprint_headers) takes
//!   request headers in (`Stripe-Version`, `Accept`): a retry under another API version is then
//!   a `422` rather than the replay of a body of the old version.
//!
//! # Bounded work
//!
//! A fingerprint costs time and memory linear in the request, whatever the request holds:
//!
//! * A form body or query string of more than 10,000 pairs is hashed as its raw bytes, not
//!   decoded and sorted (Django's `DATA_UPLOAD_MAX_NUMBER_FIELDS` and PHP's `max_input_vars`
//!   cap fields likewise, at 1,000). The pairs are counted first, without decoding; a retry
//!   with the same bytes still matches, a reordered one is a `422`.
//! * Sorting the members of a JSON body's objects may move at most 4 × the body's length plus
//!   64 KiB into place in total. A document that needs more (objects out of order at every
//!   level of a deep nesting) is hashed as its raw bytes, as a body that is not JSON is; within
//!   this budget the canonical form is the one described above.
//! * A body over 64 KiB is fingerprinted on Tokio's blocking thread pool
//!   ([`spawn_blocking`](tokio::task::spawn_blocking)), so it does not hold up the async
//!   worker threads that serve other requests; as many at once as there are cores, the others
//!   waiting their turn, so that concurrent hostile bodies do not multiply the memory held.

use std::{borrow::Cow, fmt};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use serde::{
    Serialize,
    de::{Deserialize, DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor},
};
use sha2::{Digest, Sha256};

/// At most this many pairs of a form body or query string are decoded and sorted.
const MAX_FORM_PAIRS: usize = 10_000;

/// Hashed where the pair count goes when there were more than [`MAX_FORM_PAIRS`] and the raw
/// bytes follow: no count of decoded pairs is this large, so the two can never collide.
const TOO_MANY_PAIRS: u64 = u64::MAX;

/// Bodies up to this size are fingerprinted on the async worker; larger ones on the blocking
/// thread pool.
const INLINE_BODY_BYTES: usize = 64 * 1024;

/// How request bodies are compared; see the [module documentation](self).
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
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/v1\0");
        put_field(&mut hasher, method.as_str().as_bytes());
        put_field(&mut hasher, uri.path().as_bytes());
        let query = uri.query().unwrap_or("").as_bytes();
        match mode {
            FingerprintMode::Raw => {
                put_field(&mut hasher, query);
                hasher.update(b"raw\0");
                hasher.update(body);
            }
            FingerprintMode::Semantic => {
                put_pairs(&mut hasher, query);
                match BodyKind::of(content_type) {
                    BodyKind::Json if hash_json(&mut hasher, body) => {}
                    BodyKind::Form => {
                        hasher.update(b"form\0");
                        put_pairs(&mut hasher, body);
                    }
                    BodyKind::Json | BodyKind::Other => {
                        hasher.update(b"raw\0");
                        hasher.update(body);
                    }
                }
            }
        }
        Self(hasher.finalize().into())
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

/// What a request's fingerprint covers, as the layer is configured: the mode, body fields left
/// out and request headers taken in (see the [module documentation](self#what-it-covers)).
#[derive(Debug, Clone, Default)]
pub(crate) struct Coverage {
    pub(crate) mode: FingerprintMode,
    /// JSON Pointers (RFC 6901) of body fields left out.
    pub(crate) excluded: Vec<String>,
    pub(crate) headers: Vec<HeaderName>,
}

impl Coverage {
    /// The fingerprint of a request, [`Fingerprint::compute`]'s when nothing is left out or
    /// taken in.
    pub(crate) fn fingerprint(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Fingerprint {
        let content_type = headers.get(http::header::CONTENT_TYPE);
        if self.excluded.is_empty() && self.headers.is_empty() {
            return Fingerprint::compute(self.mode, method, uri, content_type, body);
        }
        let trimmed;
        let body = match (self.mode, BodyKind::of(content_type)) {
            (FingerprintMode::Semantic, BodyKind::Json) if !self.excluded.is_empty() => {
                match without_json_fields(body, &self.excluded) {
                    Some(without) => {
                        trimmed = without;
                        &trimmed[..]
                    }
                    None => body,
                }
            }
            (FingerprintMode::Semantic, BodyKind::Form) if !self.excluded.is_empty() => {
                trimmed = without_form_fields(body, &self.excluded);
                &trimmed[..]
            }
            _ => body,
        };
        let Fingerprint(body_only) =
            Fingerprint::compute(self.mode, method, uri, content_type, body);
        if self.headers.is_empty() {
            return Fingerprint(body_only);
        }
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/headers/v1\0");
        hasher.update(body_only);
        for name in &self.headers {
            put_field(&mut hasher, name.as_str().as_bytes());
            let values = headers.get_all(name);
            hasher.update((values.iter().count() as u64).to_be_bytes());
            for value in values {
                put_field(&mut hasher, value.as_bytes());
            }
        }
        Fingerprint(hasher.finalize().into())
    }

    /// The headers a fingerprint reads, for a copy made to fingerprint elsewhere.
    fn relevant_headers(&self, headers: &HeaderMap) -> HeaderMap {
        let mut relevant = HeaderMap::new();
        for name in std::iter::once(&http::header::CONTENT_TYPE).chain(&self.headers) {
            for value in headers.get_all(name) {
                relevant.append(name.clone(), value.clone());
            }
        }
        relevant
    }
}

/// `body` without the members at `pointers`, re-serialised: `None` when it is not JSON (the
/// caller then hashes it as it is). Only object members are removed; a pointer that names
/// nothing, or an array element, is ignored.
fn without_json_fields(body: &[u8], pointers: &[String]) -> Option<Vec<u8>> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    for pointer in pointers {
        let Some((parent, last)) = pointer.rsplit_once('/') else {
            continue;
        };
        let last = last.replace("~1", "/").replace("~0", "~");
        if let Some(serde_json::Value::Object(members)) = value.pointer_mut(parent) {
            members.remove(&last);
        }
    }
    serde_json::to_vec(&value).ok()
}

/// A form body without the fields named by top-level pointers (`/name`), re-encoded pair by pair
/// as it came.
fn without_form_fields(body: &[u8], pointers: &[String]) -> Vec<u8> {
    let names: Vec<String> = pointers
        .iter()
        .filter_map(|pointer| pointer.strip_prefix('/'))
        .filter(|name| !name.contains('/'))
        .map(|name| name.replace("~1", "/").replace("~0", "~"))
        .collect();
    let kept: Vec<&[u8]> = body
        .split(|b| *b == b'&')
        .filter(|pair| {
            let name = pair.split(|b| *b == b'=').next().unwrap_or_default();
            !names
                .iter()
                .any(|excluded| *form_decode(name) == *excluded.as_bytes())
        })
        .collect();
    kept.join(&b'&')
}

/// The fingerprint of a request for the service: inline for a body up to 64 KiB, on Tokio's
/// blocking thread pool for a larger one (see the [module documentation](self#bounded-work)).
pub(crate) async fn compute_for_request(
    coverage: &Coverage,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Fingerprint {
    let runtime = match tokio::runtime::Handle::try_current() {
        Ok(runtime) if body.len() > INLINE_BODY_BYTES => runtime,
        _ => return coverage.fingerprint(method, uri, headers, body),
    };
    let compute = {
        let (coverage, method, uri) = (coverage.clone(), method.clone(), uri.clone());
        let (headers, body) = (coverage.relevant_headers(headers), body.clone());
        move || coverage.fingerprint(&method, &uri, &headers, &body)
    };
    // Beyond one per core, more at once would only hold more buffers, not finish sooner.
    let _slot = blocking_slots().acquire().await;
    match runtime.spawn_blocking(compute.clone()).await {
        Ok(fingerprint) => fingerprint,
        // Cancelled by a runtime shutting down (or panicked): the request still needs its
        // fingerprint, so it is computed here instead.
        Err(error) => {
            tracing::warn!(%error, "fingerprinting on the blocking pool failed; computing inline");
            compute()
        }
    }
}

/// Admits as many large-body fingerprints to the blocking pool at once as there are cores.
fn blocking_slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| tokio::sync::Semaphore::new(cores()))
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
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

/// Hashes the canonical form of a JSON body; `false` (nothing hashed) when it is not JSON or
/// over the reordering budget, and the caller hashes the raw bytes instead.
fn hash_json(hasher: &mut Sha256, body: &[u8]) -> bool {
    match canonical_json(body) {
        Ok(canonical) => {
            hasher.update(b"json\0");
            hasher.update(&canonical);
            true
        }
        Err(_) => false,
    }
}

fn put_field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

fn put_pairs(hasher: &mut Sha256, encoded: &[u8]) {
    if more_pairs_than(encoded, MAX_FORM_PAIRS) {
        hasher.update(TOO_MANY_PAIRS.to_be_bytes());
        put_field(hasher, encoded);
        return;
    }
    let pairs = canonical_form_pairs(encoded);
    hasher.update((pairs.len() as u64).to_be_bytes());
    for (name, value) in &pairs {
        put_field(hasher, name);
        put_field(hasher, value);
    }
}

/// Whether `encoded` holds more than `limit` pairs (non-empty `&`-separated segments), counted
/// without decoding or allocating.
fn more_pairs_than(encoded: &[u8], limit: usize) -> bool {
    encoded
        .split(|b| *b == b'&')
        .filter(|pair| !pair.is_empty())
        .nth(limit)
        .is_some()
}

/// The canonical form of a JSON document (see the [module documentation](self)), computed in
/// one pass.
///
/// Nesting deeper than serde_json's recursion limit (128) is an error, and the members it moves
/// to sort objects are bounded by the [reordering budget](self#bounded-work), so hostile input
/// can exhaust neither the stack nor the CPU.
///
/// # Errors
///
/// When `input` is not a single valid JSON document, or sorting its objects would exceed the
/// budget.
pub fn canonical_json(input: &[u8]) -> Result<Vec<u8>, CanonicalJsonError> {
    let mut writer = Writer::new(input.len());
    writer.canonicalise(input)?;
    Ok(writer.out)
}

/// Why [`canonical_json`] gave no canonical form.
#[derive(Debug)]
#[non_exhaustive]
pub enum CanonicalJsonError {
    /// The input is not a single JSON document, or nests deeper than 128.
    Invalid(serde_json::Error),
    /// Sorting the members of its objects would move more than the
    /// [reordering budget](self#bounded-work) allows; the input was not read to its end.
    OverBudget,
}

impl fmt::Display for CanonicalJsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(_) => f.write_str("not a single JSON document"),
            Self::OverBudget => f.write_str(
                "sorting the members of its objects would move more than 4 times its length \
                 plus 64 KiB",
            ),
        }
    }
}

impl std::error::Error for CanonicalJsonError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Invalid(error) => Some(error),
            Self::OverBudget => None,
        }
    }
}

/// The bytes of out-of-order objects that canonicalising `input_len` bytes may move into place.
fn reorder_budget(input_len: usize) -> usize {
    input_len.saturating_mul(4).saturating_add(64 * 1024)
}

/// The canonical form being written, and what sorting objects may still cost.
struct Writer {
    out: Vec<u8>,
    /// An out-of-order object's members wait here while they are written back sorted; one
    /// buffer for every object.
    scratch: Vec<u8>,
    /// Bytes of out-of-order objects that may still be moved into place.
    budget: usize,
    /// Bytes of out-of-order objects moved into place so far.
    moved: usize,
    over_budget: bool,
}

impl Writer {
    fn new(input_len: usize) -> Self {
        Self {
            // The canonical form is never longer than the input, except for the rare number
            // written shorter than its canonical form (`1e9`).
            out: Vec::with_capacity(input_len),
            scratch: Vec::new(),
            budget: reorder_budget(input_len),
            moved: 0,
            over_budget: false,
        }
    }

    fn canonicalise(&mut self, input: &[u8]) -> Result<(), CanonicalJsonError> {
        let mut deserializer = serde_json::Deserializer::from_slice(input);
        let read = Canonical(self)
            .deserialize(&mut deserializer)
            .and_then(|()| deserializer.end());
        match read {
            Ok(()) => Ok(()),
            Err(_) if self.over_budget => Err(CanonicalJsonError::OverBudget),
            Err(error) => Err(CanonicalJsonError::Invalid(error)),
        }
    }
}

/// Writes the canonical form of the JSON value it is given to the end of its writer's buffer:
/// values are written as they are read, into one buffer, and an object's members are only
/// moved when they arrive out of order.
struct Canonical<'a>(&'a mut Writer);

impl<'de> DeserializeSeed<'de> for Canonical<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// Integers below this magnitude are exact as doubles, so `1.0`, `1e0` and `1` meet there.
const EXACT_INTEGER_LIMIT: f64 = 9_007_199_254_740_992.0; // 2^53

impl<'de> Visitor<'de> for Canonical<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.out.extend_from_slice(b"null");
        Ok(())
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.0
            .out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        write_json(&mut self.0.out, &v);
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        write_json(&mut self.0.out, &v);
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        if v.fract() == 0.0 && v.abs() < EXACT_INTEGER_LIMIT {
            // Exact: the value is an integer below 2^53.
            write_json(&mut self.0.out, &(v as i64));
            return Ok(());
        }
        // JSON numbers are finite, so serde_json writes ryu's shortest round-trip form.
        write_json(&mut self.0.out, &v);
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        write_json(&mut self.0.out, v);
        Ok(())
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<(), E> {
        write_unescaped(&mut self.0.out, v);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let writer = self.0;
        writer.out.push(b'[');
        let mut first = true;
        loop {
            let comma = writer.out.len();
            if !first {
                writer.out.push(b',');
            }
            if seq.next_element_seed(Canonical(&mut *writer))?.is_none() {
                writer.out.truncate(comma);
                break;
            }
            first = false;
        }
        writer.out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let writer = self.0;
        let start = writer.out.len();
        writer.out.push(b'{');
        // Each member's name and where its `"name":value` was written.
        let mut members: Vec<(Name<'de>, usize, usize)> = Vec::new();
        while let Some(name) = map.next_key::<Name<'de>>()? {
            let out = &mut writer.out;
            if !members.is_empty() {
                out.push(b',');
            }
            let at = out.len();
            match &name.0 {
                Cow::Borrowed(name) => write_unescaped(out, name),
                Cow::Owned(name) => write_json(out, name.as_str()),
            }
            out.push(b':');
            map.next_value_seed(Canonical(&mut *writer))?;
            members.push((name, at, writer.out.len()));
        }
        writer.out.push(b'}');
        // Stable: members with the same name keep their order. Usually already in order.
        if !members.is_sorted_by(|(a, ..), (b, ..)| a.0 <= b.0) {
            // Each level of out-of-order nesting moves everything inside it once more: the
            // budget keeps the total linear in the input.
            let length = writer.out.len() - start;
            if length > writer.budget {
                writer.over_budget = true;
                return Err(A::Error::custom("over the reordering budget"));
            }
            writer.budget -= length;
            writer.moved += length;
            members.sort_by(|(a, ..), (b, ..)| a.0.cmp(&b.0));
            let Writer { out, scratch, .. } = writer;
            scratch.clear();
            scratch.extend_from_slice(&out[start..]);
            out.truncate(start);
            out.push(b'{');
            for (i, (_, from, to)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(&scratch[from - start..to - start]);
            }
            out.push(b'}');
        }
        Ok(())
    }
}

/// An object member's name, borrowed from the input unless it had escapes to decode.
struct Name<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;

        impl<'de> Visitor<'de> for NameVisitor {
            type Value = Name<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object member name")
            }

            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(v)))
            }

            fn visit_str<E>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
        }

        deserializer.deserialize_str(NameVisitor)
    }
}

/// Appends a number or string as serde_json writes it: strings minimally escaped, integers in
/// decimal, other numbers in ryu's shortest round-trip form.
fn write_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    // Serialising a number or `str` into a `Vec` cannot fail.
    let _ = value.serialize(&mut serde_json::Serializer::new(out));
}

/// Appends a string read straight from the input, quoted. Borrowed from the input, it held no
/// escape, so none of what minimal escaping escapes (`"`, `\`, control characters, which JSON
/// does not allow unescaped): it is its own canonical form, and is copied without a second scan.
fn write_unescaped(out: &mut Vec<u8>, v: &str) {
    out.reserve(v.len() + 2);
    out.push(b'"');
    out.extend_from_slice(v.as_bytes());
    out.push(b'"');
}

/// A decoded form or query pair: name and value bytes.
pub type FormPair<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

/// The decoded name/value pairs of a `application/x-www-form-urlencoded` string, stably sorted
/// by name. Decoding is to bytes, not lossy UTF-8, so `%FE` and `%FF` stay different.
///
/// Every pair is decoded, however many there are; the fingerprint calls it only for strings of
/// at most 10,000 pairs (see [bounded work](self#bounded-work)).
pub fn canonical_form_pairs(encoded: &[u8]) -> Vec<FormPair<'_>> {
    let mut pairs: Vec<_> = encoded
        .split(|b| *b == b'&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = match pair.iter().position(|b| *b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &[][..]),
            };
            (form_decode(name), form_decode(value))
        })
        .collect();
    pairs.sort_by(|(a, _), (b, _)| a.cmp(b));
    pairs
}

fn form_decode(input: &[u8]) -> Cow<'_, [u8]> {
    let plus_free: Cow<'_, [u8]> = if input.contains(&b'+') {
        Cow::Owned(
            input
                .iter()
                .map(|&b| if b == b'+' { b' ' } else { b })
                .collect(),
        )
    } else {
        Cow::Borrowed(input)
    };
    match plus_free {
        Cow::Borrowed(bytes) => percent_encoding::percent_decode(bytes).into(),
        Cow::Owned(bytes) => Cow::Owned(percent_encoding::percent_decode(&bytes).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonical_json(s.as_bytes()).unwrap()).unwrap()
    }

    fn fp(
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

    const JSON: Option<&str> = Some("application/json");
    const FORM: Option<&str> = Some("application/x-www-form-urlencoded");

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
    fn json_objects_are_sorted_and_compacted() {
        assert_eq!(
            canon(r#" { "b" : [ 1 , { "d":null, "c":true } ], "a" : "x" } "#),
            r#"{"a":"x","b":[1,{"c":true,"d":null}]}"#
        );
    }

    #[test]
    fn json_numbers_compare_as_numbers() {
        assert_eq!(
            canon("[1, 1.0, 1e0, 100, 1e2, -0, 0.5, 1.50]"),
            "[1,1,1,100,100,0,0.5,1.5]"
        );
        assert_eq!(
            canon("[18446744073709551615, -9223372036854775808]"),
            "[18446744073709551615,-9223372036854775808]"
        );
        assert_eq!(
            canon("[9007199254740993, 1e300]"),
            "[9007199254740993,1e+300]"
        );
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", JSON, r#"{"amount":1000}"#),
            fp(FingerprintMode::Semantic, "/", JSON, r#"{"amount":1001}"#),
        );
    }

    #[test]
    fn json_strings_are_escaped_minimally() {
        assert_eq!(canon(r#""caf\u00e9 \/ \u0041 \n""#), "\"café / A \\n\"");
        // A string without escapes is copied from the input; one with them is decoded and
        // escaped again: the two meet.
        assert_eq!(
            canon(r#"{"caf\u00e9":"\ud83d\ude00 \/"}"#),
            canon(r#"{"café":"😀 /"}"#)
        );
        assert_eq!(canon(r#"{"café":"😀 /"}"#), r#"{"café":"😀 /"}"#);
    }

    #[test]
    fn json_duplicate_members_keep_their_order() {
        assert_eq!(canon(r#"{"b":1,"a":2,"b":3}"#), r#"{"a":2,"b":1,"b":3}"#);
        assert_ne!(canon(r#"{"a":1,"a":2}"#), canon(r#"{"a":2,"a":1}"#));
    }

    #[test]
    fn canonical_json_is_a_fixed_point() {
        for doc in [
            r#"{"z":{"y":[{"b":1,"a":2}]},"a":"\n"}"#,
            "[]",
            "{}",
            "\"\"",
            "0",
        ] {
            let once = canonical_json(doc.as_bytes()).unwrap();
            assert_eq!(canonical_json(&once).unwrap(), once);
        }
    }

    #[test]
    fn deep_json_is_an_error_not_a_stack_overflow() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(canonical_json(deep.as_bytes()).is_err());
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
    fn form_pairs_are_sorted_by_name_keeping_repeated_values_in_order() {
        let a = fp(
            FingerprintMode::Semantic,
            "/",
            FORM,
            "amount=100&metadata%5Bx%5D=1&currency=usd",
        );
        let b = fp(
            FingerprintMode::Semantic,
            "/",
            FORM,
            "currency=usd&amount=100&metadata[x]=1",
        );
        assert_eq!(a, b);
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", FORM, "tag=a&tag=b"),
            fp(FingerprintMode::Semantic, "/", FORM, "tag=b&tag=a"),
        );
        assert_eq!(
            fp(FingerprintMode::Semantic, "/", FORM, "d=a+b"),
            fp(FingerprintMode::Semantic, "/", FORM, "d=a%20b"),
        );
    }

    #[test]
    fn form_decoding_is_not_lossy() {
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", FORM, "a=%FE"),
            fp(FingerprintMode::Semantic, "/", FORM, "a=%FF"),
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

    /// The fingerprint of `POST {path}` whose query (`None`: none) and form body (`None`: an
    /// empty body of no declared type) are hashed as raw bytes. This layout is what keeps raw
    /// bytes apart from decoded pairs: a pair count is never `u64::MAX`.
    fn raw_pairs_fingerprint(path: &str, query: Option<&[u8]>, form: Option<&[u8]>) -> Fingerprint {
        let raw_pairs = |hasher: &mut Sha256, bytes: &[u8]| {
            hasher.update(u64::MAX.to_be_bytes());
            hasher.update((bytes.len() as u64).to_be_bytes());
            hasher.update(bytes);
        };
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/v1\0");
        for field in [&b"POST"[..], path.as_bytes()] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        match query {
            Some(query) => raw_pairs(&mut hasher, query),
            None => hasher.update(0u64.to_be_bytes()),
        }
        match form {
            Some(form) => {
                hasher.update(b"form\0");
                raw_pairs(&mut hasher, form);
            }
            None => hasher.update(b"raw\0"),
        }
        Fingerprint(hasher.finalize().into())
    }

    /// `n` pairs with distinct names (`0&1&…&a&b…`, hexadecimal), in order or reversed.
    fn distinct_pairs(n: usize, reversed: bool) -> String {
        let mut pairs: Vec<String> = (0..n).map(|i| format!("{i:x}")).collect();
        if reversed {
            pairs.reverse();
        }
        pairs.join("&")
    }

    #[test]
    fn two_mebibyte_forms_are_hashed_as_their_bytes() {
        // A million pairs of one byte each.
        let repeated = "a&".repeat(1 << 20);
        // Two hundred thousand pairs with distinct names, as a query string would have them.
        let mut query_like = String::new();
        for i in 0.. {
            if query_like.len() >= 2 << 20 {
                break;
            }
            query_like.push_str(&format!("field{i}=value+{i}&"));
        }
        for body in [&repeated, &query_like] {
            assert_eq!(
                fp(FingerprintMode::Semantic, "/", FORM, body),
                raw_pairs_fingerprint("/", None, Some(body.as_bytes())),
            );
        }
        let mut reordered: Vec<&str> = query_like.split('&').collect();
        reordered.reverse();
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", FORM, &query_like),
            fp(FingerprintMode::Semantic, "/", FORM, &reordered.join("&")),
            "the bytes are compared, not the pairs"
        );
    }

    #[test]
    fn ten_thousand_pairs_are_compared_as_pairs_and_more_as_bytes() {
        let form = |body: &str| fp(FingerprintMode::Semantic, "/", FORM, body);
        let most = distinct_pairs(MAX_FORM_PAIRS, false);
        assert_eq!(form(&most), form(&distinct_pairs(MAX_FORM_PAIRS, true)));
        // Empty segments are not pairs.
        assert_eq!(form(&format!("&&{most}&&&")), form(&most));
        let over = distinct_pairs(MAX_FORM_PAIRS + 1, false);
        assert_eq!(
            form(&over),
            raw_pairs_fingerprint("/", None, Some(over.as_bytes()))
        );
        assert_ne!(form(&over), form(&distinct_pairs(MAX_FORM_PAIRS + 1, true)));

        let query = |pairs: &str| fp(FingerprintMode::Semantic, &format!("/x?{pairs}"), None, "");
        assert_eq!(query(&most), query(&distinct_pairs(MAX_FORM_PAIRS, true)));
        assert_eq!(
            query(&over),
            raw_pairs_fingerprint("/x", Some(over.as_bytes()), None)
        );
        assert_ne!(
            query(&over),
            query(&distinct_pairs(MAX_FORM_PAIRS + 1, true))
        );
    }

    /// `depth` nested objects `{"z":…,"a":0}`, each out of order, around a string that pads the
    /// document to `size` bytes: sorting moves everything inside each object once per level.
    fn deep_unordered_json(depth: usize, size: usize) -> String {
        let (open, close) = (r#"{"z":"#, r#","a":0}"#);
        let padding = size.saturating_sub(depth * (open.len() + close.len()) + 2);
        let mut doc = open.repeat(depth);
        doc.push('"');
        doc.push_str(&"x".repeat(padding));
        doc.push('"');
        doc.push_str(&close.repeat(depth));
        doc
    }

    #[test]
    fn deep_out_of_order_json_stops_at_the_reordering_budget() {
        let doc = deep_unordered_json(120, 2 << 20);
        let mut writer = Writer::new(doc.len());
        assert!(matches!(
            writer.canonicalise(doc.as_bytes()),
            Err(CanonicalJsonError::OverBudget)
        ));
        assert!(
            writer.moved <= reorder_budget(doc.len()),
            "moved {} bytes for {}",
            writer.moved,
            doc.len()
        );
        assert!(matches!(
            canonical_json(doc.as_bytes()),
            Err(CanonicalJsonError::OverBudget)
        ));
        // Hashed as its raw bytes, as a body that is not JSON is.
        assert_eq!(
            fp(FingerprintMode::Semantic, "/", JSON, &doc),
            fp(FingerprintMode::Semantic, "/", Some("text/plain"), &doc),
        );
    }

    #[test]
    fn deep_out_of_order_json_within_the_budget_is_sorted() {
        let depth = 16;
        let doc = deep_unordered_json(depth, 4096);
        let open = r#"{"a":0,"z":"#;
        let mut sorted = open.repeat(depth);
        sorted.push('"');
        sorted.push_str(&"x".repeat(doc.len() - depth * (open.len() + 1) - 2));
        sorted.push('"');
        sorted.push_str(&"}".repeat(depth));
        let mut writer = Writer::new(doc.len());
        writer.canonicalise(doc.as_bytes()).unwrap();
        assert_eq!(String::from_utf8(writer.out).unwrap(), sorted);
        assert!(writer.moved <= reorder_budget(doc.len()));
    }

    /// Polls `future` once.
    async fn poll_once<F: std::future::Future>(
        mut future: std::pin::Pin<&mut F>,
    ) -> std::task::Poll<F::Output> {
        std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx))).await
    }

    #[test]
    fn large_bodies_are_fingerprinted_off_the_async_workers() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .build()
            .unwrap();
        runtime.block_on(async {
            // The one blocking thread is taken until `release` is dropped.
            let (release, held) = std::sync::mpsc::channel::<()>();
            let taken = tokio::task::spawn_blocking(move || {
                let _ = held.recv();
            });
            let text = HeaderValue::from_static("text/plain");
            let (coverage, method, uri) = (
                Coverage::default(),
                Method::POST,
                Uri::from_static("/v1/charges"),
            );
            let mut headers = HeaderMap::new();
            headers.insert(http::header::CONTENT_TYPE, text.clone());
            let (small_body, large_body) = (
                Bytes::from(vec![b'x'; INLINE_BODY_BYTES]),
                Bytes::from(vec![b'x'; INLINE_BODY_BYTES + 1]),
            );
            let expected = |size: usize| {
                Fingerprint::compute(
                    FingerprintMode::Semantic,
                    &Method::POST,
                    &Uri::from_static("/v1/charges"),
                    Some(&text),
                    &vec![b'x'; size],
                )
            };

            let mut small = std::pin::pin!(compute_for_request(
                &coverage,
                &method,
                &uri,
                &headers,
                &small_body
            ));
            match poll_once(small.as_mut()).await {
                std::task::Poll::Ready(fingerprint) => {
                    assert_eq!(fingerprint, expected(INLINE_BODY_BYTES));
                }
                std::task::Poll::Pending => panic!("a 64 KiB body waited for the blocking pool"),
            }
            let mut large = std::pin::pin!(compute_for_request(
                &coverage,
                &method,
                &uri,
                &headers,
                &large_body
            ));
            assert!(
                poll_once(large.as_mut()).await.is_pending(),
                "a larger body was fingerprinted on the async worker"
            );
            drop(release);
            taken.await.unwrap();
            assert_eq!(large.await, expected(INLINE_BODY_BYTES + 1));
        });
    }

    #[test]
    fn large_bodies_are_fingerprinted_one_per_core_at_a_time() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .build()
            .unwrap();
        runtime.block_on(async {
            // Every slot taken, as by as many large bodies being fingerprinted.
            let taken = blocking_slots().acquire_many(cores() as u32).await.unwrap();
            let body = Bytes::from(vec![b'x'; INLINE_BODY_BYTES + 1]);
            let coverage = Coverage {
                mode: FingerprintMode::Raw,
                ..Coverage::default()
            };
            let (method, uri, headers) = (
                Method::POST,
                Uri::from_static("/v1/charges"),
                HeaderMap::new(),
            );
            let mut waiting = std::pin::pin!(compute_for_request(
                &coverage, &method, &uri, &headers, &body
            ));
            assert!(poll_once(waiting.as_mut()).await.is_pending());
            // The one blocking thread runs its tasks in order: had the fingerprint been handed
            // to it, it would be done once this later task is.
            tokio::task::spawn_blocking(|| ()).await.unwrap();
            assert!(
                poll_once(waiting.as_mut()).await.is_pending(),
                "fingerprinted with every slot taken"
            );
            drop(taken);
            let expected = Fingerprint::compute(
                FingerprintMode::Raw,
                &Method::POST,
                &Uri::from_static("/v1/charges"),
                None,
                &body,
            );
            assert_eq!(waiting.await, expected);
        });
    }

    /// Hostile and reordered bodies: canonicalisation never panics, is a fixed point, keeps the
    /// meaning, and ignores exactly the differences it documents.
    mod properties {
        use proptest::prelude::*;
        use serde_json::Value;

        use super::*;

        /// JSON equality with numbers compared by value (`1.0` is `1`) and duplicate members
        /// as serde_json keeps them (the last).
        fn same_json(a: &Value, b: &Value) -> bool {
            match (a, b) {
                (Value::Number(a), Value::Number(b)) => match (a.as_i64(), b.as_i64()) {
                    (Some(a), Some(b)) => a == b,
                    _ => match (a.as_u64(), b.as_u64()) {
                        (Some(a), Some(b)) => a == b,
                        _ => a.as_f64() == b.as_f64(),
                    },
                },
                (Value::Array(a), Value::Array(b)) => {
                    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_json(a, b))
                }
                (Value::Object(a), Value::Object(b)) => {
                    a.len() == b.len()
                        && a.iter()
                            .all(|(name, a)| b.get(name).is_some_and(|b| same_json(a, b)))
                }
                _ => a == b,
            }
        }

        /// The canonical-form properties of one input.
        fn check_canonical(input: &[u8]) -> Result<(), TestCaseError> {
            let parsed = serde_json::from_slice::<Value>(input);
            let Ok(canonical) = canonical_json(input) else {
                prop_assert!(
                    parsed.is_err(),
                    "serde_json accepts what canonical_json rejects"
                );
                return Ok(());
            };
            let parsed = parsed.expect("canonical_json accepts only JSON");
            prop_assert!(canonical.len() <= 8 * input.len() + 8);
            let again = canonical_json(&canonical).expect("the canonical form is JSON");
            prop_assert_eq!(
                String::from_utf8_lossy(&again),
                String::from_utf8_lossy(&canonical),
                "not a fixed point; input {:?}",
                String::from_utf8_lossy(input)
            );
            let reparsed: Value = serde_json::from_slice(&canonical).unwrap();
            prop_assert!(same_json(&parsed, &reparsed), "{parsed} became {reparsed}");
            Ok(())
        }

        fn json_value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<u64>().prop_map(Value::from),
                (-1000i64..1000).prop_map(Value::from),
                (prop::num::f64::NORMAL | prop::num::f64::SUBNORMAL | prop::num::f64::ZERO)
                    .prop_map(Value::from),
                any::<String>().prop_map(Value::from),
                "[a-c\"\\\\/\u{0}-\u{1f}\u{e9}\u{1f600}]{0,6}".prop_map(Value::from),
            ];
            leaf.prop_recursive(6, 64, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                    prop::collection::vec(("[a-e]{0,2}|\\PC{0,4}", inner), 0..6)
                        .prop_map(|members| Value::Object(members.into_iter().collect())),
                ]
            })
        }

        /// xorshift64, for the choices of one rewriting.
        struct Rng(u64);

        impl Rng {
            fn below(&mut self, n: usize) -> usize {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 % n as u64) as usize
            }

            fn space(&mut self, out: &mut String) {
                out.push_str(["", " ", "\n", "\t", "\r\n  "][self.below(5)]);
            }
        }

        /// `value` as JSON with its members shuffled, whitespace between tokens, and integers
        /// spelt `7`, `7.0` or `7e0`: the same document, written differently.
        fn rewrite(value: &Value, rng: &mut Rng, out: &mut String) {
            rng.space(out);
            match value {
                Value::Number(n) => match (n.as_i64(), rng.below(3)) {
                    (Some(i), 1) if i.unsigned_abs() < 1 << 53 => out.push_str(&format!("{i}.0")),
                    (Some(i), 2) if i.unsigned_abs() < 1 << 53 => out.push_str(&format!("{i}e0")),
                    _ => out.push_str(&n.to_string()),
                },
                Value::Array(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        rewrite(item, rng, out);
                    }
                    rng.space(out);
                    out.push(']');
                }
                Value::Object(members) => {
                    let mut members: Vec<_> = members.iter().collect();
                    for i in (1..members.len()).rev() {
                        members.swap(i, rng.below(i + 1));
                    }
                    out.push('{');
                    for (i, (name, member)) in members.into_iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        rng.space(out);
                        string(name, rng, out);
                        rng.space(out);
                        out.push(':');
                        rewrite(member, rng, out);
                    }
                    rng.space(out);
                    out.push('}');
                }
                Value::String(text) => string(text, rng, out),
                other => out.push_str(&other.to_string()),
            }
            rng.space(out);
        }

        /// `text` as a JSON string, each character written either as itself (escaped where it
        /// must be) or as a `\u` escape: a string with no escape is read straight from the
        /// input, one with any is decoded, and both must come out the same.
        fn string(text: &str, rng: &mut Rng, out: &mut String) {
            out.push('"');
            for c in text.chars() {
                if rng.below(4) == 0 {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                } else {
                    let quoted = serde_json::to_string(&c).unwrap();
                    out.push_str(&quoted[1..quoted.len() - 1]);
                }
            }
            out.push('"');
        }

        /// Text that looks like JSON, to reach the canonicaliser's error paths and numbers.
        fn json_like() -> impl Strategy<Value = String> {
            let token = prop_oneof![
                prop::sample::select(vec![
                    "{",
                    "}",
                    "[",
                    "]",
                    ",",
                    ":",
                    "\"a\"",
                    "\"b\"",
                    "\"\\u00e9\"",
                    "\"\\ud800\"",
                    "null",
                    "true",
                    "-",
                    "0",
                    "1",
                    "1.5",
                    "1e400",
                    "-0",
                    " ",
                    "\"",
                ])
                .prop_map(str::to_owned),
                "-?[0-9]{1,40}(\\.[0-9]{1,25})?([eE][+-]?[0-9]{1,3})?",
            ];
            prop::collection::vec(token, 0..16).prop_map(|tokens| tokens.concat())
        }

        fn form_fp(body: &[u8]) -> Fingerprint {
            Fingerprint::compute(
                FingerprintMode::Semantic,
                &Method::POST,
                &"/v1/charges".parse().unwrap(),
                Some(&HeaderValue::from_static(
                    "application/x-www-form-urlencoded",
                )),
                body,
            )
        }

        fn json_fp(mode: FingerprintMode, body: &[u8]) -> Fingerprint {
            Fingerprint::compute(
                mode,
                &Method::POST,
                &"/v1/charges".parse().unwrap(),
                Some(&HeaderValue::from_static("application/json")),
                body,
            )
        }

        /// Inputs the fuzzer and the properties below found: serde_json's default float
        /// parsing is off by one unit in the last place for some of them, so a number's
        /// canonical form (its shortest round-trip text) read again gave another number.
        #[test]
        fn found_numbers_canonicalise_to_a_fixed_point() {
            for text in [
                "123456789012345678901234567567890",
                "1.2345678901234569e32",
                "2.9740580593746687e+198",
                "3.12477480194E43",
                "8774635365608721.0",
            ] {
                check_canonical(text.as_bytes()).unwrap();
                let canonical = canonical_json(text.as_bytes()).unwrap();
                let canonical = std::str::from_utf8(&canonical).unwrap();
                assert_eq!(
                    canonical.parse::<f64>().unwrap(),
                    text.parse::<f64>().unwrap(),
                    "{text} became {canonical}"
                );
            }
            // The module documentation's promise: integers below 2^53 are exact, so `n` and
            // `n.0` are the same number and the same request.
            assert_eq!(
                json_fp(FingerprintMode::Semantic, br#"{"amount":8774635365608721}"#),
                json_fp(
                    FingerprintMode::Semantic,
                    br#"{"amount":8774635365608721.0}"#
                ),
            );
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn any_bytes_canonicalise_without_panic(
                bytes in prop::collection::vec(any::<u8>(), 0..200),
            ) {
                check_canonical(&bytes)?;
            }

            #[test]
            fn json_like_text_canonicalises_to_a_fixed_point(text in json_like()) {
                check_canonical(text.as_bytes())?;
            }

            /// Numbers are read as IEEE-754 doubles correctly rounded (`str::parse`), so two
            /// spellings of the same double are the same number.
            #[test]
            fn numbers_are_read_correctly_rounded(
                text in "-?[1-9][0-9]{0,40}(\\.[0-9]{1,25})?([eE][+-]?[0-9]{1,3})?",
            ) {
                let Ok(canonical) = canonical_json(text.as_bytes()) else {
                    // Out of range for a double (`1e400`).
                    prop_assert!(text.parse::<f64>().unwrap().is_infinite());
                    return Ok(());
                };
                let canonical = String::from_utf8(canonical).unwrap();
                if let (Ok(a), Ok(b)) = (text.parse::<i128>(), canonical.parse::<i128>()) {
                    prop_assert_eq!(a, b);
                } else {
                    let expected = text.parse::<f64>().unwrap();
                    let got = canonical.parse::<f64>().unwrap();
                    prop_assert_eq!(got, expected, "{} became {}", text, canonical);
                }
                check_canonical(text.as_bytes())?;
            }

            #[test]
            fn raw_mode_tells_any_two_bodies_apart(
                a in prop::collection::vec(any::<u8>(), 0..64),
                b in prop::collection::vec(any::<u8>(), 0..64),
            ) {
                prop_assert_eq!(
                    json_fp(FingerprintMode::Raw, &a) == json_fp(FingerprintMode::Raw, &b),
                    a == b
                );
            }

            #[test]
            fn form_pairs_with_distinct_names_may_come_in_any_order(
                pairs in prop::collection::btree_map(
                    "[a-z%+0-9\\[\\]=]{1,6}",
                    "[a-z%+0-9&=]{0,6}",
                    0..8,
                ),
                seed in any::<u64>(),
            ) {
                let encode = |s: &str| {
                    s.replace('%', "%25")
                        .replace('+', "%2B")
                        .replace('&', "%26")
                        .replace('=', "%3D")
                };
                let mut segments: Vec<String> = pairs
                    .iter()
                    .map(|(n, v)| format!("{}={}", encode(n), encode(v)))
                    .collect();
                let body = segments.join("&");
                let mut rng = Rng(seed | 1);
                for i in (1..segments.len()).rev() {
                    segments.swap(i, rng.below(i + 1));
                }
                let shuffled = segments.join("&");
                prop_assert_eq!(form_fp(body.as_bytes()), form_fp(shuffled.as_bytes()));
                let decoded = canonical_form_pairs(body.as_bytes());
                prop_assert_eq!(decoded.len(), pairs.len());
                for ((name, value), (n, v)) in decoded.iter().zip(&pairs) {
                    prop_assert_eq!(&name[..], n.as_bytes());
                    prop_assert_eq!(&value[..], v.as_bytes());
                }
            }

            #[test]
            fn any_form_body_decodes_without_panic(
                bytes in prop::collection::vec(any::<u8>(), 0..200).prop_map(|mut bytes| {
                    // Control bytes become the ones the decoder splits and decodes on.
                    for b in &mut bytes {
                        if *b < 32 {
                            *b = b"&=%+"[usize::from(*b % 4)];
                        }
                    }
                    bytes
                }),
            ) {
                let pairs = canonical_form_pairs(&bytes);
                let segments = bytes.split(|b| *b == b'&').filter(|s| !s.is_empty()).count();
                prop_assert_eq!(pairs.len(), segments);
                prop_assert!(pairs.windows(2).all(|w| w[0].0 <= w[1].0));
                let _ = form_fp(&bytes);
            }
        }

        proptest! {
            // Generating nested documents is the slow part in debug builds.
            #![proptest_config(ProptestConfig::with_cases(1000))]

            #[test]
            fn rewritten_documents_have_one_fingerprint(
                value in json_value(),
                seed in any::<u64>(),
            ) {
                let compact = serde_json::to_vec(&value).unwrap();
                let mut rewritten = String::new();
                rewrite(&value, &mut Rng(seed | 1), &mut rewritten);
                check_canonical(&compact)?;
                check_canonical(rewritten.as_bytes())?;
                prop_assert_eq!(
                    canonical_json(&compact).unwrap(),
                    canonical_json(rewritten.as_bytes()).unwrap(),
                    "{}", rewritten
                );
                prop_assert_eq!(
                    json_fp(FingerprintMode::Semantic, &compact),
                    json_fp(FingerprintMode::Semantic, rewritten.as_bytes())
                );
                let raw = json_fp(FingerprintMode::Raw, &compact);
                let raw_rewritten = json_fp(FingerprintMode::Raw, rewritten.as_bytes());
                prop_assert_eq!(raw == raw_rewritten, compact == rewritten.as_bytes());
            }

            #[test]
            fn different_documents_have_different_fingerprints(
                a in json_value(),
                b in json_value(),
            ) {
                let (x, y) = (serde_json::to_vec(&a).unwrap(), serde_json::to_vec(&b).unwrap());
                let (a, b): (Value, Value) =
                    (serde_json::from_slice(&x).unwrap(), serde_json::from_slice(&y).unwrap());
                if !same_json(&a, &b) {
                    prop_assert_ne!(
                        json_fp(FingerprintMode::Semantic, &x),
                        json_fp(FingerprintMode::Semantic, &y)
                    );
                }
            }
        }
    }
}
