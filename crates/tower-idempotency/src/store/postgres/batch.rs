//! Group commit for store operations: concurrent requests' operations of one kind are sent
//! to the database together, as one statement in one transaction.
//!
//! A request's operation waits in a queue only while an earlier batch is being written; the
//! first operation to find no batch under way starts a flusher task, which writes whatever has
//! queued up, batch after batch, until the queue is empty. Nothing waits for a batch to fill,
//! so a lone request goes out at once, and under load the cost of a round trip and a commit is
//! shared by every request that arrived during the previous one.
//!
//! The flusher carries a state of the caller's choosing from one batch to the next (the
//! PostgreSQL store keeps its connection there, so back-to-back batches skip the pool); the
//! state is dropped when the queue is empty and the flusher stops.
//!
//! The flusher is a task of its own, so a request dropped while it waits (its client hung up
//! and the app chose to cancel) takes no one else's operation with it. If the flusher itself
//! is torn down (its runtime shut down), every operation it held or that was waiting gets no
//! answer, and its caller falls back to doing its operation alone.

use std::{
    future::Future,
    mem,
    sync::{Arc, Mutex, MutexGuard},
};

use tokio::sync::oneshot;

/// Operations of type `T` waiting to be written in batches; each gets an `R` back.
#[derive(Debug)]
pub(crate) struct Batcher<T, R> {
    queue: Mutex<Queue<T, R>>,
    max_batch: usize,
    skip_abandoned: bool,
}

#[derive(Debug)]
struct Queue<T, R> {
    waiting: Vec<(T, oneshot::Sender<R>)>,
    flushing: bool,
}

impl<T: Send + 'static, R: Send + 'static> Batcher<T, R> {
    /// A batcher writing at most `max_batch` operations per batch.
    pub(crate) fn new(max_batch: usize) -> Self {
        Self {
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                flushing: false,
            }),
            max_batch: max_batch.max(1),
            skip_abandoned: false,
        }
    }

    /// Leaves out of its batch an operation whose caller stopped waiting before the batch was
    /// written (for operations no one follows up, such as claims).
    pub(crate) fn skipping_abandoned(mut self) -> Self {
        self.skip_abandoned = true;
        self
    }

    /// Queues `operation` and waits for its batch to be written by `flush`, which gets the
    /// batch's operations in the order they queued and returns one result for each, in the
    /// same order. `flush` also gets the state the previous batch of the same flusher left
    /// (`S::default()` for its first) and hands it on. `None` when the flusher was torn down
    /// before answering. A result whose caller stopped waiting goes to `unanswered` (to undo
    /// what no one will follow up).
    pub(crate) async fn run<F, Fut, U, S>(
        self: &Arc<Self>,
        operation: T,
        flush: F,
        unanswered: U,
    ) -> Option<R>
    where
        F: Fn(S, Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = (S, Vec<R>)> + Send + 'static,
        U: Fn(R) + Send + 'static,
        S: Default + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let start = {
            let mut queue = self.queue();
            queue.waiting.push((operation, answer));
            !mem::replace(&mut queue.flushing, true)
        };
        if start {
            tokio::spawn(Arc::clone(self).flush_all(flush, unanswered));
        }
        answered.await.ok()
    }

    /// Writes batches until the queue is empty.
    async fn flush_all<F, Fut, U, S>(self: Arc<Self>, flush: F, unanswered: U)
    where
        F: Fn(S, Vec<T>) -> Fut,
        Fut: Future<Output = (S, Vec<R>)>,
        U: Fn(R),
        S: Default,
    {
        let _stopped = Stopped(&self);
        let mut state = S::default();
        loop {
            let batch: Vec<_> = {
                let mut queue = self.queue();
                if queue.waiting.is_empty() {
                    queue.flushing = false;
                    return;
                }
                let take = queue.waiting.len().min(self.max_batch);
                let skip = self.skip_abandoned;
                queue
                    .waiting
                    .drain(..take)
                    .filter(|(_, answer)| !(skip && answer.is_closed()))
                    .collect()
            };
            if batch.is_empty() {
                continue;
            }
            let (operations, answers): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
            let results;
            (state, results) = flush(state, operations).await;
            debug_assert_eq!(results.len(), answers.len(), "one result per operation");
            for (answer, result) in answers.into_iter().zip(results) {
                if let Err(result) = answer.send(result) {
                    unanswered(result);
                }
            }
        }
    }
}

impl<T, R> Batcher<T, R> {
    fn queue(&self) -> MutexGuard<'_, Queue<T, R>> {
        // No critical section can panic half-way, so a poisoned lock still guards a sound queue.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Leaves the queue ready for the next flusher however the current one ends. A flusher torn
/// down mid-way drops the waiting operations' answers, so their callers fall back at once
/// instead of waiting for a flusher that may never come.
struct Stopped<'a, T, R>(&'a Batcher<T, R>);

impl<T, R> Drop for Stopped<'_, T, R> {
    fn drop(&mut self) {
        let waiting = {
            let mut queue = self.0.queue();
            if !queue.flushing {
                return;
            }
            queue.flushing = false;
            mem::take(&mut queue.waiting)
        };
        drop(waiting);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::task::JoinHandle;

    use super::*;

    /// How many operations wait, and whether a flusher runs.
    fn state<T, R>(batcher: &Batcher<T, R>) -> (usize, bool) {
        let queue = batcher.queue();
        (queue.waiting.len(), queue.flushing)
    }

    /// Yields until the flusher has taken every queued operation into its batch.
    async fn until_taken<T, R>(batcher: &Batcher<T, R>) {
        while state(batcher) != (0, true) {
            tokio::task::yield_now().await;
        }
    }

    /// Runs operation 0, waits until the flusher has taken it into its first batch (which
    /// `flush` must hold until the test releases it), then queues operations `1..=rest`
    /// behind it and waits until all of them have queued. Returns the tasks awaiting the first
    /// operation's answer and, in order, the others'.
    async fn queued_behind_first<R, F, Fut, S>(
        batcher: &Arc<Batcher<u32, R>>,
        flush: F,
        rest: u32,
    ) -> (JoinHandle<Option<R>>, JoinHandle<Vec<Option<R>>>)
    where
        R: Send + 'static,
        F: Fn(S, Vec<u32>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = (S, Vec<R>)> + Send + 'static,
        S: Default + Send + 'static,
    {
        let run = |n: u32| {
            let (batcher, flush) = (Arc::clone(batcher), flush.clone());
            async move { batcher.run(n, flush, drop).await }
        };
        let first = tokio::spawn(run(0));
        until_taken(batcher).await;
        let others = tokio::spawn(futures_util::future::join_all((1..=rest).map(run)));
        while state(batcher).0 < rest as usize {
            tokio::task::yield_now().await;
        }
        (first, others)
    }

    #[tokio::test]
    async fn a_lone_operation_is_written_at_once() {
        let batcher = Arc::new(Batcher::new(8));
        let answer =
            batcher
                .run(
                    3,
                    |(), batch: Vec<u32>| async move {
                        ((), batch.into_iter().map(|n| n * 2).collect())
                    },
                    drop,
                )
                .await;
        assert_eq!(answer, Some(6));
    }

    #[tokio::test]
    async fn operations_queued_during_a_batch_share_the_next_one_in_order() {
        let batcher = Arc::new(Batcher::new(64));
        let batches = Arc::new(Mutex::new(Vec::<Vec<u32>>::new()));
        let (release, released) = tokio::sync::watch::channel(false);
        let flush = {
            let batches = Arc::clone(&batches);
            move |(), batch: Vec<u32>| {
                let batches = Arc::clone(&batches);
                let mut released = released.clone();
                async move {
                    // The first batch is held until every other operation has queued.
                    released.wait_for(|r| *r).await.unwrap();
                    batches.lock().unwrap().push(batch.clone());
                    ((), batch.into_iter().map(|n| n + 100).collect())
                }
            }
        };
        // The first operation is taken by the flusher before the others queue.
        let (first, rest) = queued_behind_first(&batcher, flush, 5).await;
        release.send(true).unwrap();
        assert_eq!(first.await.unwrap(), Some(100));
        assert_eq!(
            rest.await.unwrap(),
            [Some(101), Some(102), Some(103), Some(104), Some(105)]
        );
        assert_eq!(*batches.lock().unwrap(), [vec![0], vec![1, 2, 3, 4, 5]]);
    }

    #[tokio::test]
    async fn a_flusher_hands_its_state_from_batch_to_batch_and_the_next_starts_afresh() {
        let batcher = Arc::new(Batcher::new(2));
        let (release, released) = tokio::sync::watch::channel(false);
        // Each operation is answered with the number of batches its flusher wrote before it.
        let flush = move |written: usize, batch: Vec<u32>| {
            let mut released = released.clone();
            async move {
                released.wait_for(|r| *r).await.unwrap();
                (written + 1, batch.iter().map(|_| written).collect())
            }
        };
        let (first, rest) = queued_behind_first(&batcher, flush.clone(), 4).await;
        release.send(true).unwrap();
        assert_eq!(first.await.unwrap(), Some(0));
        assert_eq!(rest.await.unwrap(), [Some(1), Some(1), Some(2), Some(2)]);
        assert_eq!(state(&batcher), (0, false));
        assert_eq!(batcher.run(5, flush, drop).await, Some(0));
    }

    #[tokio::test]
    async fn batches_are_bounded() {
        let batcher = Arc::new(Batcher::new(2));
        let largest = Arc::new(AtomicUsize::new(0));
        let flush = {
            let largest = Arc::clone(&largest);
            move |(), batch: Vec<u32>| {
                largest.fetch_max(batch.len(), Ordering::Relaxed);
                async move {
                    tokio::task::yield_now().await;
                    ((), batch)
                }
            }
        };
        let all: Vec<_> = (0..20)
            .map(|n| {
                let batcher = Arc::clone(&batcher);
                let flush = flush.clone();
                tokio::spawn(async move { batcher.run(n, flush, drop).await })
            })
            .collect();
        for (n, task) in all.into_iter().enumerate() {
            assert_eq!(task.await.unwrap(), Some(n as u32));
        }
        assert_eq!(largest.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn a_result_no_one_waits_for_is_handed_back() {
        let batcher = Arc::new(Batcher::new(8));
        let (unanswered, mut handed_back) = tokio::sync::mpsc::unbounded_channel();
        let (release, released) = tokio::sync::watch::channel(false);
        let flush = move |(), batch: Vec<u32>| {
            let mut released = released.clone();
            async move {
                released.wait_for(|r| *r).await.unwrap();
                ((), batch)
            }
        };
        let waiting = tokio::spawn({
            let batcher = Arc::clone(&batcher);
            async move {
                batcher
                    .run(7, flush, move |n| unanswered.send(n).unwrap())
                    .await
            }
        });
        until_taken(&batcher).await;
        // The caller gives up while its operation is being written.
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        release.send(true).unwrap();
        assert_eq!(handed_back.recv().await, Some(7));
    }

    #[tokio::test]
    async fn an_abandoned_operation_is_left_out_when_asked() {
        let batcher = Arc::new(Batcher::new(8).skipping_abandoned());
        let written = Arc::new(Mutex::new(Vec::<Vec<u32>>::new()));
        let (release, released) = tokio::sync::watch::channel(false);
        let flush = {
            let written = Arc::clone(&written);
            move |(), batch: Vec<u32>| {
                let written = Arc::clone(&written);
                let mut released = released.clone();
                async move {
                    released.wait_for(|r| *r).await.unwrap();
                    written.lock().unwrap().push(batch.clone());
                    ((), batch)
                }
            }
        };
        let (first, rest) = queued_behind_first(&batcher, flush, 2).await;
        // The callers queued behind the first batch give up before it is written.
        rest.abort();
        assert!(rest.await.unwrap_err().is_cancelled());
        release.send(true).unwrap();
        assert_eq!(first.await.unwrap(), Some(0));
        assert_eq!(*written.lock().unwrap(), [vec![0]]);
    }

    #[test]
    fn a_flusher_torn_down_with_its_runtime_leaves_no_caller_waiting() {
        let batcher = Arc::new(Batcher::<u32, u32>::new(8));
        let (entered, mut entered_rx) = tokio::sync::mpsc::unbounded_channel();
        let doomed = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let flush = move |(), batch: Vec<u32>| {
            let entered = entered.clone();
            async move {
                entered.send(()).unwrap();
                std::future::pending::<()>().await;
                ((), batch)
            }
        };
        // The flusher starts on `doomed` and hangs in its first batch.
        let first = doomed.spawn({
            let batcher = Arc::clone(&batcher);
            let flush = flush.clone();
            async move { batcher.run(1, flush, drop).await }
        });
        doomed.block_on(async { entered_rx.recv().await.unwrap() });
        // Another runtime's operation queues behind it.
        let survivor = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let second = survivor.spawn({
            let batcher = Arc::clone(&batcher);
            async move { batcher.run(2, flush, drop).await }
        });
        survivor.block_on(async {
            while state(&batcher).0 == 0 {
                tokio::task::yield_now().await;
            }
        });
        drop(doomed);
        drop(first);
        assert_eq!(survivor.block_on(second).unwrap(), None);
        assert_eq!(
            state(&batcher),
            (0, false),
            "the next operation starts a flusher"
        );
    }
}
