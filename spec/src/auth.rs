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

/// Whether `a` and `b` are equal, in a time that depends on their lengths only, not on where
/// their bytes differ (compared a word at a time: the router compares a tenant's key on every
/// request of a connection).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().min(b.len());
    let ((a, a_rest), (b, b_rest)) = (a.split_at(n), b.split_at(n));
    let mut diff = u64::from(a_rest.len() != b_rest.len());
    let ((a_words, a_tail), (b_words, b_tail)) = (a.as_chunks::<8>(), b.as_chunks::<8>());
    for (x, y) in a_words.iter().zip(b_words) {
        diff |= u64::from_ne_bytes(*x) ^ u64::from_ne_bytes(*y);
    }
    for (x, y) in a_tail.iter().zip(b_tail) {
        diff |= u64::from(x ^ y);
    }
    // The longer one's bytes past the other's end, read all the same.
    for x in a_rest.iter().chain(b_rest) {
        diff |= u64::from(*x);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_constant_time_comparison_is_equality() {
        let bytes: Vec<u8> = (0..40u8).map(|i| i.wrapping_mul(37)).collect();
        for a in 0..bytes.len() {
            for b in 0..bytes.len() {
                let (x, y) = (&bytes[..a], &bytes[..b]);
                assert_eq!(constant_time_eq(x, y), x == y, "{a} {b}");
                let mut z = x.to_vec();
                if let Some(last) = z.last_mut() {
                    *last ^= 1;
                    assert!(!constant_time_eq(x, &z));
                }
            }
        }
        // Zero bytes past the shorter one's end do not make them equal.
        assert!(!constant_time_eq(b"key", b"key\0\0\0\0\0\0\0\0"));
    }

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
