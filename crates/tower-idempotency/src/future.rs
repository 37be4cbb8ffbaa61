//! The response future of [`Idempotency`](crate::Idempotency).

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::Response;
use pin_project_lite::pin_project;

use crate::{body::ResponseBody, problem::Rejection};

type BoxFuture<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project! {
    /// Response future of [`Idempotency`](crate::Idempotency).
    ///
    /// Requests the layer does not cover are the inner service's future, unboxed; refusals are
    /// ready at once; keyed requests run through the store in a boxed future.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Rejected { rejection: Option<Rejection> },
        Keyed { future: BoxFuture<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(crate) fn rejected(rejection: Rejection) -> Self {
        crate::metrics::rejected(rejection.kind());
        Self {
            kind: Kind::Rejected {
                rejection: Some(rejection),
            },
        }
    }

    pub(crate) fn boxed(future: BoxFuture<B, E>) -> Self {
        Self {
            kind: Kind::Keyed { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future
                .poll(cx)
                .map(|result| result.map(|response| response.map(ResponseBody::passthrough))),
            KindProj::Rejected { rejection } => {
                let rejection = rejection.take().expect("polled after completion");
                Poll::Ready(Ok(rejection.into_response()))
            }
            KindProj::Keyed { future } => future.as_mut().poll(cx),
        }
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Rejected { .. } => "rejected",
            Kind::Keyed { .. } => "keyed",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}
