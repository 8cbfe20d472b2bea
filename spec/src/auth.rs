//! The bearer-token check shared by the management API and the node agent's API.
//!
//! NB: the Kubernetes API server's service proxy strips `Authorization` before it forwards a
//! request (it is the API server's own credential), so the management API also takes its token
//! in [`TOKEN_HEADER`]; `kubectl capyctl` sends it there.

/// The header that carries the admin token where `Authorization` cannot (`kubectl capyctl`
/// through the API server's service proxy).
pub const TOKEN_HEADER: &str = "x-capyctl-token";

/// Whether a [`TOKEN_HEADER`] value is `token` (surrounding spaces ignored; an empty `token`
/// matches nothing), compared as [`bearer_matches`] compares.
pub fn header_matches(value: Option<&[u8]>, token: &[u8]) -> bool {
    value.is_some_and(|v| !token.is_empty() && constant_time_eq(v.trim_ascii(), token))
}

/// Whether an `Authorization` header value (`Bearer <token>`, the scheme in any case) carries
/// `token`. An empty `token` matches nothing. The comparison takes a time that depends only on
/// the lengths, not on where the bytes differ.
pub fn bearer_matches(authorization: Option<&[u8]>, token: &[u8]) -> bool {
    let Some(given) = authorization.and_then(bearer) else {
        return false;
    };
    !token.is_empty() && constant_time_eq(given, token)
}

/// The credentials of a `Bearer` header value (the scheme in any case, surrounding spaces
/// ignored).
pub fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_right_bearer_token_matches() {
        assert!(bearer_matches(Some(b"Bearer s3cret"), b"s3cret"));
        assert!(bearer_matches(Some(b"bearer  s3cret "), b"s3cret"));
        assert!(!bearer_matches(Some(b"Bearer s3cre"), b"s3cret"));
        assert!(!bearer_matches(Some(b"Bearer s3cretx"), b"s3cret"));
        assert!(!bearer_matches(Some(b"Basic s3cret"), b"s3cret"));
        assert!(!bearer_matches(Some(b"Bearers3cret"), b"s3cret"));
        assert!(!bearer_matches(None, b"s3cret"));
        assert!(!bearer_matches(Some(b"Bearer "), b""));
    }

    #[test]
    fn the_token_header_matches_only_the_token() {
        assert!(header_matches(Some(b"s3cret"), b"s3cret"));
        assert!(header_matches(Some(b" s3cret "), b"s3cret"));
        assert!(!header_matches(Some(b"Bearer s3cret"), b"s3cret"));
        assert!(!header_matches(Some(b""), b""));
        assert!(!header_matches(None, b"s3cret"));
    }
}
