//! The response future of [`Idempotency`](crate::Idempotency).

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU8, AtomicUsize, Ordering},
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
    /// would copy it); with `detach`, finished in a task of its own if this response future is
    /// dropped first (see [`Disconnect`](crate::Disconnect)), as its [`HangUp`] says.
    pub(crate) fn keyed<Fut>(future: Pin<Box<Fut>>, detach: Option<Detach>) -> Self
    where
        Fut: Future<Output = Served<B, E>> + Send + 'static,
        B: Send + 'static,
        E: Send + 'static,
    {
        Self {
            kind: Kind::Keyed {
                keyed: Detachable {
                    future: Some(future),
                    detach: detach.map(|detach| (finish_detached::<B, E> as Spawn<B, E>, detach)),
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
    detach: Option<(Spawn<B, E>, Detach)>,
}

type Spawn<B, E> = fn(BoxFuture<B, E>, Option<Arc<Detached>>);

/// What a keyed request's response future needs to finish it for a client that hung up: the
/// layer's count of such requests and, for a request that may wait, where it stands.
pub(crate) struct Detach {
    pub(crate) detached: Arc<Detached>,
    pub(crate) hang_up: Option<Arc<HangUp>>,
}

/// What a hang-up means where a keyed request stands, moved along by the request and read by
/// its response future when dropped. A duplicate waiting for a key in flight holds no handler
/// and no claim: its client gone, it stops, claiming nothing (the client retries).
#[derive(Debug, Default)]
pub(crate) struct HangUp(AtomicU8);

/// Finished in the background and counted against the layer's limit: it may hold a claim.
const FINISH: u8 = 0;
/// A duplicate between reads of its key: it holds nothing, so it is dropped.
const STOP: u8 = 1;
/// A duplicate reading its key: the read is finished uncounted, and then it stops.
const READING: u8 = 2;
/// Its client left during a read.
const LEFT: u8 = 3;

impl HangUp {
    /// The request may hold a claim from here on.
    pub(crate) fn working(&self) {
        self.0.store(FINISH, Ordering::Release);
    }

    /// The request waits between reads, holding nothing.
    pub(crate) fn waiting(&self) {
        self.0.store(STOP, Ordering::Release);
    }

    /// The request reads its key: a read may claim it, so it is not cut short.
    pub(crate) fn reading(&self) {
        self.0.store(READING, Ordering::Release);
    }

    /// Whether the client left while the request read its key.
    pub(crate) fn client_left(&self) -> bool {
        self.0.load(Ordering::Acquire) == LEFT
    }

    /// Called as the response future is dropped unfinished: what the request is to become.
    fn on_hang_up(&self) -> u8 {
        let stage = self.0.load(Ordering::Acquire);
        if stage == READING {
            self.0.store(LEFT, Ordering::Release);
        }
        stage
    }
}

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
        let (Some(future), Some((spawn, detach))) = (self.future.take(), self.detach.take()) else {
            return;
        };
        // The request is not running while its response future is dropped: its stage holds.
        match detach
            .hang_up
            .map_or(FINISH, |hang_up| hang_up.on_hang_up())
        {
            STOP => crate::metrics::waited("hung_up"),
            READING => spawn(future, None),
            _ => spawn(future, Some(detach.detached)),
        }
    }
}

/// Runs an abandoned keyed request to completion in a task of its own, counted in `detached`
/// unless it holds nothing but a read.
fn finish_detached<B: Send + 'static, E: Send + 'static>(
    future: BoxFuture<B, E>,
    detached: Option<Arc<Detached>>,
) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            tracing::debug!("client went away; finishing the request in the background");
            let counted = detached.map(Counted::new);
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
