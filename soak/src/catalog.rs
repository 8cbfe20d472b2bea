//! The refusals an inference request may get: the product page's table (Errors while waiting)
//! and the README's additions (unknown model, operator stop, failed wake or engine, engine
//! gone). A refusal must match one of them: status, code, message (with `*` for the parts that
//! vary), `retryable`, and `Retry-After: 1` on every 429.

/// (status, code, message pattern, retryable).
const REFUSALS: &[(u16, &str, &str, bool)] = &[
    (
        503,
        "unavailable",
        "deployment * did not become servable within the queue deadline; retry shortly",
        true,
    ),
    (
        503,
        "unavailable",
        "switch to * failed: drain timeout after * ms with * request(s) still charged; the victims serve again; retry shortly",
        true,
    ),
    (
        503,
        "unavailable",
        "dispatch to deployment * is closed; retry shortly",
        true,
    ),
    (
        429,
        "queue_full",
        "too many requests are waiting for deployment *",
        true,
    ),
    (
        429,
        "queue_full",
        "waiting requests exceed the buffered-bytes bound",
        true,
    ),
    (
        429,
        "queue_full",
        "deployment * stayed at its in-flight bound for the queue deadline",
        true,
    ),
    (
        429,
        "queue_full",
        "deployment * is at its in-flight bound and lets no request wait; retry shortly",
        true,
    ),
    (
        429,
        "queue_full",
        "deployment * is not servable now and lets no request wait; retry shortly",
        true,
    ),
    (
        409,
        "deployment_stopped",
        "deployment * was stopped by an operator; inference does not start it; start it with `capyctl start deployment *`",
        false,
    ),
    (404, "model_not_found", "model * is not deployed", false),
    (
        503,
        "wake_mismatch",
        "wake of deployment * failed (wake_mismatch): *; the instance was stopped and the next request loads it fresh; retry shortly",
        true,
    ),
    (
        503,
        "wake_reload_failed",
        "wake of deployment * failed (wake_reload_failed): *; the instance was stopped and the next request loads it fresh; retry shortly",
        true,
    ),
    (
        503,
        "wake_uncertain",
        "wake of deployment * failed (wake_uncertain): *; the instance was stopped and the next request loads it fresh; retry shortly",
        true,
    ),
    (
        503,
        "engine_failed",
        "the engine of deployment * failed: *; the next request or start tries again; retry shortly",
        true,
    ),
    (
        502,
        "upstream_unavailable",
        "the engine could not answer: *",
        true,
    ),
];

/// Whether `text` matches `pattern`, where `*` stands for any text (possibly empty).
fn matches(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
}

/// Checks a refusal: `Ok(code)` when it is one of the catalogue's, else why not.
pub fn check(status: u16, body: &[u8], retry_after: Option<&str>) -> Result<String, String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        format!(
            "{status} with a body that is not JSON ({e}): {}",
            String::from_utf8_lossy(body)
        )
    })?;
    let code = v.get("code").and_then(|c| c.as_str()).unwrap_or("");
    let message = v.get("message").and_then(|c| c.as_str()).unwrap_or("");
    let retryable = v.get("retryable").and_then(|c| c.as_bool());
    let known = REFUSALS
        .iter()
        .find(|(s, c, m, _)| *s == status && *c == code && matches(m, message));
    match known {
        None => Err(format!("{status} {v} is not in the catalogue")),
        Some((_, _, _, r)) if retryable != Some(*r) => {
            Err(format!("{status} {v}: retryable should be {r}"))
        }
        Some(_) if status == 429 && retry_after != Some("1") => {
            Err(format!("429 {v} without Retry-After: 1"))
        }
        Some(_) => Ok(code.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        assert!(matches("a * b", "a x y b"));
        assert!(matches("a *", "a "));
        assert!(!matches("a * b", "a x c"));
        assert!(matches("exact", "exact"));
        assert!(!matches("exact", "exact more"));
    }

    #[test]
    fn refusals() {
        let b = br#"{"code":"queue_full","message":"too many requests are waiting for deployment 01K","retryable":true}"#;
        assert_eq!(check(429, b, Some("1")), Ok("queue_full".into()));
        assert!(check(429, b, None).is_err());
        assert!(check(503, b, None).is_err());
        let b = br#"{"code":"unavailable","message":"switch to 01K failed: drain timeout after 5000 ms with 2 request(s) still charged; the victims serve again; retry shortly","retryable":true}"#;
        assert_eq!(check(503, b, None), Ok("unavailable".into()));
        assert!(check(500, b"oops", None).is_err());
    }
}
