//! A store wrapper that tells the test what the layer did, and can be switched off.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::sync::Semaphore;
use tower_idempotency::{
    Record,
    store::{Capabilities, ClaimRequest, ClaimStatus, KeyState, Store},
};

/// Wraps a store: counts settled claims, signals them, and fails every call while [`down`].
///
/// [`down`]: ObservedStore::set_down
pub struct ObservedStore<St> {
    inner: St,
    shared: Arc<Shared>,
}

struct Shared {
    down: AtomicBool,
    /// The first call to `claim` that fails (counting from 1); `usize::MAX`: none.
    failing_begin: AtomicUsize,
    completions: Gate,
    begins_gate: Gate,
    begins: AtomicUsize,
    /// Calls to `claim` by waiting duplicates ([`ClaimRequest::waiting`]).
    waiting_begins: AtomicUsize,
    /// First reads (not a waiter's) that found their key in flight.
    found_in_flight: Semaphore,
    begun: Semaphore,
    settled: Semaphore,
    completed: AtomicUsize,
    released: AtomicUsize,
    lost: AtomicUsize,
}

impl<St: Clone> Clone for ObservedStore<St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<St> ObservedStore<St> {
    /// Wraps `inner`.
    pub fn new(inner: St) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared {
                down: AtomicBool::new(false),
                failing_begin: AtomicUsize::new(usize::MAX),
                completions: Gate::default(),
                begins_gate: Gate::default(),
                begins: AtomicUsize::new(0),
                waiting_begins: AtomicUsize::new(0),
                found_in_flight: Semaphore::new(0),
                begun: Semaphore::new(0),
                settled: Semaphore::new(0),
                completed: AtomicUsize::new(0),
                released: AtomicUsize::new(0),
                lost: AtomicUsize::new(0),
            }),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// Makes every call fail (`true`) or pass through again (`false`).
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
    }

    /// Makes the `n`th call to `claim` (counting from 1) and every later one fail.
    pub fn fail_begins_from(&self, n: usize) {
        self.shared.failing_begin.store(n, Ordering::SeqCst);
    }

    /// Holds every completion until [`let_completions_go`](Self::let_completions_go): a store
    /// whose completion takes as long as the test says.
    pub fn hold_completions(&self) {
        self.shared.completions.hold();
    }

    /// Waits until `n` more completions are held.
    pub async fn completing(&self, n: u32) {
        waited(&self.shared.completions.reached, n, "completions held").await;
    }

    /// Lets the held completions (and every later one) through.
    pub fn let_completions_go(&self) {
        self.shared.completions.open();
    }

    /// Holds every call to `claim` until [`let_begins_go`](Self::let_begins_go).
    pub fn hold_begins(&self) {
        self.shared.begins_gate.hold();
    }

    /// Waits until `n` more calls to `claim` are held.
    pub async fn beginning(&self, n: u32) {
        waited(&self.shared.begins_gate.reached, n, "begins held").await;
    }

    /// Lets the held calls to `claim` (and every later one) through.
    pub fn let_begins_go(&self) {
        self.shared.begins_gate.open();
    }

    /// Waits until `n` more claims were completed or released (held or lost).
    pub async fn settled(&self, n: u32) {
        waited(&self.shared.settled, n, "claims settled").await;
    }

    /// Waits until `n` more calls to `claim` have been answered by the store.
    pub async fn begun(&self, n: u32) {
        waited(&self.shared.begun, n, "begins answered").await;
    }

    /// Waits until `n` more first reads (not a waiter's re-read) found their key in flight: that
    /// many duplicates wait, with waiting on.
    pub async fn found_in_flight(&self, n: u32) {
        waited(
            &self.shared.found_in_flight,
            n,
            "first reads found their keys in flight",
        )
        .await;
    }

    /// Calls to `claim` by waiting duplicates.
    pub fn waiting_begins(&self) -> usize {
        self.shared.waiting_begins.load(Ordering::SeqCst)
    }

    /// Calls to `claim` that reached the store.
    pub fn begins(&self) -> usize {
        self.shared.begins.load(Ordering::SeqCst)
    }

    /// Completions that were stored.
    pub fn completed(&self) -> usize {
        self.shared.completed.load(Ordering::SeqCst)
    }

    /// Releases that freed a key.
    pub fn released(&self) -> usize {
        self.shared.released.load(Ordering::SeqCst)
    }

    /// Completions or releases refused because the claim had been taken over.
    pub fn lost(&self) -> usize {
        self.shared.lost.load(Ordering::SeqCst)
    }

    fn check(&self) -> Result<(), StoreDown> {
        if self.shared.down.load(Ordering::SeqCst) {
            Err(StoreDown)
        } else {
            Ok(())
        }
    }

    fn settle(&self, status: ClaimStatus, counter: &AtomicUsize) -> ClaimStatus {
        match status {
            ClaimStatus::Held => counter.fetch_add(1, Ordering::SeqCst),
            _ => self.shared.lost.fetch_add(1, Ordering::SeqCst),
        };
        self.shared.settled.add_permits(1);
        status
    }
}

/// Holds the calls that reach it while it is held, and tells the test how many have.
struct Gate {
    holding: AtomicBool,
    open: Semaphore,
    reached: Semaphore,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            holding: AtomicBool::new(false),
            open: Semaphore::new(0),
            reached: Semaphore::new(0),
        }
    }
}

impl Gate {
    fn hold(&self) {
        self.holding.store(true, Ordering::SeqCst);
    }

    /// Lets the held calls (and every later one) through.
    fn open(&self) {
        self.holding.store(false, Ordering::SeqCst);
        self.open.add_permits(Semaphore::MAX_PERMITS / 2);
    }

    /// Waits here while the gate is held.
    async fn pass(&self) {
        if self.holding.load(Ordering::SeqCst) {
            self.reached.add_permits(1);
            let _ = self.open.acquire().await;
        }
    }
}

/// Waits for `n` permits of `signal` (then spent), at most 30 s.
async fn waited(signal: &Semaphore, n: u32, what: &str) {
    tokio::time::timeout(Duration::from_secs(30), signal.acquire_many(n))
        .await
        .unwrap_or_else(|_| panic!("{what} within 30 s"))
        .expect("open")
        .forget();
}

/// The error of a store that is switched off, or of the store it wraps.
#[derive(Debug)]
pub enum ObservedError<E> {
    /// [`ObservedStore::set_down`] is on.
    Down(StoreDown),
    /// The wrapped store failed.
    Inner(E),
}

/// The store is switched off.
#[derive(Debug)]
pub struct StoreDown;

impl fmt::Display for StoreDown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("test store is switched off")
    }
}

impl std::error::Error for StoreDown {}

impl<E: fmt::Display> fmt::Display for ObservedError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Down(down) => down.fmt(f),
            Self::Inner(error) => error.fmt(f),
        }
    }
}

/// Transparent: the wrapped store's error displays as itself and keeps its own sources.
impl<E: std::error::Error + 'static> std::error::Error for ObservedError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Down(_) => None,
            Self::Inner(error) => error.source(),
        }
    }
}

impl<St: Store> Store for ObservedStore<St> {
    type Claim = St::Claim;
    type Error = ObservedError<St::Error>;

    async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<St::Claim>, Self::Error> {
        let n = self.shared.begins.fetch_add(1, Ordering::SeqCst) + 1;
        self.check().map_err(ObservedError::Down)?;
        self.shared.begins_gate.pass().await;
        if n >= self.shared.failing_begin.load(Ordering::SeqCst) {
            self.shared.begun.add_permits(1);
            return Err(ObservedError::Down(StoreDown));
        }
        if request.waiting {
            self.shared.waiting_begins.fetch_add(1, Ordering::SeqCst);
        }
        let begun = self.inner.claim(request).await;
        if !request.waiting && matches!(begun, Ok(KeyState::InFlight { .. })) {
            self.shared.found_in_flight.add_permits(1);
        }
        self.shared.begun.add_permits(1);
        begun.map_err(ObservedError::Inner)
    }

    async fn renew(&self, claim: &St::Claim, lease: Duration) -> Result<ClaimStatus, Self::Error> {
        self.check().map_err(ObservedError::Down)?;
        self.inner
            .renew(claim, lease)
            .await
            .map_err(ObservedError::Inner)
    }

    async fn complete(
        &self,
        claim: &St::Claim,
        record: &Record,
    ) -> Result<ClaimStatus, Self::Error> {
        self.check().map_err(ObservedError::Down)?;
        self.shared.completions.pass().await;
        let status = self
            .inner
            .complete(claim, record)
            .await
            .map_err(ObservedError::Inner)?;
        Ok(self.settle(status, &self.shared.completed))
    }

    async fn release(&self, claim: &St::Claim) -> Result<ClaimStatus, Self::Error> {
        self.check().map_err(ObservedError::Down)?;
        let status = self
            .inner
            .release(claim)
            .await
            .map_err(ObservedError::Inner)?;
        Ok(self.settle(status, &self.shared.released))
    }

    async fn abandon(&self, claim: &St::Claim) -> Result<ClaimStatus, Self::Error> {
        self.check().map_err(ObservedError::Down)?;
        self.inner
            .abandon(claim)
            .await
            .map_err(ObservedError::Inner)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}
