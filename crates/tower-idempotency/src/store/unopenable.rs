//! A stored record the store cannot vouch for: see [`RecordUnopenable`].

use std::{error::Error as StdError, fmt};

/// Why a store could not open a record it holds, found in the source chain of the store's error.
///
/// The layer looks for it in every claim error before its [store-failure
/// policy](crate::StoreFailure): a record that is there but cannot be opened is answered `500`
/// ([`RejectionKind::RecordUnopenable`](crate::RejectionKind::RecordUnopenable)), never replayed
/// and never run again, even when the layer fails open. [`SealingStore`](super::SealingStore)
/// returns it; a third-party store that seals or signs its records returns it the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordUnopenable {
    /// The record is not an envelope this version of the crate reads: it was stored before
    /// sealing was turned on, or by a newer format.
    NotSealed,
    /// The record was sealed under a key id the store was not given.
    UnknownKey(u32),
    /// The record did not authenticate: its bytes were changed, it was moved under another
    /// scope key, or the key given for its key id is not the one that sealed it.
    Inauthentic,
    /// The record authenticated but does not hold a record, or its clear status disagrees.
    Malformed,
}

impl RecordUnopenable {
    /// The first `RecordUnopenable` in `error`'s source chain, `error` included.
    pub(crate) fn find<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a Self> {
        let mut current = Some(error);
        while let Some(error) = current {
            if let Some(found) = error.downcast_ref::<Self>() {
                return Some(found);
            }
            current = error.source();
        }
        None
    }
}

impl fmt::Display for RecordUnopenable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotSealed => f.write_str("the stored record is not sealed"),
            Self::UnknownKey(id) => write!(f, "the stored record is sealed under unknown key {id}"),
            Self::Inauthentic => f.write_str("the stored record failed authentication"),
            Self::Malformed => f.write_str("the stored record opened to something else"),
        }
    }
}

impl StdError for RecordUnopenable {}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(RecordUnopenable);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("outer")
        }
    }

    impl StdError for Outer {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn is_found_anywhere_in_the_chain() {
        let outer = Outer(RecordUnopenable::UnknownKey(7));
        assert_eq!(
            RecordUnopenable::find(&outer),
            Some(&RecordUnopenable::UnknownKey(7))
        );
        assert_eq!(
            RecordUnopenable::find(&RecordUnopenable::NotSealed),
            Some(&RecordUnopenable::NotSealed)
        );
        assert_eq!(RecordUnopenable::find(&std::fmt::Error), None);
    }
}
