//! Acknowledged records lost (issue 45.4): an answer a client received whose record the
//! database no longer holds, as a failover to a standby that was behind its primary leaves it;
//! and what became of each request: its row went with the record, or it ran again.

use super::{RecordRow, Verdict};
use crate::client::Answer;

/// Records lost, and what became of their requests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lost {
    /// Logical requests with an answer their record no longer holds.
    pub(crate) records: u64,
    /// Of them, those left without their row (a charge or refund row gone with the record).
    pub(crate) without_row: u64,
    /// Of them, those that ran again: a second row, another answer, or a record of another run.
    pub(crate) ran_again: u64,
}

/// Counts a logical request whose `answers` are not all held by its `record`, with `rows` of
/// its own rows in the database now.
pub(super) fn count(
    verdict: &mut Verdict,
    what: &str,
    answers: &[Answer],
    record: Option<&RecordRow>,
    rows: usize,
) {
    let Some(first) = answers.first() else {
        return;
    };
    if answers.iter().all(|answer| holds(record, answer)) {
        return;
    }
    let lost = &mut verdict.acknowledged_lost;
    lost.records += 1;
    lost.without_row += u64::from(rows == 0);
    let ran_again =
        rows > 1 || record.is_some() || answers.iter().any(|answer| !answer.same_response(first));
    lost.ran_again += u64::from(ran_again);
    verdict.example(
        "acknowledged record lost",
        format!(
            "{what}: answered {} ({} answer(s)), but {}; {rows} row(s){}",
            first.status.as_u16(),
            answers.len(),
            if record.is_some() {
                "the key's record holds another response"
            } else {
                "the key has no record"
            },
            if ran_again { ", ran again" } else { "" }
        ),
    );
}

/// Whether `record` holds `answer`: its status and the SHA-256 of its body.
fn holds(record: Option<&RecordRow>, answer: &Answer) -> bool {
    record.is_some_and(|record| {
        record.status == i16::try_from(answer.status.as_u16()).ok()
            && record.body_sha256.as_deref() == Some(answer.body_sha256.as_slice())
    })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::StatusCode;
    use sha2::{Digest, Sha256};

    use super::*;

    fn answer(body: &'static str, replayed: bool) -> Answer {
        Answer::new(
            StatusCode::OK,
            replayed,
            &Bytes::from_static(body.as_bytes()),
        )
    }

    fn record(body: &str) -> RecordRow {
        RecordRow {
            status: Some(200),
            body_sha256: Some(Sha256::digest(body).to_vec()),
        }
    }

    #[test]
    fn a_held_answer_is_not_lost_and_a_missing_or_rewritten_record_is() {
        let mut verdict = Verdict::default();
        let fresh = answer(r#"{"id":"ch_1"}"#, false);
        let replay = answer(r#"{"id":"ch_1"}"#, true);
        count(
            &mut verdict,
            "kept",
            &[fresh, replay],
            Some(&record(r#"{"id":"ch_1"}"#)),
            1,
        );
        assert_eq!(verdict.acknowledged_lost, Lost::default());

        // Gone with its row: a failover to a standby that never had it.
        let fresh = answer(r#"{"id":"ch_2"}"#, false);
        count(&mut verdict, "gone", &[fresh], None, 0);
        // Resent after the loss: it ran again, another charge, another record.
        let (first, again) = (
            answer(r#"{"id":"ch_3"}"#, false),
            answer(r#"{"id":"ch_4"}"#, false),
        );
        count(
            &mut verdict,
            "ran again",
            &[first, again],
            Some(&record(r#"{"id":"ch_4"}"#)),
            1,
        );
        assert_eq!(
            verdict.acknowledged_lost,
            Lost {
                records: 2,
                without_row: 1,
                ran_again: 1
            }
        );
        assert_eq!(verdict.examples.len(), 1, "{:?}", verdict.examples);
    }
}
