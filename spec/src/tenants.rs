//! Tenants of the inference listener (DESIGN 4.10): the one set of rules every source of tenants
//! is held to (the standalone document's `server.inference_auth.tenants`, and whatever the
//! router's table is given: `Tenant` objects on Kubernetes), and the one glob match of a
//! tenant's `models`.
//!
//! The rules ([`check`]): a tenant's name is a DNS-1123 label, used once; it has at least one
//! key; a key is 1 to [`MAX_KEY_BYTES`] visible ASCII characters (what a client can send as
//! `Authorization: Bearer <key>`), and no key is given twice (within a tenant or across
//! tenants: a key names one tenant); `models`, when given, names at least one pattern, each of
//! the characters of a deployment name and the wildcards `*` and `?`; a rate is 1 to
//! [`MAX_REQUESTS_PER_MINUTE`] requests and 1 to [`MAX_TOKENS_PER_MINUTE`] tokens per minute.
//! Each refusal names the key path of what is wrong, relative to the list of tenants, and
//! never the key itself.

use std::collections::HashMap;

use crate::documents::{KeyPath, Seg, is_dns_label};

/// The most requests per minute a tenant's rate may allow (absurd above: 1,000,000 is over
/// 16,000 a second).
pub const MAX_REQUESTS_PER_MINUTE: u64 = 1_000_000;
/// The most tokens per minute a tenant's rate may allow.
pub const MAX_TOKENS_PER_MINUTE: u64 = 10_000_000_000;
/// The longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;

/// An API key, in clear: never shown by `Debug`.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct ApiKey(pub String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<key>")
    }
}

/// One key of a tenant and where it was given (its key path below the tenant: `keys[0]`,
/// `key_files[1]`).
#[derive(Debug, Clone, Copy)]
pub struct KeyAt<'a> {
    /// `keys` or `key_files`.
    pub list: &'static str,
    /// Its index in that list.
    pub index: usize,
    /// The key.
    pub key: &'a str,
}

/// A tenant as [`check`] reads it.
#[derive(Debug, Clone)]
pub struct TenantView<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its keys, with where each was given.
    pub keys: Vec<KeyAt<'a>>,
    /// Its model patterns; `None`: every model.
    pub models: Option<&'a [String]>,
    /// `rate.requests_per_minute`.
    pub requests_per_minute: Option<u64>,
    /// `rate.tokens_per_minute`.
    pub tokens_per_minute: Option<u64>,
}

/// Checks tenants against the rules of the module; `Err` has the key path (below the list:
/// `[1].keys[0]`) and what is wrong.
pub fn check(tenants: &[TenantView<'_>]) -> Result<(), (KeyPath, String)> {
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut keys: HashMap<&str, (usize, &str)> = HashMap::new();
    for (i, t) in tenants.iter().enumerate() {
        let at = |rest: &[Seg]| {
            let mut path = vec![Seg::Index(i)];
            path.extend_from_slice(rest);
            KeyPath(path)
        };
        let key = |k: &str| Seg::Key(k.to_string());
        if !is_dns_label(t.name) {
            return Err((
                at(&[key("name")]),
                format!(
                    "`{}` is not a tenant name: 1 to 63 of a-z, 0-9 and `-`, starting and ending with a letter or digit",
                    t.name
                ),
            ));
        }
        if let Some(first) = names.insert(t.name, i) {
            return Err((
                at(&[key("name")]),
                format!(
                    "`{}` is already the name of tenants[{first}]; tenant names must be unique",
                    t.name
                ),
            ));
        }
        if t.keys.is_empty() {
            return Err((
                at(&[key("keys")]),
                format!(
                    "tenant {} has no key: give at least one in keys or key_files",
                    t.name
                ),
            ));
        }
        for k in &t.keys {
            let path = at(&[key(k.list), Seg::Index(k.index)]);
            if k.key.is_empty() {
                return Err((path, "the key is empty".to_string()));
            }
            if k.key.len() > MAX_KEY_BYTES {
                return Err((
                    path,
                    format!("the key is longer than {MAX_KEY_BYTES} bytes"),
                ));
            }
            if !k.key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err((
                    path,
                    "the key has a character a client cannot send in `Authorization: Bearer <key>` (only visible ASCII, no spaces)".to_string(),
                ));
            }
            if let Some((other, other_name)) = keys.insert(k.key, (i, t.name)) {
                let whose = if other == i {
                    format!("tenant {other_name} already has this key")
                } else {
                    format!(
                        "this key is already a key of tenant {other_name} (tenants[{other}]); a key names one tenant"
                    )
                };
                return Err((path, whose));
            }
        }
        if let Some(models) = t.models {
            if models.is_empty() {
                return Err((
                    at(&[key("models")]),
                    format!(
                        "tenant {} names no models: list names or globs, or leave models out to allow every model",
                        t.name
                    ),
                ));
            }
            for (j, pattern) in models.iter().enumerate() {
                check_model_pattern(pattern)
                    .map_err(|why| (at(&[key("models"), Seg::Index(j)]), why))?;
            }
        }
        let rates = [
            (
                "requests_per_minute",
                t.requests_per_minute,
                MAX_REQUESTS_PER_MINUTE,
            ),
            (
                "tokens_per_minute",
                t.tokens_per_minute,
                MAX_TOKENS_PER_MINUTE,
            ),
        ];
        for (name, value, max) in rates {
            if let Some(v) = value {
                check_rate(v, max).map_err(|why| {
                    (
                        at(&[key("rate"), key(name)]),
                        format!("{why}; leave {name} out for no limit"),
                    )
                })?;
            }
        }
    }
    Ok(())
}

/// The rule of one of a tenant's `models`: a deployment name or a glob of one, made of a-z, 0-9,
/// `-` and the wildcards `*` and `?`. `Err` says what is wrong (the caller names where).
pub fn check_model_pattern(pattern: &str) -> Result<(), String> {
    if pattern.is_empty() {
        return Err(
            "an empty pattern: give a name or a glob of a-z, 0-9, `-`, `*` and `?`".to_string(),
        );
    }
    if !pattern
        .bytes()
        .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'*' | b'?'))
    {
        return Err(format!(
            "`{pattern}` matches no deployment name: a name or a glob of a-z, 0-9, `-`, `*` and `?`"
        ));
    }
    Ok(())
}

/// The rule of a rate: 1 to `max` ([`MAX_REQUESTS_PER_MINUTE`], [`MAX_TOKENS_PER_MINUTE`]) per
/// minute. `Err` says what is wrong (the caller names where).
pub fn check_rate(per_minute: u64, max: u64) -> Result<(), String> {
    if (1..=max).contains(&per_minute) {
        Ok(())
    } else {
        Err(format!("{per_minute} is out of range (1 to {max})"))
    }
}

/// Whether `name` matches `pattern`: `*` any run of bytes (none included), `?` one byte,
/// anything else itself (patterns are ASCII, [`check_model_pattern`], and so are deployments'
/// names: a name with other characters is no deployment's, answered as an unknown model
/// whether it matches or not).
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    // The last `*` and where in `name` its run ends now (backtracking: linear in practice).
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        match p.get(pi) {
            Some(b'*') => {
                if p[pi + 1..].iter().all(|&c| c == b'*') {
                    // Only stars left: the rest of the name is theirs (`prefix-*`, the usual).
                    return true;
                }
                star = Some((pi, ni));
                pi += 1;
            }
            Some(&c) if c == b'?' || c == n[ni] => {
                pi += 1;
                ni += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    pi = sp + 1;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(name: &'a str, keys: &[&'a str], models: Option<&'a [String]>) -> TenantView<'a> {
        TenantView {
            name,
            keys: keys
                .iter()
                .enumerate()
                .map(|(index, key)| KeyAt {
                    list: "keys",
                    index,
                    key,
                })
                .collect(),
            models,
            requests_per_minute: None,
            tokens_per_minute: None,
        }
    }

    fn refused(tenants: &[TenantView<'_>]) -> String {
        let (path, why) = check(tenants).expect_err("refused");
        format!("{}: {why}", path.display().unwrap_or_default())
    }

    #[test]
    fn globs_match_names() {
        assert!(glob_matches("chat-*", "chat-a"));
        assert!(glob_matches("chat-*", "chat-"));
        assert!(!glob_matches("chat-*", "chat"));
        assert!(glob_matches("*", "x"));
        assert!(glob_matches("a?c", "abc"));
        assert!(!glob_matches("a?c", "ac"));
        assert!(glob_matches("*-bot", "support-bot"));
        assert!(glob_matches("*a*b*", "xxaxxbxx"));
        assert!(!glob_matches("*a*b", "xxaxxbxx"));
        assert!(glob_matches("support-bot", "support-bot"));
        assert!(!glob_matches("support-bot", "support-bots"));
        assert!(glob_matches("chat-**", "chat-x"));
        // Every pattern and name of up to four of these characters, as a plain recursion
        // reads them.
        fn reference(p: &[u8], n: &[u8]) -> bool {
            match (p.first(), n.first()) {
                (None, _) => n.is_empty(),
                (Some(b'*'), _) => {
                    reference(&p[1..], n) || (!n.is_empty() && reference(p, &n[1..]))
                }
                (Some(_), None) => false,
                (Some(&c), Some(&d)) => (c == b'?' || c == d) && reference(&p[1..], &n[1..]),
            }
        }
        fn all(chars: &[u8], up_to: usize) -> Vec<String> {
            let mut out = vec![String::new()];
            let mut last = vec![String::new()];
            for _ in 0..up_to {
                last = last
                    .iter()
                    .flat_map(|s| chars.iter().map(move |&c| format!("{s}{}", c as char)))
                    .collect();
                out.extend(last.iter().cloned());
            }
            out
        }
        for pattern in all(b"ab*?", 4) {
            for name in all(b"ab", 4) {
                assert_eq!(
                    glob_matches(&pattern, &name),
                    reference(pattern.as_bytes(), name.as_bytes()),
                    "{pattern} {name}"
                );
            }
        }
    }

    #[test]
    fn good_tenants_pass() {
        let models = vec!["chat-*".to_string()];
        check(&[
            view("team-a", &["sk-a-1", "sk-a-2"], Some(&models)),
            view("team-b", &["sk-b"], None),
        ])
        .expect("good");
        check(&[]).expect("no tenants");
    }

    #[test]
    fn each_rule_names_where_and_never_the_key() {
        let none: Vec<String> = Vec::new();
        let bad = vec!["Chat_A".to_string()];
        let cases = [
            (
                vec![view("a", &["k1"], None), view("b", &["k1"], None)],
                "[1].keys[0]: this key is already a key of tenant a (tenants[0])",
            ),
            (
                vec![view("a", &["k1", "k1"], None)],
                "[0].keys[1]: tenant a already has this key",
            ),
            (
                vec![view("a", &[""], None)],
                "[0].keys[0]: the key is empty",
            ),
            (vec![view("a", &[], None)], "[0].keys: tenant a has no key"),
            (
                vec![view("a", &["k 1"], None)],
                "[0].keys[0]: the key has a character",
            ),
            (
                vec![view("a", &["k1"], Some(&none))],
                "[0].models: tenant a names no models",
            ),
            (
                vec![view("a", &["k1"], Some(&bad))],
                "[0].models[0]: `Chat_A` matches no deployment name",
            ),
            (
                vec![view("a", &["k1"], None), view("a", &["k2"], None)],
                "[1].name: `a` is already the name of tenants[0]",
            ),
            (
                vec![view("A", &["k1"], None)],
                "[0].name: `A` is not a tenant name",
            ),
        ];
        for (tenants, expected) in cases {
            let got = refused(&tenants);
            assert!(got.starts_with(expected), "{got}");
            assert!(!got.contains("k1"), "a key is shown: {got}");
        }
        for (rpm, tpm, at) in [
            (
                Some(0),
                None,
                "[0].rate.requests_per_minute: 0 is out of range",
            ),
            (
                Some(MAX_REQUESTS_PER_MINUTE + 1),
                None,
                "[0].rate.requests_per_minute: 1000001 is out of range",
            ),
            (
                None,
                Some(0),
                "[0].rate.tokens_per_minute: 0 is out of range",
            ),
        ] {
            let mut t = view("a", &["k1"], None);
            t.requests_per_minute = rpm;
            t.tokens_per_minute = tpm;
            let got = refused(&[t]);
            assert!(got.starts_with(at), "{got}");
        }
    }
}
