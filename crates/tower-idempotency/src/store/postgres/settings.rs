//! The store's own settings, held to the layer's rule: a zero or too short duration is refused
//! with a typed error, a longer one than [`MAX_DURATION`] is taken as it.

use std::{fmt, time::Duration};

use crate::settings::MAX_DURATION;

/// The narrowest partition of partitioned mode
/// ([`PostgresStore::partitioned`](super::PostgresStore::partitioned)): a claim looks its key up
/// in every live partition, so narrow ones make each claim slower and the catalog larger.
pub const MIN_PARTITION_WIDTH: Duration = Duration::from_secs(5 * 60);

/// The most partitions partitioned mode keeps ahead (its window
/// ([`with_partitions_ahead`](super::PostgresStore::with_partitions_ahead)) divided by the
/// partition width, rounded up): the default window at the narrowest width needs 576.
pub const MAX_PARTITIONS_AHEAD: u64 = 1_000;

/// The shortest interval at which waiters read their key
/// ([`with_in_flight_polling`](super::PostgresStore::with_in_flight_polling)): shorter, a
/// storm of waiters reads in a tight loop.
pub const MIN_IN_FLIGHT_POLLING: Duration = Duration::from_millis(10);

/// An invalid [`PostgresStore`](super::PostgresStore) setting.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PostgresConfigError {
    /// A duration that must be positive was zero.
    Zero(&'static str),
    /// A duration shorter than the setting's minimum.
    TooShort {
        /// The setting.
        setting: &'static str,
        /// Its minimum.
        min: Duration,
    },
    /// Partitioned mode would keep more than [`MAX_PARTITIONS_AHEAD`] partitions ahead.
    TooManyPartitions {
        /// How far ahead partitions are kept.
        ahead: Duration,
        /// The partition width.
        width: Duration,
    },
}

impl fmt::Display for PostgresConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Zero(setting) => {
                write!(f, "PostgreSQL store setting `{setting}` must not be zero")
            }
            Self::TooShort { setting, min } => {
                write!(
                    f,
                    "PostgreSQL store setting `{setting}` must be at least {min:?}"
                )
            }
            Self::TooManyPartitions { ahead, width } => write!(
                f,
                "partitions of {width:?} kept {ahead:?} ahead are more than \
                 {MAX_PARTITIONS_AHEAD}: choose wider partitions or a shorter window"
            ),
        }
    }
}

impl std::error::Error for PostgresConfigError {}

/// `value` for `setting` if it is at least `min` (and not zero), at most [`MAX_DURATION`].
pub(super) fn duration(
    setting: &'static str,
    value: Duration,
    min: Duration,
) -> Result<Duration, PostgresConfigError> {
    if value.is_zero() {
        return Err(PostgresConfigError::Zero(setting));
    }
    if value < min {
        return Err(PostgresConfigError::TooShort { setting, min });
    }
    Ok(value.min(MAX_DURATION))
}

/// Checks that partitions `width` wide kept `ahead` are at most [`MAX_PARTITIONS_AHEAD`].
pub(super) fn partitions_fit(width: Duration, ahead: Duration) -> Result<(), PostgresConfigError> {
    // Whole seconds, as partitions are cut; both are at most `MAX_DURATION`, far from overflow.
    let count = ahead.as_secs().div_ceil(width.as_secs().max(1));
    if count > MAX_PARTITIONS_AHEAD {
        return Err(PostgresConfigError::TooManyPartitions { ahead, width });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{
        super::{PostgresStore, partitions::partitions_to_create},
        *,
    };

    fn any_duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
            (0..10_000_000_000_000u64).prop_map(Duration::from_nanos),
            (0..400u64 * 24 * 3600).prop_map(Duration::from_secs),
            Just(Duration::MAX),
            Just(Duration::ZERO),
        ]
    }

    /// A store on a pool that never connects: settings need no database.
    fn store() -> PostgresStore {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://127.0.0.1:1/unused")
            .expect("a valid URL");
        PostgresStore::new(pool)
    }

    /// What each setter must answer for `value`, whatever else is set.
    fn expected(value: Duration, min: Duration) -> Result<Duration, ()> {
        if value < min.max(Duration::from_nanos(1)) {
            Err(())
        } else {
            Ok(value.min(MAX_DURATION))
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Issue 34.4: every duration is refused with a typed error or bounded; the window is
        /// kept whichever setter comes first; and partitions for an accepted pair are few and
        /// cover the window (no endless loop, no claim without a partition).
        #[test]
        fn any_duration_is_refused_or_bounded_in_either_order(
            width in any_duration(),
            ahead in any_duration(),
            polling in any_duration(),
            ahead_first in any::<bool>(),
            now in 0i64..4_000_000_000,
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let _entered = runtime.enter();
            let mut store = store();
            let mut errors = Vec::new();
            let set_ahead = |store: PostgresStore, errors: &mut Vec<_>| {
                store.clone().with_partitions_ahead(ahead).unwrap_or_else(|e| {
                    errors.push(e);
                    store
                })
            };
            if ahead_first {
                store = set_ahead(store, &mut errors);
            }
            store = store.clone().partitioned(width).unwrap_or_else(|e| {
                errors.push(e);
                store
            });
            if !ahead_first {
                store = set_ahead(store, &mut errors);
            }
            let polled = store.clone().with_in_flight_polling(polling);

            let width_ok = expected(width, MIN_PARTITION_WIDTH);
            let ahead_ok = expected(ahead, Duration::ZERO);
            match (width_ok, ahead_ok) {
                (Ok(w), Ok(a)) if partitions_fit(w, a).is_ok() => {
                    prop_assert!(errors.is_empty(), "{errors:?}");
                    let partitioning = store.partitions.expect("partitioned");
                    prop_assert_eq!((partitioning.width, partitioning.ahead), (w, a));
                    let width = partitioning.width.as_secs() as i64;
                    let horizon = now + partitioning.ahead.as_secs() as i64;
                    let create = partitions_to_create(&[], now, horizon, width);
                    prop_assert!(create.len() as u64 <= MAX_PARTITIONS_AHEAD + 1);
                    prop_assert!(create[0].start <= now);
                    prop_assert!(create[create.len() - 1].end >= horizon);
                }
                (Ok(w), Ok(a)) => prop_assert_eq!(
                    errors.last(),
                    Some(&PostgresConfigError::TooManyPartitions { ahead: a, width: w })
                ),
                _ => prop_assert!(!errors.is_empty()),
            }
            for error in &errors {
                prop_assert!(!error.to_string().is_empty());
            }
            match (expected(polling, MIN_IN_FLIGHT_POLLING), polled) {
                (Ok(interval), Ok(store)) => {
                    prop_assert_eq!(store.in_flight_polling, Some(interval));
                }
                (Err(()), Err(error)) => {
                    let refused = matches!(
                        error,
                        PostgresConfigError::Zero(_) | PostgresConfigError::TooShort { .. }
                    );
                    prop_assert!(refused, "{error:?}");
                }
                (expected, got) => prop_assert!(false, "{expected:?} but {:?}", got.err()),
            }
        }
    }

    #[test]
    fn the_issues_settings_are_refused() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let _entered = runtime.enter();
        assert_eq!(
            store().partitioned(Duration::ZERO).err(),
            Some(PostgresConfigError::Zero("partition_width"))
        );
        assert_eq!(
            store().with_in_flight_polling(Duration::ZERO).err(),
            Some(PostgresConfigError::Zero("in_flight_polling"))
        );
        let ahead = store()
            .with_partitions_ahead(Duration::MAX)
            .expect("capped");
        assert!(matches!(
            ahead.partitioned(Duration::from_secs(3600)).err(),
            Some(PostgresConfigError::TooManyPartitions { .. })
        ));
        let widest = store().partitioned(Duration::MAX).expect("capped");
        assert_eq!(widest.partitions.expect("partitioned").width, MAX_DURATION);
        // The window set first is kept.
        let store = store()
            .with_partitions_ahead(Duration::from_secs(5 * 3600))
            .and_then(|store| store.partitioned(Duration::from_secs(3600)))
            .expect("valid");
        let partitioning = store.partitions.expect("partitioned");
        assert_eq!(partitioning.ahead, Duration::from_secs(5 * 3600));
    }
}
