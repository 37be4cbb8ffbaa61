//! What a failed attempt says about its entry: it can never apply (dead-letter it now), the
//! failure is the environment's (retry it in place), or nobody knows (retry it on later
//! deliveries, up to `--max-deliveries`).

use std::error::Error as StdError;

use tower_idempotency::OnceError;

/// Why an entry was not applied, and what to do about it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The same input fails the same way every time: dead-letter it now, with this reason.
    Permanent(String),
    /// The database or another consumer is busy or away: retry in place, not counted.
    Transient(String),
    /// Neither is known: leave it pending, to be retried on a later delivery.
    Unknown(String),
}

impl Failure {
    /// Classifies what applying an entry returned.
    pub(crate) fn of(error: &OnceError<sqlx::Error>) -> Self {
        match error {
            OnceError::Mismatch => Self::Permanent("event id reused with another payload".into()),
            OnceError::InvalidKey(_) => Self::Permanent("invalid event id".into()),
            OnceError::Payload(_) | OnceError::Output(_) => Self::Permanent(chain(error)),
            OnceError::InFlight => Self::Transient("event in flight elsewhere".into()),
            // The store unreachable, or the commit's outcome lost with its connection.
            OnceError::Store(_) | OnceError::NotCommitted => Self::Transient(chain(error)),
            OnceError::Failed(error) => Self::of_database(error),
            _ => Self::Unknown(chain(error)),
        }
    }

    /// Classifies the effect's own database error, by SQLSTATE where the database gave one.
    fn of_database(error: &sqlx::Error) -> Self {
        let sqlx::Error::Database(database) = error else {
            return match error {
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => Self::Transient(chain(error)),
                _ => Self::Unknown(chain(error)),
            };
        };
        let code = database.code().unwrap_or_default().into_owned();
        let what = format!("{} (SQLSTATE {code})", database.message());
        match code.get(..2).unwrap_or_default() {
            // Data exceptions and integrity violations: the entry's data, refused.
            "22" | "23" => Self::Permanent(format!("the database refused its data: {what}")),
            // Connection lost, or the server out of resources.
            "08" | "53" => Self::Transient(what),
            _ if TRANSIENT_CODES.contains(&code.as_str()) => Self::Transient(what),
            _ => Self::Unknown(what),
        }
    }
}

/// SQLSTATEs outside those classes that a retry resolves: serialization failure, deadlock, lock
/// not available, a write on a standby during a failover, the server shutting down or starting.
const TRANSIENT_CODES: [&str; 7] = [
    "40001", "40P01", "55P03", "25006", "57P01", "57P02", "57P03",
];

/// An error and its sources, as one line.
fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_of_the_entry_itself_are_permanent() {
        assert_eq!(
            Failure::of(&OnceError::Mismatch),
            Failure::Permanent("event id reused with another payload".into())
        );
        assert!(matches!(
            Failure::of(&OnceError::InFlight),
            Failure::Transient(_)
        ));
        assert!(matches!(
            Failure::of(&OnceError::NotCommitted),
            Failure::Transient(_)
        ));
        let lost = sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into());
        assert!(matches!(
            Failure::of(&OnceError::Failed(lost)),
            Failure::Transient(_)
        ));
        let not_found = sqlx::Error::RowNotFound;
        assert!(matches!(
            Failure::of(&OnceError::Failed(not_found)),
            Failure::Unknown(_)
        ));
    }
}
