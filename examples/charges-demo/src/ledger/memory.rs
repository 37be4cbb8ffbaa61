use std::{
    collections::{BTreeMap, HashMap, HashSet},
    convert::Infallible,
    sync::{Arc, Mutex, MutexGuard},
};

use sqlx::PgConnection;

use super::{
    Balance, Charge, ChargePage, ChargeStatus, Ledger, Page, Refund, RefundRefusal, Settlement,
};
use crate::{auth::Account, params::RefundParams};

/// A [`Ledger`] in the process's memory: the embedded mode's. Everything is lost on exit.
#[derive(Debug, Clone, Default)]
pub struct MemoryLedger {
    inner: Arc<Mutex<Books>>,
}

#[derive(Debug, Default)]
struct Books {
    charges: Book<Charge>,
    refunds: Book<Refund>,
    /// The ids of the settled charges.
    settled: HashSet<String>,
    /// Each account's available balance, per currency.
    available: HashMap<Account, BTreeMap<String, i64>>,
}

/// Objects of one kind, per account, in the order they were made.
#[derive(Debug)]
struct Book<T> {
    /// Each account's objects, oldest first.
    by_account: HashMap<Account, Vec<T>>,
    /// Where each object is: its account and its index in that account's list.
    by_id: HashMap<String, (Account, usize)>,
}

impl<T> Default for Book<T> {
    fn default() -> Self {
        Self {
            by_account: HashMap::new(),
            by_id: HashMap::new(),
        }
    }
}

impl<T: Clone> Book<T> {
    fn insert(&mut self, account: &Account, id: &str, object: T) {
        let list = self.by_account.entry(account.clone()).or_default();
        list.push(object);
        let index = list.len() - 1;
        self.by_id.insert(id.to_owned(), (account.clone(), index));
    }

    fn get_mut(&mut self, account: &Account, id: &str) -> Option<&mut T> {
        let (owner, index) = self.by_id.get(id).filter(|(owner, _)| owner == account)?;
        self.by_account.get_mut(owner)?.get_mut(*index)
    }

    fn get(&self, account: &Account, id: &str) -> Option<T> {
        let (owner, index) = self.by_id.get(id).filter(|(owner, _)| owner == account)?;
        self.by_account.get(owner)?.get(*index).cloned()
    }

    fn page(&self, account: &Account, limit: usize, starting_after: Option<&str>) -> Page<T> {
        let Some(list) = self.by_account.get(account) else {
            return Page {
                data: Vec::new(),
                has_more: false,
            };
        };
        let end = match starting_after {
            None => list.len(),
            Some(id) => match self.by_id.get(id) {
                Some((owner, index)) if owner == account => *index,
                // Not this account's: nothing comes after it.
                _ => 0,
            },
        };
        let mut newest_first = list[..end].iter().rev();
        let data: Vec<T> = newest_first.by_ref().take(limit).cloned().collect();
        Page {
            data,
            has_more: newest_first.next().is_some(),
        }
    }
}

impl Books {
    /// The available balance of `account` in `currency`, created at zero.
    fn available(&mut self, account: &Account, currency: &str) -> &mut i64 {
        let currencies = self.available.entry(account.clone()).or_default();
        currencies.entry(currency.to_owned()).or_default()
    }
}

impl MemoryLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many charges it holds, all accounts together.
    pub fn len(&self) -> usize {
        self.books().charges.by_id.len()
    }

    /// Whether it holds no charge.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        // No code panics while holding the lock, and the maps stay consistent if one did: each
        // change is made whole under one lock, and a refund checks before it writes.
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
        self.books()
            .charges
            .insert(&charge.account, &charge.id, charge.clone());
        Ok(())
    }

    async fn retrieve(&self, account: &Account, id: &str) -> Result<Option<Charge>, Infallible> {
        Ok(self.books().charges.get(account, id))
    }

    async fn list(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> Result<ChargePage, Infallible> {
        Ok(self.books().charges.page(account, limit, starting_after))
    }

    /// Checked and written under the ledger's one lock: concurrent refunds take turns.
    async fn refund(
        &self,
        account: &Account,
        params: &RefundParams,
        _transaction: Option<&mut PgConnection>,
    ) -> Result<Result<Refund, RefundRefusal>, Infallible> {
        let mut books = self.books();
        let Some(charge) = books.charges.get_mut(account, &params.charge) else {
            return Ok(Err(RefundRefusal::NoSuchCharge));
        };
        let amount = match charge.refundable(params.amount) {
            Ok(amount) => amount,
            Err(refusal) => return Ok(Err(refusal)),
        };
        charge.amount_refunded += amount;
        let refund = Refund::new(charge, amount, params.metadata.clone());
        if books.settled.contains(&refund.charge) {
            // Taken back from what the settlement made available (see `settlement`).
            *books.available(account, &refund.currency) -= amount;
        }
        books.refunds.insert(account, &refund.id, refund.clone());
        Ok(Ok(refund))
    }

    /// Checked and written under the ledger's one lock: a charge is settled once.
    async fn settle(
        &self,
        id: &str,
        _transaction: Option<&mut PgConnection>,
    ) -> Result<Settlement, Infallible> {
        let mut books = self.books();
        let Some((account, _)) = books.charges.by_id.get(id).cloned() else {
            return Ok(Settlement::NoSuchCharge);
        };
        let Some(charge) = books.charges.get(&account, id) else {
            return Ok(Settlement::NoSuchCharge);
        };
        if charge.status != ChargeStatus::Succeeded {
            return Ok(Settlement::NotPaid);
        }
        if !books.settled.insert(charge.id.clone()) {
            return Ok(Settlement::AlreadySettled);
        }
        let amount = charge.amount - charge.amount_refunded;
        *books.available(&account, &charge.currency) += amount;
        Ok(Settlement::Settled {
            amount,
            currency: charge.currency,
        })
    }

    async fn balance(&self, account: &Account) -> Result<Balance, Infallible> {
        let books = self.books();
        let mut pending = BTreeMap::new();
        let charges = books.charges.by_account.get(account).into_iter().flatten();
        for charge in charges {
            if charge.status == ChargeStatus::Succeeded && !books.settled.contains(&charge.id) {
                *pending.entry(charge.currency.clone()).or_default() +=
                    charge.amount - charge.amount_refunded;
            }
        }
        let available = books.available.get(account).cloned().unwrap_or_default();
        Ok(Balance { available, pending })
    }

    async fn retrieve_refund(
        &self,
        account: &Account,
        id: &str,
    ) -> Result<Option<Refund>, Infallible> {
        Ok(self.books().refunds.get(account, id))
    }

    async fn list_refunds(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> Result<Page<Refund>, Infallible> {
        Ok(self.books().refunds.page(account, limit, starting_after))
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
        let amounts = |page: &ChargePage| page.data.iter().map(|c| c.amount).collect::<Vec<_>>();
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
        assert!(foreign.data.is_empty());
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
