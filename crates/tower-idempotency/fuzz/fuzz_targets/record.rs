//! Arbitrary bytes as a stored record, and arbitrary records through their bytes.
//!
//! * `Record::from_bytes` never panics, whatever the bytes: it reads a record or says why not;
//! * a record it read writes back (`to_bytes`) as bytes that read the same record;
//! * a record built from arbitrary parts reads back from its bytes as itself.
#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::Record;

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    bytes: &'a [u8],
    status: u16,
    headers: Vec<(&'a [u8], &'a [u8])>,
    body: Option<&'a [u8]>,
}

fuzz_target!(|input: Input<'_>| {
    if let Ok(record) = Record::from_bytes(bytes::Bytes::copy_from_slice(input.bytes)) {
        let again = Record::from_bytes(record.to_bytes()).expect("a record's own bytes read back");
        assert_eq!(again, record);
    }

    let Ok(status) = StatusCode::from_u16(input.status) else {
        return;
    };
    let mut headers = HeaderMap::new();
    for (name, value) in input.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            headers.append(name, value);
        }
    }
    let body = input.body.map(bytes::Bytes::copy_from_slice);
    let record = Record::from_parts(status, headers, body);
    let read = Record::from_bytes(record.to_bytes()).expect("a record's own bytes read back");
    let order = |r: &Record| r.headers().iter().map(|(n, v)| (n.clone(), v.clone())).collect::<Vec<_>>();
    assert_eq!(order(&read), order(&record));
    assert_eq!(read, record);
});
