//! The Tower side's layer: see [`IdempotentLayer`].

use std::sync::Arc;

use tower_layer::Layer;

use crate::{policy::Policy, service::Idempotent};

/// Wraps a Tower HTTP client (hyper-util's `Client`, tonic's `Channel`...) in [`Idempotent`];
/// see [the crate docs](crate#tower).
#[derive(Debug, Clone)]
#[must_use]
pub struct IdempotentLayer {
    policy: Arc<Policy>,
}

impl IdempotentLayer {
    /// The layer under `policy`.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }
}

impl Default for IdempotentLayer {
    fn default() -> Self {
        Self::new(Policy::default())
    }
}

impl<S> Layer<S> for IdempotentLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent::new(inner, Arc::clone(&self.policy))
    }
}
