//! A seeded random number generator, so that a run's choices follow from `--seed`: which instance
//! is killed and when, each charge's key, amount and card, which requests hang up and after how
//! long, the backoff jitter.
//!
//! Timing still differs between runs (the operating system schedules the processes), so a seed
//! reproduces the run's *plan*, not every interleaving.

use rand::{RngExt, SeedableRng, rngs::SmallRng};

/// rand's `SmallRng` (fast, seedable; not for cryptography) with the few draws the run needs.
#[derive(Debug, Clone)]
pub(crate) struct Rng(SmallRng);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(SmallRng::seed_from_u64(seed))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0.random()
    }

    /// Uniform in `0..n` (`0` when `n` is `0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.0.random_range(0..n) }
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        self.0.random_range(lo..=hi)
    }

    /// `true` with probability `percent` / 100.
    pub(crate) fn percent(&mut self, percent: u8) -> bool {
        self.below(100) < u64::from(percent)
    }

    /// An independent generator for a sub-task (a client, a parallel sender).
    pub(crate) fn fork(&mut self) -> Self {
        Self::new(self.next_u64())
    }

    /// A version-4 UUID drawn from this generator (an `Idempotency-Key`).
    pub(crate) fn uuid(&mut self) -> uuid::Uuid {
        uuid::Builder::from_random_bytes(self.0.random()).into_uuid()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_choices() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_eq!(a.uuid(), b.uuid());
        assert_eq!(a.uuid().get_version_num(), 4);
    }

    #[test]
    fn ranges_hold() {
        let mut rng = Rng::new(1);
        for _ in 0..10_000 {
            assert!(rng.below(3) < 3);
            assert!((10..=50).contains(&rng.between(10, 50)));
        }
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.between(5, 5), 5);
        let hits = (0..10_000).filter(|_| rng.percent(10)).count();
        assert!((800..1200).contains(&hits), "{hits}");
    }
}
