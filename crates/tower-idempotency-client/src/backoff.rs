//! Exponential backoff with full jitter (the AWS Architecture Blog's "Exponential Backoff And
//! Jitter": a random wait up to the step spreads clients that failed together).

use std::time::Duration;

use rand::RngExt;

/// A first step doubled each retry, up to a cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    pub(crate) fn new(base: Duration, cap: Duration) -> Self {
        Self { base, cap }
    }

    /// The longest wait before retry `retry` (from 0).
    pub(crate) fn step(&self, retry: u32) -> Duration {
        self.base
            .saturating_mul(1_u32.checked_shl(retry).unwrap_or(u32::MAX))
            .min(self.cap)
    }

    /// A random wait before retry `retry`, from zero up to its [`step`](Self::step).
    pub(crate) fn delay(&self, retry: u32) -> Duration {
        let step = u64::try_from(self.step(retry).as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(rand::rng().random_range(0..=step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_double_up_to_the_cap_and_delays_stay_under_them() {
        let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        assert_eq!(backoff.step(0), Duration::from_millis(100));
        assert_eq!(backoff.step(3), Duration::from_millis(800));
        assert_eq!(backoff.step(6), Duration::from_secs(5));
        assert_eq!(backoff.step(200), Duration::from_secs(5));
        for retry in 0..40 {
            assert!(backoff.delay(retry) <= backoff.step(retry));
        }
    }
}
