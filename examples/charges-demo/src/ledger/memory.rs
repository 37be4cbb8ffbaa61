use std::{
    collections::HashMap,
    convert::Infallible,
    sync::{Arc, Mutex, MutexGuard},
};

use sqlx::PgConnection;

use super::{Charge, ChargePage, Ledger};
use crate::auth::Account;

/// A [`Ledger`] in the process's memory: the embedded mode's. Everything is lost on exit.
#[derive(Debug, Clone, Default)]
pub struct MemoryLedger {
    inner: Arc<Mutex<Charges>>,
}

#[derive(Debug, Default)]
struct Charges {
    /// Each account's charges, oldest first.
    by_account: HashMap<Account, Vec<Charge>>,
    /// Where each charge is: its account and its index in that account's list.
    by_id: HashMap<String, (Account, usize)>,
}

impl MemoryLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many charges it holds, all accounts together.
    pub fn len(&self) -> usize {
        self.charges().by_id.len()
    }

    /// Whether it holds no charge.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn charges(&self) -> MutexGuard<'_, Charges> {
        // No code panics while holding the lock, and the maps stay consistent if one did: the
        // lock is only ever taken for plain reads and single inserts.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Ledger for MemoryLedger {
    type Error = Infallible;

    /// There is no transaction to join in memory: `transaction` is ignored (it is always `None`
    /// in the embedded mode, whose idempotency store is in memory too).
    async fn insert(
        &self,
        charge: &Charge,
        _transaction: Option<&mut PgConnection>,
    ) -> Result<(), Infallible> {
        let mut charges = self.charges();
        let list = charges
            .by_account
            .entry(charge.account.clone())
            .or_default();
        list.push(charge.clone());
        let index = list.len() - 1;
        charges
            .by_id
            .insert(charge.id.clone(), (charge.account.clone(), index));
        Ok(())
    }

    async fn retrieve(&self, account: &Account, id: &str) -> Result<Option<Charge>, Infallible> {
        let charges = self.charges();
        Ok(charges
            .by_id
            .get(id)
            .filter(|(owner, _)| owner == account)
            .and_then(|(owner, index)| charges.by_account.get(owner)?.get(*index))
            .cloned())
    }

    async fn list(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> Result<ChargePage, Infallible> {
        let charges = self.charges();
        let Some(list) = charges.by_account.get(account) else {
            return Ok(ChargePage {
                charges: Vec::new(),
                has_more: false,
            });
        };
        let end = match starting_after {
            None => list.len(),
            Some(id) => match charges.by_id.get(id) {
                Some((owner, index)) if owner == account => *index,
                // Not this account's: nothing comes after it.
                _ => 0,
            },
        };
        let mut newest_first = list[..end].iter().rev();
        let page: Vec<Charge> = newest_first.by_ref().take(limit).cloned().collect();
        Ok(ChargePage {
            charges: page,
            has_more: newest_first.next().is_some(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{params::ChargeParams, processor::Authorization};

    async fn charge(ledger: &MemoryLedger, account: &Account, amount: i64) -> Charge {
        let params =
            ChargeParams::parse(None, format!("amount={amount}&currency=usd").as_bytes()).unwrap();
        let charge = Charge::new(account, params, Authorization::Approved);
        ledger.insert(&charge, None).await.unwrap();
        charge
    }

    #[tokio::test]
    async fn lists_newest_first_in_pages_per_account() {
        let ledger = MemoryLedger::new();
        let a = Account::from_api_key("sk_test_a");
        let b = Account::from_api_key("sk_test_b");
        let mut mine = Vec::new();
        for amount in 1..=5 {
            mine.push(charge(&ledger, &a, amount).await);
        }
        let theirs = charge(&ledger, &b, 99).await;
        assert_eq!(ledger.len(), 6);

        let first = ledger.list(&a, 2, None).await.unwrap();
        let amounts = |page: &ChargePage| page.charges.iter().map(|c| c.amount).collect::<Vec<_>>();
        assert_eq!(amounts(&first), [5, 4]);
        assert!(first.has_more);
        let second = ledger.list(&a, 2, Some(&mine[3].id)).await.unwrap();
        assert_eq!(amounts(&second), [3, 2]);
        assert!(second.has_more);
        let last = ledger.list(&a, 2, Some(&mine[1].id)).await.unwrap();
        assert_eq!(amounts(&last), [1]);
        assert!(!last.has_more);

        let all = ledger.list(&a, 100, None).await.unwrap();
        assert_eq!(amounts(&all), [5, 4, 3, 2, 1]);
        assert!(!all.has_more);
        // Another account's cursor shows nothing.
        let foreign = ledger.list(&a, 10, Some(&theirs.id)).await.unwrap();
        assert!(foreign.charges.is_empty());
        assert_eq!(
            amounts(&ledger.list(&b, 10, None).await.unwrap()),
            [99],
            "b sees only its own"
        );
    }

    #[tokio::test]
    async fn retrieve_is_scoped_to_the_account() {
        let ledger = MemoryLedger::new();
        let a = Account::from_api_key("sk_test_a");
        let b = Account::from_api_key("sk_test_b");
        let made = charge(&ledger, &a, 10).await;
        assert_eq!(
            ledger.retrieve(&a, &made.id).await.unwrap(),
            Some(made.clone())
        );
        assert_eq!(ledger.retrieve(&b, &made.id).await.unwrap(), None);
        assert_eq!(ledger.retrieve(&a, "ch_missing").await.unwrap(), None);
    }
}
