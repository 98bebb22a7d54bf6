//! Retries inside one model call: a provider that answers 429 (rate limit)
//! or a 5xx (overloaded, a gateway's hiccup) is asked again after the wait
//! it names in `Retry-After`, else after a jittered back-off, before the
//! call fails its Step attempt. The Step's own retries are minutes apart and
//! few; a rate limit usually lifts within seconds.

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, RETRY_AFTER};
use reqwest::StatusCode;

/// How a provider retries within one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Further requests after the first (0: none).
    pub retries: u32,
    /// The longest wait between two requests: a `Retry-After` beyond it
    /// fails the call at once (the Step's retry policy takes over), rather
    /// than holding a worker's slot for it.
    pub max_wait: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            retries: 3,
            max_wait: Duration::from_secs(30),
        }
    }
}

/// The first back-off when the provider names no wait.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);

/// Whether an answer with `status` is worth asking again: the provider is
/// limiting the rate, overloaded, or had a fault of its own.
pub fn retryable(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
        || status.is_server_error()
}

/// The wait an answer names in `Retry-After`: delay-seconds, or an
/// HTTP-date (a date in the past is no wait). None when absent or unreadable.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

impl RetryPolicy {
    /// The wait before request number `failures + 1`, or `Err` with why no
    /// further request is made.
    pub fn wait(&self, failures: u32, asked: Option<Duration>) -> Result<Duration, String> {
        if failures > self.retries {
            return Err(format!(
                "gave up after {} request(s)",
                self.retries.saturating_add(1)
            ));
        }
        match asked {
            Some(wait) if wait > self.max_wait => Err(format!(
                "the provider asks to wait {} s, longer than max_retry_wait ({} s)",
                wait.as_secs(),
                self.max_wait.as_secs()
            )),
            Some(wait) => Ok(wait),
            None => Ok(backoff(failures).min(self.max_wait)),
        }
    }
}

/// 500 ms doubled after each failure, spread over its upper half so that
/// calls limited together do not come back together.
fn backoff(failures: u32) -> Duration {
    let full = FIRST_BACKOFF.saturating_mul(1u32 << failures.saturating_sub(1).min(10));
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let half = full / 2;
    half + half.mul_f64(f64::from(nanos) / 1e9)
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;

    use super::*;

    fn with_retry_after(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(RETRY_AFTER, value);
        }
        headers
    }

    #[test]
    fn retry_after_is_read_as_seconds_or_as_a_date() {
        assert_eq!(
            retry_after(&with_retry_after("7")),
            Some(Duration::from_secs(7))
        );
        let soon = SystemTime::now() + Duration::from_secs(90);
        let date = retry_after(&with_retry_after(&httpdate::fmt_http_date(soon)));
        assert!(
            date.is_some_and(|d| d > Duration::from_secs(80) && d <= Duration::from_secs(90)),
            "{date:?}"
        );
        assert_eq!(
            retry_after(&with_retry_after("Wed, 21 Oct 2015 07:28:00 GMT")),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&with_retry_after("soon")), None);
        assert_eq!(retry_after(&with_retry_after("-1")), None);
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }

    #[test]
    fn the_policy_honours_the_asked_wait_up_to_its_cap_and_its_count() {
        let policy = RetryPolicy {
            retries: 2,
            max_wait: Duration::from_secs(10),
        };
        assert_eq!(
            policy.wait(1, Some(Duration::from_secs(3))),
            Ok(Duration::from_secs(3))
        );
        assert!(policy
            .wait(1, Some(Duration::from_secs(11)))
            .is_err_and(|why| why.contains("max_retry_wait")));
        assert!(policy
            .wait(3, None)
            .is_err_and(|why| why.contains("3 request")));
        let first = policy.wait(1, None).unwrap_or_default();
        assert!(first >= Duration::from_millis(250) && first <= FIRST_BACKOFF);
        let second = policy.wait(2, None).unwrap_or_default();
        assert!(second >= FIRST_BACKOFF / 2 * 2 && second <= FIRST_BACKOFF * 2);
        let none = RetryPolicy {
            retries: 0,
            ..policy
        };
        assert!(none.wait(1, None).is_err());
    }

    #[test]
    fn rate_limits_and_server_faults_are_retried_and_refusals_are_not() {
        for status in [429, 408, 500, 502, 503, 504] {
            assert!(retryable(StatusCode::from_u16(status).unwrap_or_default()));
        }
        for status in [400, 401, 403, 404, 409, 422] {
            assert!(!retryable(StatusCode::from_u16(status).unwrap_or_default()));
        }
    }
}
