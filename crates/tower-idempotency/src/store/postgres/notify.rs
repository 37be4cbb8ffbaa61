//! Waking duplicates that wait for a key in flight: the announcements of settled keys, and the
//! listener that hears other instances' (see [`Store::capabilities`]).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use sqlx::{PgPool, Row, types::Uuid};

use super::{
    PostgresStore, PostgresStoreError,
    sql::{NOTIFY_ONE, SETTLED_CHANNEL},
    statement::{Param, Statement, stored_key},
};
use crate::{scope::ScopeKey, store::Notifier};

/// The store's side of [`InFlightWatch::Notified`]: whether its statements announce settled
/// keys, and the listener that wakes this process's waiters.
#[derive(Debug, Default)]
pub(super) struct Notifications {
    pub(super) listening: AtomicBool,
    pub(super) notifier: Notifier,
}

impl Notifications {
    /// Whether statements announce the keys they settle: once a layer that waits is built on
    /// the store, for its waiters here or in another instance.
    pub(super) fn emit(&self) -> bool {
        self.notifier.waiters_expected()
    }

    /// Starts the listener, once, if there is a runtime to run it on (else at the next call:
    /// the next request that waits, see [`Store::capabilities`]).
    pub(super) fn listen(self: &Arc<Self>, pool: &PgPool) {
        // Called as each request starts waiting: the common case reads one flag.
        if self.listening.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.listening.swap(true, Ordering::AcqRel) {
            return;
        }
        // Until it listens, waiters poll.
        self.notifier.set_live(false);
        runtime.spawn(listen(Arc::downgrade(self), pool.clone()));
    }
}

/// Wakes this process's waiters whenever any instance announces a settled key; while it cannot
/// listen (connecting, or reconnecting after a lost connection) waiters poll. Ends once the
/// store is dropped.
pub(super) async fn listen(notifications: std::sync::Weak<Notifications>, pool: PgPool) {
    // A connection of its own, beside the pool: held for good, it would take one of the
    // connections the requests share.
    let options = (*pool.connect_options()).clone();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(options);
    let mut pause = Duration::from_millis(100);
    loop {
        let Some(notifier) = notifications.upgrade().map(|n| n.notifier.clone()) else {
            return;
        };
        let listener = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener.listen(SETTLED_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = match listener.await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for settled keys; waiters poll meanwhile");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        pause = Duration::from_millis(100);
        notifier.set_live(true);
        loop {
            // Wakes now and then to notice that the store is gone.
            let received = tokio::time::timeout(Duration::from_secs(1), listener.try_recv()).await;
            match received {
                Ok(Ok(Some(notification))) => {
                    if let Ok(key) = notification.payload().parse::<Uuid>() {
                        notifier.notify_prefix(*key.as_bytes());
                    }
                }
                // The connection was lost: what was announced meanwhile is lost too.
                Ok(Ok(None) | Err(_)) => {
                    notifier.set_live(false);
                    break;
                }
                Err(_) if notifications.strong_count() == 0 => return,
                Err(_) => {}
            }
        }
    }
}

impl PostgresStore {
    /// Marks `key`, in flight, as waited for unless it is already, so that its completion or
    /// release announces it; `false` when no claim of it was in flight any more. Partitioned
    /// mode's mark; the plain table's rides on the waiter's claim statement.
    pub(super) async fn mark_key_waited(&self, key: &ScopeKey) -> Result<bool, PostgresStoreError> {
        let statement =
            Statement::new(self.fenced_sql().mark_waited).with(Param::Key(stored_key(key)));
        let row = self
            .timed(
                "mark_waited",
                statement.fetch_optional(self.prepared, &self.pool),
            )
            .await?;
        Ok(match row {
            Some(row) => row.try_get::<bool, _>("marked")?,
            None => false,
        })
    }

    /// Wakes the duplicates waiting for `key` after a rollback freed it (a rollback notifies
    /// nothing). Best effort: a waiter that misses it reads the key again within a second.
    pub(super) async fn notify_released(&self, key: &ScopeKey) {
        if !self.notifications.emit() {
            return;
        }
        let statement = Statement::new(NOTIFY_ONE).with(Param::Key(stored_key(key)));
        if let Err(error) = self
            .timed("release", statement.execute(self.prepared, &self.pool))
            .await
        {
            tracing::debug!(%error, "could not announce a released key");
        }
    }
}
