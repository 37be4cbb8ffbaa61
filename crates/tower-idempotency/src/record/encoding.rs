//! One byte format for a [`Record`], for stores that keep records as bytes.

use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use super::Record;

/// The format [`Record::to_bytes`] writes; [`Record::from_bytes`] reads only this one.
const VERSION: u8 = 1;
/// The flag byte's bit that says the body was kept.
const BODY_KEPT: u8 = 1;

/// Why [`Record::from_bytes`] could not read a record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordBytesError {
    /// The leading version byte names a format this version of the crate does not know.
    UnknownVersion(u8),
    /// The bytes end before the record does.
    Truncated,
    /// The status is not one HTTP allows (100 to 999).
    InvalidStatus(u16),
    /// The flag byte has bits this format does not define.
    InvalidFlags(u8),
    /// A header name or value that HTTP does not allow.
    InvalidHeader,
    /// Bytes follow a record whose body was not kept.
    TrailingBytes,
}

impl fmt::Display for RecordBytesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownVersion(v) => write!(f, "unknown record format version {v}"),
            Self::Truncated => f.write_str("the record's bytes end early"),
            Self::InvalidStatus(s) => write!(f, "invalid status {s} in a stored record"),
            Self::InvalidFlags(b) => write!(f, "unknown flags {b:#04x} in a stored record"),
            Self::InvalidHeader => f.write_str("invalid header in a stored record"),
            Self::TrailingBytes => f.write_str("bytes after a stored record without a body"),
        }
    }
}

impl std::error::Error for RecordBytesError {}

impl Record {
    /// The record as bytes, in the one format every store may use to keep it (the memory store
    /// and the Redis example do); [`from_bytes`](Self::from_bytes) reads it back.
    ///
    /// The layout, integers big-endian:
    ///
    /// | bytes | what |
    /// |---|---|
    /// | 1 | format version, `1` |
    /// | 2 | status code |
    /// | 1 | flags: bit 0 set when the body was kept; other bits zero |
    /// | 4 | number of headers |
    /// | per header | 4-byte name length, name, 4-byte value length, value |
    /// | the rest | the body, when kept (else nothing) |
    pub fn to_bytes(&self) -> Bytes {
        let headers: usize = self
            .headers()
            .iter()
            .map(|(name, value)| 8 + name.as_str().len() + value.len())
            .sum();
        let body = self.body();
        let mut bytes = BytesMut::with_capacity(8 + headers + body.map_or(0, Bytes::len));
        bytes.put_u8(VERSION);
        bytes.put_u16(self.status().as_u16());
        bytes.put_u8(if body.is_some() { BODY_KEPT } else { 0 });
        bytes.put_u32(length(self.headers().len()));
        for (name, value) in self.headers() {
            for field in [name.as_str().as_bytes(), value.as_bytes()] {
                bytes.put_u32(length(field.len()));
                bytes.put_slice(field);
            }
        }
        if let Some(body) = body {
            bytes.put_slice(body);
        }
        bytes.freeze()
    }

    /// Reads a record written by [`to_bytes`](Self::to_bytes); its body is a slice of `bytes`.
    ///
    /// # Errors
    ///
    /// A [`RecordBytesError`] for anything `to_bytes` would not have written.
    pub fn from_bytes(bytes: Bytes) -> Result<Self, RecordBytesError> {
        let mut reader = Reader {
            bytes: &bytes,
            at: 0,
        };
        let version = reader.take::<1>()?[0];
        if version != VERSION {
            return Err(RecordBytesError::UnknownVersion(version));
        }
        let status = u16::from_be_bytes(reader.take()?);
        let status =
            StatusCode::from_u16(status).map_err(|_| RecordBytesError::InvalidStatus(status))?;
        let flags = reader.take::<1>()?[0];
        if flags & !BODY_KEPT != 0 {
            return Err(RecordBytesError::InvalidFlags(flags));
        }
        let count = u32::from_be_bytes(reader.take()?);
        // Not preallocated from `count`: the bytes may claim more headers than they hold.
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name = HeaderName::from_bytes(reader.field()?)
                .map_err(|_| RecordBytesError::InvalidHeader)?;
            let value = HeaderValue::from_bytes(reader.field()?)
                .map_err(|_| RecordBytesError::InvalidHeader)?;
            headers.append(name, value);
        }
        let body = if flags & BODY_KEPT != 0 {
            Some(bytes.slice(reader.at..))
        } else if reader.at < bytes.len() {
            return Err(RecordBytesError::TrailingBytes);
        } else {
            None
        };
        Ok(Self::from_parts(status, headers, body))
    }
}

/// A length as the format writes it; a record never holds a field of 4 GiB.
fn length(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Reads the fields of a record's bytes in order.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], RecordBytesError> {
        let field = self.slice(N)?;
        Ok(field.try_into().unwrap_or([0; N]))
    }

    fn slice(&mut self, n: usize) -> Result<&'a [u8], RecordBytesError> {
        let end = self.at.checked_add(n).ok_or(RecordBytesError::Truncated)?;
        let field = self
            .bytes
            .get(self.at..end)
            .ok_or(RecordBytesError::Truncated)?;
        self.at = end;
        Ok(field)
    }

    /// A length-prefixed field.
    fn field(&mut self) -> Result<&'a [u8], RecordBytesError> {
        let n = u32::from_be_bytes(self.take()?);
        self.slice(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn record() -> impl Strategy<Value = Record> {
        let header = ("[a-z][a-z0-9-]{0,12}", "[ -~]{0,20}");
        (
            100u16..1000,
            proptest::collection::vec(header, 0..6),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64)),
        )
            .prop_map(|(status, pairs, body)| {
                let mut headers = HeaderMap::new();
                for (name, value) in pairs {
                    headers.append(
                        HeaderName::from_bytes(name.as_bytes()).expect("a valid name"),
                        HeaderValue::from_str(&value).expect("printable ASCII"),
                    );
                }
                let status = StatusCode::from_u16(status).expect("100..1000");
                Record::from_parts(status, headers, body.map(Bytes::from))
            })
    }

    proptest! {
        /// Every record reads back as itself, repeated headers in their order included.
        #[test]
        fn records_round_trip(record in record()) {
            let read = Record::from_bytes(record.to_bytes()).expect("its own bytes");
            let order = |r: &Record| r.headers().iter().map(|(n, v)| (n.clone(), v.clone())).collect::<Vec<_>>();
            prop_assert_eq!(order(&read), order(&record));
            prop_assert_eq!(read, record);
        }

        /// Any bytes give a record or an error, never a panic; a record read from them writes
        /// back as a record that reads the same.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            if let Ok(record) = Record::from_bytes(Bytes::from(bytes)) {
                prop_assert_eq!(Record::from_bytes(record.to_bytes()), Ok(record));
            }
        }

        /// Every strict prefix of a record's bytes that ends inside its headers is refused.
        #[test]
        fn a_cut_record_is_refused(record in record(), cut in 0usize..1000) {
            let bytes = record.to_bytes();
            let body = record.body().map_or(0, Bytes::len);
            let head = bytes.len() - body;
            let cut = cut % head.max(1);
            prop_assert_eq!(
                Record::from_bytes(bytes.slice(..cut)),
                Err(RecordBytesError::Truncated)
            );
        }
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        let mut headers = HeaderMap::new();
        headers.append("a", HeaderValue::from_static("b"));
        let record = Record::from_parts(StatusCode::CREATED, headers, Some(Bytes::from("ok")));
        assert_eq!(
            &record.to_bytes()[..],
            b"\x01\x00\xc9\x01\x00\x00\x00\x01\x00\x00\x00\x01a\x00\x00\x00\x01bok"
        );
    }

    #[test]
    fn malformed_bytes_are_refused_by_kind() {
        let refused = |bytes: &'static [u8]| Record::from_bytes(Bytes::from_static(bytes));
        assert_eq!(refused(b""), Err(RecordBytesError::Truncated));
        assert_eq!(refused(b"\x02"), Err(RecordBytesError::UnknownVersion(2)));
        assert_eq!(
            refused(b"\x01\x00\x05\x00\x00\x00\x00\x00"),
            Err(RecordBytesError::InvalidStatus(5))
        );
        assert_eq!(
            refused(b"\x01\x00\xc8\x02\x00\x00\x00\x00"),
            Err(RecordBytesError::InvalidFlags(2))
        );
        assert_eq!(
            refused(b"\x01\x00\xc8\x00\x00\x00\x00\x01\x00\x00\x00\x01\n\x00\x00\x00\x00"),
            Err(RecordBytesError::InvalidHeader)
        );
        assert_eq!(
            refused(b"\x01\x00\xc8\x00\x00\x00\x00\x00x"),
            Err(RecordBytesError::TrailingBytes)
        );
        assert_eq!(
            refused(b"\x01\x00\xc8\x00\xff\xff\xff\xff"),
            Err(RecordBytesError::Truncated)
        );
    }
}
