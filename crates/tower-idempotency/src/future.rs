//! The response future of [`Idempotency`](crate::Idempotency).

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use http::Response;
use pin_project_lite::pin_project;

use crate::{body::ResponseBody, problem::Rejection};

/// What the layer's response future yields: the response, or the inner service's error.
pub(crate) type Served<B, E> = Result<Response<ResponseBody<B>>, E>;

/// A keyed request's future.
type BoxFuture<B, E> = Pin<Box<dyn Future<Output = Served<B, E>> + Send>>;

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
        Rejected { response: Option<Response<ResponseBody<B>>> },
        Keyed { keyed: Detachable<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    /// A refusal, rendered already (see [`Rejection`]).
    pub(crate) fn rejected(response: Response<ResponseBody<B>>) -> Self {
        if let Some(rejection) = response.extensions().get::<Rejection>() {
            crate::metrics::rejected(rejection.kind());
        }
        Self {
            kind: Kind::Rejected {
                response: Some(response),
            },
        }
    }

    /// A keyed request's future, boxed where it was made (moving the large state machine
    /// would copy it); with `detach`, finished in a task of its own, counted there, if this
    /// response future is dropped first (see [`Disconnect`](crate::Disconnect)).
    pub(crate) fn keyed<Fut>(future: Pin<Box<Fut>>, detach: Option<Arc<Detached>>) -> Self
    where
        Fut: Future<Output = Served<B, E>> + Send + 'static,
        B: Send + 'static,
        E: Send + 'static,
    {
        Self {
            kind: Kind::Keyed {
                keyed: Detachable {
                    future: Some(future),
                    detach: detach.map(|count| (finish_detached::<B, E> as Spawn<B, E>, count)),
                },
            },
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
            KindProj::Rejected { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            KindProj::Keyed { keyed } => keyed.poll(cx),
        }
    }
}

/// A keyed request's future, which outlives the response future if it must.
///
/// Rather than spawning every keyed request, the request runs inside the response future, and
/// only when that is dropped unfinished (hyper drops it when the client disconnects) is the
/// already-boxed future moved, as it stands, into a task that runs it to completion.
struct Detachable<B, E> {
    future: Option<BoxFuture<B, E>>,
    /// Spawns the unfinished future; made where `B` and `E` are known to be `Send`, which
    /// spawning needs and the response future's own bounds do not promise.
    detach: Option<(Spawn<B, E>, Arc<Detached>)>,
}

type Spawn<B, E> = fn(BoxFuture<B, E>, Arc<Detached>);

/// How many keyed requests are running for clients that hung up: shared by a layer's services.
#[derive(Debug, Default)]
pub(crate) struct Detached(AtomicUsize);

impl Detached {
    pub(crate) fn count(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// One detached request, counted until it ends (a panic included).
struct Counted(Arc<Detached>);

impl Counted {
    fn new(detached: Arc<Detached>) -> Self {
        detached.0.fetch_add(1, Ordering::Relaxed);
        Self(detached)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<B, E> Detachable<B, E> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Served<B, E>> {
        let future = self.future.as_mut().expect("polled after completion");
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<B, E> Drop for Detachable<B, E> {
    fn drop(&mut self) {
        if let (Some(future), Some((spawn, count))) = (self.future.take(), self.detach.take()) {
            spawn(future, count);
        }
    }
}

/// Runs an abandoned keyed request to completion in a task of its own.
fn finish_detached<B: Send + 'static, E: Send + 'static>(
    future: BoxFuture<B, E>,
    detached: Arc<Detached>,
) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            tracing::debug!("client went away; finishing the request in the background");
            let counted = Counted::new(detached);
            runtime.spawn(async move {
                let _counted = counted;
                // Its answer has no one to go to; what matters is that it completes.
                let _ = future.await;
            });
        }
        Err(_) => tracing::warn!(
            "an idempotent request was dropped outside a Tokio runtime and cannot finish"
        ),
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
