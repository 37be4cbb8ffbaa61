//! A completed record as the store keeps it: one allocation for status, headers and body.

use super::*;

/// A completed record as the store keeps it: status, headers and body in one allocation, so
/// that the hundreds of thousands of records a busy store holds for their TTL are one block
/// each rather than the response's four (record, header table and entries, body), scattered
/// among every request's short-lived allocations. Unpacked into a [`Record`] on replay, whose
/// body is a slice of the same buffer.
#[derive(Debug, Clone)]
pub(super) struct Packed {
    pub(super) status: http::StatusCode,
    /// Each header as name length, name, value length, value (lengths as 4-byte little-endian);
    /// then the body.
    pub(super) bytes: bytes::Bytes,
    /// Where the body starts in `bytes`, if it was kept.
    pub(super) body_at: Option<usize>,
}

impl Packed {
    pub(super) fn pack(record: &Record) -> Self {
        let headers: usize = record
            .headers()
            .iter()
            .map(|(name, value)| 8 + name.as_str().len() + value.len())
            .sum();
        let body = record.body().map_or(&[][..], |b| &b[..]);
        let mut bytes = Vec::with_capacity(headers + body.len());
        for (name, value) in record.headers() {
            put(&mut bytes, name.as_str().as_bytes());
            put(&mut bytes, value.as_bytes());
        }
        let body_at = record.body().map(|_| bytes.len());
        bytes.extend_from_slice(body);
        Self {
            status: record.status(),
            bytes: bytes.into(),
            body_at,
        }
    }

    pub(super) fn unpack(&self) -> Record {
        let mut headers = http::HeaderMap::new();
        let mut rest = &self.bytes[..self.body_at.unwrap_or(self.bytes.len())];
        while let Some((name, after)) = take(rest) {
            let Some((value, after)) = take(after) else {
                break;
            };
            // Both were a valid name and value when packed.
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name),
                http::HeaderValue::from_bytes(value),
            ) {
                headers.append(name, value);
            }
            rest = after;
        }
        let body = self.body_at.map(|at| self.bytes.slice(at..));
        Record::from_parts(self.status, headers, body)
    }
}

/// Appends `field`, prefixed by its length.
pub(super) fn put(bytes: &mut Vec<u8>, field: &[u8]) {
    bytes.extend_from_slice(&(field.len() as u32).to_le_bytes());
    bytes.extend_from_slice(field);
}

/// The field at the start of `bytes`, and what follows it.
pub(super) fn take(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<4>()?;
    let len = u32::from_le_bytes(*len) as usize;
    (rest.len() >= len).then(|| rest.split_at(len))
}
