//! At the card network, in steps mode: every charge row has exactly one authorization (found by
//! the `reference` the demo sends, the charge's id), of the charge's amount, and no
//! authorization is without its charge once the completer has run.

use std::collections::HashMap;

use sqlx::{PgPool, Row};

use super::Verdict;
use crate::network::Authorization;

/// What the network's authorizations came to against the charge rows.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tally {
    pub(crate) authorizations: u64,
    /// Authorizations beyond the first of a charge.
    pub(crate) double: u64,
    /// Authorizations naming no charge row.
    pub(crate) orphaned: u64,
    /// Authorizations of another amount than their charge's.
    pub(crate) mismatched: u64,
}

/// Tallies `made` against the charge rows; examples of each failure go to `verdict`.
pub(crate) async fn tally(
    pool: &PgPool,
    made: &[Authorization],
    verdict: &mut Verdict,
) -> Result<Tally, sqlx::Error> {
    let mut amounts = HashMap::new();
    for row in sqlx::query("SELECT id, amount FROM charges")
        .fetch_all(pool)
        .await?
    {
        amounts.insert(
            row.try_get::<String, _>("id")?,
            row.try_get::<i64, _>("amount")?,
        );
    }
    Ok(count(&amounts, made, verdict))
}

/// Tallies `made` against the charges' amounts by id.
fn count(amounts: &HashMap<String, i64>, made: &[Authorization], verdict: &mut Verdict) -> Tally {
    let mut tally = Tally {
        authorizations: made.len() as u64,
        ..Tally::default()
    };
    let mut per_charge: HashMap<&str, Vec<&Authorization>> = HashMap::new();
    for authorization in made {
        let charge = authorization.reference.as_deref();
        match charge.and_then(|id| amounts.get(id).map(|amount| (id, *amount))) {
            Some((id, amount)) => {
                per_charge.entry(id).or_default().push(authorization);
                if amount != authorization.amount {
                    tally.mismatched += 1;
                    verdict.example(
                        "authorization mismatch",
                        format!(
                            "{} of {} for charge {id} of {amount}",
                            authorization.id, authorization.amount
                        ),
                    );
                }
            }
            None => {
                tally.orphaned += 1;
                verdict.example(
                    "orphaned authorization",
                    format!(
                        "{} of {} under key {} names no charge ({:?})",
                        authorization.id,
                        authorization.amount,
                        authorization.idempotency_key,
                        charge
                    ),
                );
            }
        }
    }
    for (charge, authorizations) in per_charge {
        if authorizations.len() > 1 {
            tally.double += authorizations.len() as u64 - 1;
            let ids: Vec<&str> = authorizations.iter().map(|a| a.id.as_str()).collect();
            verdict.example(
                "double authorization",
                format!("charge {charge} authorized {} times: {ids:?}", ids.len()),
            );
        }
    }
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made(id: &str, amount: i64, reference: Option<&str>) -> Authorization {
        Authorization {
            id: id.to_owned(),
            amount,
            idempotency_key: format!("key-of-{id}"),
            reference: reference.map(str::to_owned),
        }
    }

    #[test]
    fn each_charge_has_one_authorization_of_its_amount_and_none_is_left_over() {
        let amounts = HashMap::from([("ch_1".to_owned(), 500), ("ch_2".to_owned(), 700)]);
        let clean = [made("a1", 500, Some("ch_1")), made("a2", 700, Some("ch_2"))];
        let mut verdict = Verdict::default();
        let tally = count(&amounts, &clean, &mut verdict);
        assert_eq!(
            (tally.authorizations, tally.double, tally.orphaned),
            (2, 0, 0)
        );
        assert!(verdict.examples.is_empty());

        let broken = [
            made("a1", 500, Some("ch_1")),
            made("a2", 500, Some("ch_1")),
            made("a3", 900, Some("ch_9")),
            made("a4", 900, None),
            made("a5", 701, Some("ch_2")),
        ];
        let tally = count(&amounts, &broken, &mut verdict);
        assert_eq!(
            (tally.double, tally.orphaned, tally.mismatched),
            (1, 2, 1),
            "{tally:?}"
        );
        assert_eq!(verdict.examples.len(), 3, "{:?}", verdict.examples);
    }
}
