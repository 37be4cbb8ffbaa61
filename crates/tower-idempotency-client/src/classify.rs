//! What an answer or a failure means by the protocol (the table in
//! [the crate docs](crate#what-is-retried)).

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, StatusCode, header::RETRY_AFTER};

/// What an answer asks of the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The server's answer: a success, or a refusal a retry cannot get past.
    Final,
    /// A retry may get past it, no sooner than `after` when the server said so.
    Retry { after: Option<Duration> },
    /// `422` to a keyed request: the key was used before with another payload.
    KeyReused,
}

/// The verdict on `status` for a request that carried a key (`keyed`) or not.
pub(crate) fn verdict(
    status: StatusCode,
    headers: &HeaderMap,
    keyed: bool,
    retry_500: bool,
) -> Verdict {
    let retry = || Verdict::Retry {
        after: retry_after(headers, SystemTime::now()),
    };
    match status {
        StatusCode::UNPROCESSABLE_ENTITY if keyed => Verdict::KeyReused,
        StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS => retry(),
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => {
            retry()
        }
        StatusCode::INTERNAL_SERVER_ERROR if retry_500 => retry(),
        _ => Verdict::Final,
    }
}

/// `Retry-After` as a wait from `now`: delay-seconds or an HTTP-date (RFC 9110 §10.2.3); a
/// date in the past is no wait, an unreadable value none at all.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether the response carries the replay marker `name` (`true`, or the sf-boolean `?1`).
pub(crate) fn replayed(headers: &HeaderMap, name: &HeaderName) -> bool {
    headers.get(name).is_some_and(|value| {
        let value = value.as_bytes();
        value.eq_ignore_ascii_case(b"true") || value == b"?1"
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with_retry_after(value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static(value));
        headers
    }

    #[test]
    fn statuses_are_judged_by_the_protocol() {
        let none = HeaderMap::new();
        let judge = |code: u16| {
            let status = StatusCode::from_u16(code).expect("a status");
            verdict(status, &none, true, false)
        };
        for code in [409, 429, 502, 503, 504] {
            assert_eq!(judge(code), Verdict::Retry { after: None }, "{code}");
        }
        for code in [200, 201, 302, 400, 401, 402, 403, 404, 410, 413, 500, 501] {
            assert_eq!(judge(code), Verdict::Final, "{code}");
        }
        assert_eq!(judge(422), Verdict::KeyReused);
        let unkeyed = verdict(StatusCode::UNPROCESSABLE_ENTITY, &none, false, false);
        assert_eq!(unkeyed, Verdict::Final, "no key, nothing reused");
        let on_500 = verdict(StatusCode::INTERNAL_SERVER_ERROR, &none, true, true);
        assert_eq!(on_500, Verdict::Retry { after: None });
        let conflict = verdict(StatusCode::CONFLICT, &with_retry_after("2"), true, false);
        assert_eq!(
            conflict,
            Verdict::Retry {
                after: Some(Duration::from_secs(2))
            }
        );
    }

    #[test]
    fn retry_after_is_seconds_or_a_date() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").expect("a date");
        let later = with_retry_after("Sun, 06 Nov 1994 08:49:40 GMT");
        assert_eq!(retry_after(&later, now), Some(Duration::from_secs(3)));
        let earlier = with_retry_after("Sun, 06 Nov 1994 08:49:30 GMT");
        assert_eq!(retry_after(&earlier, now), Some(Duration::ZERO));
        let seconds = with_retry_after(" 7 ");
        assert_eq!(retry_after(&seconds, now), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(&with_retry_after("soon"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn replays_are_marked_true_or_sf_true() {
        let name = HeaderName::from_static("idempotent-replayed");
        let marked = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(name.clone(), HeaderValue::from_static(value));
            replayed(&headers, &name)
        };
        assert!(marked("true") && marked("TRUE") && marked("?1"));
        assert!(!marked("false") && !marked("?0"));
        assert!(!replayed(&HeaderMap::new(), &name));
    }
}
