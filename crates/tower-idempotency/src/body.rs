//! The body types the layer hands on: [`RequestBody`] to the inner service, [`ResponseBody`] to
//! the client, and the bounded buffering both directions need.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The request body the inner service receives: the buffered bytes of a claimed request, or
    /// the untouched body of a request the layer does not cover.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    #[derive(Debug)]
    enum RequestKind<B> {
        Buffered { data: Option<Bytes> },
        Passthrough { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn buffered(data: Bytes) -> Self {
        Self {
            kind: RequestKind::Buffered {
                data: non_empty(data),
            },
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: RequestKind::Passthrough { body },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Buffered { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
            RequestKindProj::Passthrough { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered { data } => data.is_none(),
            RequestKind::Passthrough { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered { data } => SizeHint::with_exact(len(data.as_ref())),
            RequestKind::Passthrough { body } => body.size_hint(),
        }
    }
}

pin_project! {
    /// The response body the client receives: the handler's own, a buffered copy of it, a
    /// replay, or a problem document.
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    #[derive(Debug)]
    enum ResponseKind<B> {
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        // What was read while trying to store the body, then the rest of the handler's stream.
        Prefixed { prefix: Option<Bytes>, rest: Pin<Box<B>> },
        // What was read before the handler's body failed, then the failure.
        Failed { prefix: Option<Bytes>, error: Option<BoxError> },
        Passthrough { #[pin] body: B },
    }
}

impl<B> ResponseBody<B> {
    /// A whole body, and the trailers that ended it.
    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: ResponseKind::Full {
                data: non_empty(data),
                trailers,
            },
        }
    }

    pub(crate) fn prefixed(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: ResponseKind::Prefixed {
                prefix: non_empty(prefix),
                rest,
            },
        }
    }

    pub(crate) fn failed(prefix: Bytes, error: BoxError) -> Self {
        Self {
            kind: ResponseKind::Failed {
                prefix: non_empty(prefix),
                error: Some(error),
            },
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: ResponseKind::Passthrough { body },
        }
    }
}

impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        Self::full(data, None)
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            ResponseKindProj::Full { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            ResponseKindProj::Prefixed { prefix, rest } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => rest.as_mut().poll_frame(cx).map_err(Into::into),
            },
            ResponseKindProj::Failed { prefix, error } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => Poll::Ready(error.take().map(Err)),
            },
            ResponseKindProj::Passthrough { body } => body.poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResponseKind::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            ResponseKind::Failed { prefix, error } => prefix.is_none() && error.is_none(),
            ResponseKind::Passthrough { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Full { data, .. } => SizeHint::with_exact(len(data.as_ref())),
            ResponseKind::Prefixed { prefix, rest } => {
                let extra = len(prefix.as_ref());
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            ResponseKind::Failed { prefix, .. } => {
                let mut hint = SizeHint::new();
                hint.set_lower(len(prefix.as_ref()));
                hint
            }
            ResponseKind::Passthrough { body } => body.size_hint(),
        }
    }
}

fn non_empty(data: Bytes) -> Option<Bytes> {
    (!data.is_empty()).then_some(data)
}

fn len(data: Option<&Bytes>) -> u64 {
    data.map_or(0, |d| d.len() as u64)
}

/// How reading a body up to a limit ended.
#[derive(Debug)]
pub(crate) enum Buffered<B> {
    /// The whole body, within the limit, and its trailers if it had any.
    Complete(Bytes, Option<HeaderMap>),
    /// The body is longer than the limit: what was read, and the unread rest.
    TooLarge { prefix: Bytes, rest: B },
    /// The body failed after `prefix` was read.
    Failed { prefix: Bytes, error: BoxError },
}

/// Reads `body` into one contiguous buffer of at most `limit` bytes. A single-frame body is
/// taken without copying; otherwise the buffer is sized from the size hint, so a body is held
/// in memory at most once. A body that is not `Unpin` is passed pinned (`Pin<&mut B>` if the
/// rest is not needed, `Pin<Box<B>>` if it is).
pub(crate) async fn buffer<B>(mut body: B, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let hint = body.size_hint();
    if hint.lower() > limit as u64 {
        return Buffered::TooLarge {
            prefix: Bytes::new(),
            rest: body,
        };
    }
    let capacity = hint.upper().unwrap_or(hint.lower()).min(limit as u64) as usize;
    let mut buffer = Joined::default();
    let mut trailers = None::<HeaderMap>;
    while let Some(frame) = body.frame().await {
        let data = match frame.map(Frame::into_data) {
            Ok(Ok(data)) => data,
            Ok(Err(frame)) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
                continue;
            }
            Err(error) => {
                return Buffered::Failed {
                    prefix: buffer.freeze(),
                    error: error.into(),
                };
            }
        };
        let over = buffer.len() + data.len() > limit;
        buffer.push(data, capacity);
        if over {
            return Buffered::TooLarge {
                prefix: buffer.freeze(),
                rest: body,
            };
        }
    }
    Buffered::Complete(buffer.freeze(), trailers)
}

/// Frames joined into one buffer, copying only from the second frame on.
#[derive(Default)]
struct Joined {
    first: Option<Bytes>,
    rest: BytesMut,
}

impl Joined {
    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.rest.len()
    }

    fn push(&mut self, data: Bytes, capacity: usize) {
        if self.first.is_none() && self.rest.is_empty() {
            self.first = Some(data);
            return;
        }
        if let Some(first) = self.first.take() {
            self.rest.reserve(capacity.max(first.len() + data.len()));
            self.rest.extend_from_slice(&first);
        }
        self.rest.extend_from_slice(&data);
    }

    fn freeze(self) -> Bytes {
        self.first.unwrap_or_else(|| self.rest.freeze())
    }
}

#[cfg(test)]
mod tests {
    use std::{convert::Infallible, fmt};

    use http_body_util::{Full, StreamBody};

    use super::*;

    fn chunks(
        parts: &[&'static str],
    ) -> impl Body<Data = Bytes, Error = Infallible> + fmt::Debug + use<> {
        let frames: Vec<_> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn single_frame_is_taken_whole() {
        let data = Bytes::from_static(b"hello");
        match buffer(Box::pin(Full::new(data.clone())), 5).await {
            Buffered::Complete(got, None) => assert_eq!(got.as_ptr(), data.as_ptr()),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn frames_are_joined_within_the_limit() {
        match buffer(Box::pin(chunks(&["ab", "cd", "e"])), 5).await {
            Buffered::Complete(got, None) => assert_eq!(got, "abcde"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn over_the_limit_keeps_what_was_read_and_the_rest() {
        match buffer(Box::pin(chunks(&["ab", "cd", "ef", "gh"])), 5).await {
            Buffered::TooLarge { prefix, rest } => {
                assert_eq!(prefix, "abcdef");
                let rest = rest.collect().await.unwrap().to_bytes();
                assert_eq!(rest, "gh");
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn declared_length_over_the_limit_reads_nothing() {
        match buffer(Box::pin(Full::new(Bytes::from_static(b"123456"))), 5).await {
            Buffered::TooLarge { prefix, .. } => assert!(prefix.is_empty()),
            other => panic!("{other:?}"),
        }
    }

    /// Issue 28.10: trailers reach the client (gRPC's status is one).
    #[tokio::test]
    async fn trailers_are_kept_and_delivered() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let frames = vec![
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"ab"))),
            Ok(Frame::trailers(trailers.clone())),
        ];
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let Buffered::Complete(data, Some(kept)) = buffer(Box::pin(body), 64).await else {
            panic!("trailers dropped");
        };
        assert_eq!(kept, trailers);
        let delivered = ResponseBody::<Full<Bytes>>::full(data, Some(kept))
            .collect()
            .await
            .unwrap();
        assert_eq!(delivered.trailers(), Some(&trailers));
        assert_eq!(delivered.to_bytes(), "ab");
    }

    #[tokio::test]
    async fn prefixed_response_body_replays_prefix_then_rest() {
        let body: ResponseBody<_> =
            ResponseBody::prefixed(Bytes::from_static(b"abc"), Box::pin(chunks(&["de", "f"])));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abcdef");
    }
}
