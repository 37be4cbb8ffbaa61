//! The Tower side's response future: see [`ResponseFuture`].

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::Response;

use crate::error::Error;

type Boxed<R> = Pin<Box<dyn Future<Output = Result<Response<R>, Error>> + Send>>;

/// The answer of an [`Idempotent`](crate::Idempotent) service: its attempts and waits, boxed
/// inside so that they may change without changing this type.
pub struct ResponseFuture<R> {
    inner: Boxed<R>,
}

impl<R> ResponseFuture<R> {
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<R>, Error>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(future),
        }
    }
}

impl<R> Future for ResponseFuture<R> {
    type Output = Result<Response<R>, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<R> fmt::Debug for ResponseFuture<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
