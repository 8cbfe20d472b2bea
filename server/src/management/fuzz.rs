//! Fuzz target of the management API's request parsing (see `fuzz/` and `fuzz-targets/`):
//! arbitrary bytes as the body of a deploy (JSON and YAML, by `Content-Type` and by sniffing),
//! of a start, and as the load read's and the switch list's queries. Panics only when an invariant fails. Not part of
//! the crate's API.

use capyctl_spec::api::StartRequest;
use http::{HeaderMap, HeaderValue, header};

use super::{Format, document_format, load_query, parse_document, percent_decode, switches_query};

/// A management request's parts from `data`: the first line is a `Content-Type` (used when
/// it is a valid header value) and a query, the rest the body. Checks that a document read
/// (JSON or YAML) reads the same written back as JSON, that a start body read writes
/// back the same, and that a query decodes only when each `%` is followed by two hex digits.
pub fn bodies(data: &[u8]) {
    let (first, body) = match data.iter().position(|&b| b == b'\n') {
        Some(end) => (&data[..end], &data[end + 1..]),
        None => (&[][..], data),
    };
    let mut headers = HeaderMap::new();
    let sniffed = document_format(&headers, body);
    assert!(sniffed.is_ok());
    if let Ok(value) = HeaderValue::from_bytes(first) {
        headers.insert(header::CONTENT_TYPE, value);
        let _ = document_format(&headers, body);
    }
    for format in [Format::Json, Format::Yaml] {
        if let Ok(doc) = parse_document(format, body) {
            let json = serde_json::to_vec(&doc).expect("a document writes as JSON");
            assert_eq!(parse_document(Format::Json, &json).as_ref(), Ok(&doc));
        }
    }
    if let Ok(start) = serde_json::from_slice::<StartRequest>(body) {
        let json = serde_json::to_vec(&start).expect("a start request writes as JSON");
        assert_eq!(
            serde_json::from_slice::<StartRequest>(&json).ok(),
            Some(start)
        );
    }
    if let Ok(query) = std::str::from_utf8(first) {
        let _ = load_query(Some(query));
        if let Ok(q) = switches_query(Some(query)) {
            assert!(
                q.limit
                    .is_none_or(|l| (1..=capyctl_spec::api::SWITCHES_PAGE_MAX).contains(&l)),
                "{query:?} reads a limit out of range"
            );
            assert!(q.deployment.as_ref().is_none_or(|d| !d.is_empty()));
        }
        let decoded = percent_decode(query);
        let escapes_valid = query.split('%').skip(1).all(|after| {
            after.len() >= 2 && after.as_bytes()[..2].iter().all(u8::is_ascii_hexdigit)
        });
        if decoded.is_ok() {
            assert!(escapes_valid, "{query:?} decodes with a bad escape");
        }
    }
}
