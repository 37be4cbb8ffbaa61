//! The report's sections of a steps run and of its webhooks.

use super::Report;
use crate::{verify::WebhookVerdict, webhooks::COPIES};

impl Report {
    /// The steps run's own lines: the clients that went away, the completer, the network.
    pub(super) fn print_steps(&self, line: &impl Fn(&str, u64, String)) {
        let v = &self.verdict;
        line(
            "clients that went away",
            self.abandoned,
            format!(
                "at a connection error mid-charge; {} logical charges, each sent again after \
                 the run",
                v.abandoned
            ),
        );
        line(
            "completer",
            self.completed_keys,
            format!(
                "keys completed ({} charges driven through a handler, {} given up)",
                self.completer_charges, self.completer_gave_up
            ),
        );
        line(
            "answered fresh again",
            v.resumed_fresh,
            "logical charges and refunds whose takeover resumed from their recorded steps \
             and answered the same bytes again, unmarked"
                .to_owned(),
        );
        line(
            "acquirer authorizations",
            v.authorizations,
            format!(
                "{} calls, {} of them answered as replays (a downstream key sent again)",
                v.network_calls, v.network_replays
            ),
        );
    }
}

/// The settlements' figures ([`webhooks`](crate::webhooks)).
pub(super) fn print_webhooks(w: &WebhookVerdict, line: &impl Fn(&str, u64, String)) {
    println!("webhooks (charge.settled, {COPIES} copies at once)");
    if w.settle_percent == 0 {
        let off = "off (--settle-percent 0): the balances are all pending".to_owned();
        line("events", 0, off);
        let read = format!(
            "{} balances read (each account on both instances)",
            w.balance_reads
        );
        line("accounts checked", w.accounts, read);
        return;
    }
    line(
        "events",
        w.events,
        format!(
            "for {} % of {} charges that succeeded: {} second events (another id), {} for \
             unknown charges",
            w.settle_percent, w.offered, w.second_events, w.unknown_events
        ),
    );
    line(
        "copies",
        w.copies,
        format!(
            "at most {} of one event in flight at once; all {COPIES} at once for {} events (their \
             waits for a copy in flight count among the duplicates that waited)",
            w.peak_at_once, w.all_at_once
        ),
    );
    line(
        "deliveries",
        w.deliveries,
        format!(
            "{} retries: {} connection errors, {} timeouts, {} × 5xx, {} × 409 (another copy \
             in flight)",
            w.retries, w.connection_errors, w.timeouts, w.server_errors, w.conflicts
        ),
    );
    line(
        "404 answers",
        w.not_found,
        "copies of events for unknown charges".to_owned(),
    );
    line(
        "settled charges",
        w.settled_charges,
        format!(
            "{} of them refunded ({} in part before their settlement, {} after it), {} sent \
             two events; {} inbox records",
            w.settled_refunded,
            w.refunded_before,
            w.refunded_after,
            w.settled_twice_sent,
            w.inbox_records
        ),
    );
    line(
        "accounts checked",
        w.accounts,
        format!(
            "{} balances read (each account on both instances)",
            w.balance_reads
        ),
    );
}
