//! The API in process (`app()` with `oneshot`), every scenario on both backends: memory, and
//! PostgreSQL with a database of its own per test.

#[path = "../common/mod.rs"]
mod common;

/// Runs each scenario on each backend, bounded in time.
macro_rules! on_every_backend {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    crate::common::bounded(super::$scenario(crate::common::Backend::Memory)).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    crate::common::bounded(super::$scenario(crate::common::Backend::Postgres)).await
                }
            )*
        }
    };
}

mod charges;
mod openapi;
mod reading;
mod refunds;
mod requests;
mod steps;
mod transactional;
mod webhooks;
