//! Which request bodies the Tower layer may send again: see [`ReplayBody`].

use bytes::Bytes;
use http_body_util::{
    Either, Empty, Full, StreamBody,
    combinators::{BoxBody, UnsyncBoxBody},
};

/// A request body the [`IdempotentLayer`](crate::IdempotentLayer) may send again: a buffered
/// body gives a copy, a stream does not and is sent once ([`StopReason::StreamingBody`]).
///
/// [`StopReason::StreamingBody`]: crate::StopReason::StreamingBody
pub trait ReplayBody: Sized {
    /// A copy to send again; `None` for a body that cannot be read twice.
    fn try_replay(&self) -> Option<Self>;
}

impl<D: Clone> ReplayBody for Full<D> {
    fn try_replay(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl<D> ReplayBody for Empty<D> {
    fn try_replay(&self) -> Option<Self> {
        Some(Self::new())
    }
}

impl ReplayBody for Bytes {
    fn try_replay(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl ReplayBody for String {
    fn try_replay(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl ReplayBody for Vec<u8> {
    fn try_replay(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl<L: ReplayBody, R: ReplayBody> ReplayBody for Either<L, R> {
    fn try_replay(&self) -> Option<Self> {
        match self {
            Self::Left(left) => left.try_replay().map(Self::Left),
            Self::Right(right) => right.try_replay().map(Self::Right),
        }
    }
}

/// A boxed body may be a stream: it is sent once.
impl<D, E> ReplayBody for BoxBody<D, E> {
    fn try_replay(&self) -> Option<Self> {
        None
    }
}

/// A boxed body may be a stream: it is sent once.
impl<D, E> ReplayBody for UnsyncBoxBody<D, E> {
    fn try_replay(&self) -> Option<Self> {
        None
    }
}

/// A stream: sent once.
impl<S> ReplayBody for StreamBody<S> {
    fn try_replay(&self) -> Option<Self> {
        None
    }
}
