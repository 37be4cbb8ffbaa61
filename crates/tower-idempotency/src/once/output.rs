//! What [`Once`](super::Once) stores and compares: a result as a marked JSON record, and a
//! payload's fingerprint.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header::CONTENT_TYPE};
use serde::{Serialize, de::DeserializeOwned};

use super::OnceError;
use crate::{
    fingerprint::{Fingerprint, FingerprintMode},
    record::Record,
};

/// Marks a record as a [`Once`](super::Once) result; its value says what the body holds.
const MARKER: HeaderName = HeaderName::from_static("x-idempotency-once");
/// The body is the result, as JSON.
const JSON: HeaderValue = HeaderValue::from_static("json");
/// The result could not be encoded: the effects stand, the result was not kept.
const UNENCODABLE: HeaderValue = HeaderValue::from_static("unencodable");

/// The record of `value`: its JSON, or a record saying it could not be encoded, with the error.
pub(super) fn record<T: Serialize>(value: &T) -> (Record, Option<serde_json::Error>) {
    let mut headers = HeaderMap::with_capacity(2);
    match serde_json::to_vec(value) {
        Ok(json) => {
            headers.insert(MARKER, JSON);
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            let record = Record::from_parts(StatusCode::OK, headers, Some(Bytes::from(json)));
            (record, None)
        }
        Err(error) => {
            headers.insert(MARKER, UNENCODABLE);
            let record = Record::from_parts(StatusCode::OK, headers, None);
            (record, Some(error))
        }
    }
}

/// The result a completed key holds, as `T`.
pub(super) fn read<T: DeserializeOwned, E>(record: &Record) -> Result<T, OnceError<E>> {
    let marker = record.headers().get(&MARKER);
    match (marker, record.body()) {
        (Some(marker), Some(body)) if marker == JSON => {
            serde_json::from_slice(body).map_err(OnceError::Output)
        }
        (Some(marker), _) if marker == UNENCODABLE => Err(OnceError::Output(
            serde::de::Error::custom("the result of the first call could not be encoded"),
        )),
        _ => Err(OnceError::Output(serde::de::Error::custom(
            "the key holds a record that is not an idempotent call's result",
        ))),
    }
}

/// The fingerprint of `payload`: its JSON, canonicalised as the layer canonicalises JSON
/// bodies, so field order and whitespace never matter.
pub(super) fn fingerprint<P: Serialize + ?Sized, E>(
    payload: &P,
) -> Result<Fingerprint, OnceError<E>> {
    let json = serde_json::to_vec(payload).map_err(OnceError::Payload)?;
    let content_type = HeaderValue::from_static("application/json");
    Ok(Fingerprint::compute(
        FingerprintMode::Semantic,
        &Method::POST,
        &Uri::from_static("/"),
        Some(&content_type),
        &json,
    ))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn a_result_reads_back_and_a_foreign_record_is_refused() {
        let (stored, error) = record(&vec![1, 2, 3]);
        assert!(error.is_none());
        assert_eq!(read::<Vec<u8>, ()>(&stored).unwrap(), vec![1, 2, 3]);
        assert!(matches!(
            read::<String, ()>(&stored),
            Err(OnceError::Output(_))
        ));
        let foreign = Record::from_parts(StatusCode::OK, HeaderMap::new(), Some("[]".into()));
        assert!(matches!(
            read::<Vec<u8>, ()>(&foreign),
            Err(OnceError::Output(_))
        ));
    }

    #[test]
    fn an_unencodable_result_is_kept_as_such() {
        // JSON object keys must be strings.
        let map = BTreeMap::from([(vec![1u8], 1)]);
        let (stored, error) = record(&map);
        assert!(error.is_some());
        assert!(matches!(read::<u8, ()>(&stored), Err(OnceError::Output(_))));
    }

    #[test]
    fn payloads_compare_by_meaning() {
        let a: serde_json::Value = serde_json::from_str(r#"{"a":1,"b":[2]}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{ "b": [2], "a": 1 }"#).unwrap();
        let c: serde_json::Value = serde_json::from_str(r#"{"a":2,"b":[2]}"#).unwrap();
        let fp = |v| fingerprint::<_, ()>(v).unwrap();
        assert_eq!(fp(&a), fp(&b));
        assert_ne!(fp(&a), fp(&c));
    }
}
