//! A completed record as the store keeps it: one allocation for status, headers and body.

use bytes::Bytes;

use crate::record::Record;

/// A completed record as the store keeps it: its [`Record::to_bytes`] form, one allocation, so
/// that the hundreds of thousands of records a busy store holds for their TTL are one block
/// each rather than the response's four (record, header table and entries, body), scattered
/// among every request's short-lived allocations. Unpacked into a [`Record`] on replay, whose
/// body is a slice of the same buffer.
#[derive(Debug, Clone)]
pub(super) struct Packed {
    pub(super) bytes: Bytes,
}

impl Packed {
    pub(super) fn pack(record: &Record) -> Self {
        Self {
            bytes: record.to_bytes(),
        }
    }

    pub(super) fn unpack(&self) -> Record {
        // The store wrote these bytes itself, from a valid record.
        Record::from_bytes(self.bytes.clone()).expect("a record the store packed reads back")
    }
}
