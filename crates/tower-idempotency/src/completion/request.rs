//! A keyed request as the layer keeps it for the completer: method, URI, the headers kept,
//! body and principal, in a small length-prefixed encoding.

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, request::Parts};

use crate::scope::Principal;

/// The encoding's version, its first byte.
const VERSION: u8 = 1;

/// A request kept for the completer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeptRequest {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    /// Empty for a single-tenant scope, which has no principal to restore.
    pub(crate) principal: String,
}

/// A kept request's bytes did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MalformedRequest;

impl fmt::Display for MalformedRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a request kept for completion does not decode")
    }
}

impl std::error::Error for MalformedRequest {}

impl KeptRequest {
    /// The request in `parts`, keeping only the headers `keep` names.
    pub(crate) fn new(
        parts: &Parts,
        uri: &Uri,
        keep: &[&HeaderName],
        body: &Bytes,
        principal: &Principal,
    ) -> Self {
        let mut headers = HeaderMap::new();
        for name in keep {
            for value in parts.headers.get_all(*name) {
                headers.append((*name).clone(), value.clone());
            }
        }
        Self {
            method: parts.method.clone(),
            uri: uri.clone(),
            headers,
            body: body.clone(),
            principal: principal.as_str().to_owned(),
        }
    }

    pub(crate) fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(64 + self.body.len());
        out.put_u8(VERSION);
        put(&mut out, self.method.as_str().as_bytes());
        put(&mut out, self.uri.to_string().as_bytes());
        put(&mut out, self.principal.as_bytes());
        out.put_u32(u32::try_from(self.headers.len()).unwrap_or(u32::MAX));
        for (name, value) in &self.headers {
            put(&mut out, name.as_str().as_bytes());
            put(&mut out, value.as_bytes());
        }
        put(&mut out, &self.body);
        out.freeze()
    }

    pub(crate) fn decode(mut bytes: Bytes) -> Result<Self, MalformedRequest> {
        if take(&mut bytes, 1)?[..] != [VERSION] {
            return Err(MalformedRequest);
        }
        let method = Method::from_bytes(&field(&mut bytes)?).map_err(|_| MalformedRequest)?;
        let uri = Uri::from_maybe_shared(field(&mut bytes)?).map_err(|_| MalformedRequest)?;
        let principal =
            String::from_utf8(field(&mut bytes)?.to_vec()).map_err(|_| MalformedRequest)?;
        let count = u32::from_be_bytes(fixed(take(&mut bytes, 4)?));
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name = HeaderName::from_bytes(&field(&mut bytes)?).map_err(|_| MalformedRequest)?;
            let value =
                HeaderValue::from_maybe_shared(field(&mut bytes)?).map_err(|_| MalformedRequest)?;
            headers.append(name, value);
        }
        let body = field(&mut bytes)?;
        if !bytes.is_empty() {
            return Err(MalformedRequest);
        }
        Ok(Self {
            method,
            uri,
            headers,
            body,
            principal,
        })
    }

    /// The request again, with `B` as its body.
    pub(crate) fn into_request<B: From<Bytes>>(self) -> Request<B> {
        let mut request = Request::new(B::from(self.body));
        *request.method_mut() = self.method;
        *request.uri_mut() = self.uri;
        *request.headers_mut() = self.headers;
        request
    }
}

fn put(out: &mut BytesMut, field: &[u8]) {
    out.put_u32(u32::try_from(field.len()).unwrap_or(u32::MAX));
    out.put_slice(field);
}

fn take(bytes: &mut Bytes, len: usize) -> Result<Bytes, MalformedRequest> {
    if bytes.len() < len {
        return Err(MalformedRequest);
    }
    Ok(bytes.split_to(len))
}

fn field(bytes: &mut Bytes) -> Result<Bytes, MalformedRequest> {
    let len = u32::from_be_bytes(fixed(take(bytes, 4)?));
    take(bytes, usize::try_from(len).map_err(|_| MalformedRequest)?)
}

fn fixed(bytes: Bytes) -> [u8; 4] {
    let mut out = [0; 4];
    out.copy_from_slice(&bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept() -> KeptRequest {
        let (mut parts, ()) = Request::post("/v1/charges?x=1")
            .header("idempotency-key", "k1")
            .header("x-merchant", "m1")
            .header("authorization", "Bearer secret")
            .body(())
            .unwrap()
            .into_parts();
        parts
            .headers
            .append("x-merchant", HeaderValue::from_static("m2"));
        let principal = Principal::new("acct_1").unwrap();
        let keep = [
            &crate::IDEMPOTENCY_KEY,
            &HeaderName::from_static("x-merchant"),
        ];
        let uri = parts.uri.clone();
        KeptRequest::new(&parts, &uri, &keep, &Bytes::from("{\"a\":1}"), &principal)
    }

    #[test]
    fn decodes_as_it_was_encoded_keeping_only_named_headers() {
        let kept = kept();
        assert!(kept.headers.get("authorization").is_none());
        assert_eq!(kept.headers.get_all("x-merchant").iter().count(), 2);
        assert_eq!(KeptRequest::decode(kept.encode()), Ok(kept));
    }

    #[test]
    fn truncated_or_extended_bytes_are_malformed() {
        let encoded = kept().encode();
        for len in 0..encoded.len() {
            assert_eq!(
                KeptRequest::decode(encoded.slice(..len)),
                Err(MalformedRequest),
                "{len}"
            );
        }
        let mut longer = BytesMut::from(&encoded[..]);
        longer.put_u8(0);
        assert_eq!(KeptRequest::decode(longer.freeze()), Err(MalformedRequest));
        let mut other_version = BytesMut::from(&encoded[..]);
        other_version[0] = 2;
        assert_eq!(
            KeptRequest::decode(other_version.freeze()),
            Err(MalformedRequest)
        );
    }
}
