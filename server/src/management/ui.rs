//! The web page at `/ui/` on the management listener (DESIGN 4.8): one HTML page, its script,
//! its style sheet and its icon, compiled into the binary (`include_str!`): no CDN, no build
//! step. The page needs no token; it asks for the admin token, keeps it in the tab's
//! `sessionStorage` and sends it as `Authorization: Bearer` to `/management/v1`, like the CLI.
//!
//! | route | answer |
//! |---|---|
//! | `GET /ui` | 308 to `/ui/` (the page's links are relative) |
//! | `GET /ui/` | the page (`text/html`) |
//! | `GET /ui/ui.js`, `/ui/ui.css`, `/ui/icon.svg` | its script, style sheet and icon |
//!
//! Every answer carries a Content-Security-Policy that lets the page load only its own files
//! and talk only to its own origin ([`CSP`]: no inline script or style, no frames, no form
//! posts), `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer`, and
//! `Cache-Control: no-cache` with an `ETag` (the content's hash): a browser asks again each
//! time and gets 304 when nothing changed, so a new binary's page is never mixed with an old
//! cached script.

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderMap, HeaderValue, StatusCode, header};

/// The page's path.
pub const PATH: &str = "/ui/";

/// The page's Content-Security-Policy: its own script, style, images and API only.
/// `form-action 'none'`: the token form is read by the script and never submitted, so a token
/// can never end up in a URL even if the script failed to load.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                       connect-src 'self'; base-uri 'none'; form-action 'none'; \
                       frame-ancestors 'none'";

/// One file of the page.
struct Asset {
    content_type: &'static str,
    body: &'static str,
    /// [`fnv1a`] of `body`, its `ETag`.
    hash: u64,
}

impl Asset {
    const fn new(content_type: &'static str, body: &'static str) -> Asset {
        Asset {
            content_type,
            body,
            hash: fnv1a(body.as_bytes()),
        }
    }
}

/// FNV-1a, 64 bits: the assets' `ETag`s, computed when the binary is compiled.
const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    let mut i = 0;
    while i < bytes.len() {
        hash = (hash ^ bytes[i] as u64).wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}

const INDEX: Asset = Asset::new("text/html; charset=utf-8", include_str!("ui/index.html"));
const SCRIPT: Asset = Asset::new("text/javascript; charset=utf-8", include_str!("ui/ui.js"));
const STYLE: Asset = Asset::new("text/css; charset=utf-8", include_str!("ui/ui.css"));
const ICON: Asset = Asset::new("image/svg+xml", include_str!("ui/icon.svg"));

/// The page's routes, to merge into the management app (outside `/management/v1`: no token).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(redirect))
        .route(PATH, get(|h: HeaderMap| async move { serve(&INDEX, &h) }))
        .route(
            "/ui/ui.js",
            get(|h: HeaderMap| async move { serve(&SCRIPT, &h) }),
        )
        .route(
            "/ui/ui.css",
            get(|h: HeaderMap| async move { serve(&STYLE, &h) }),
        )
        .route(
            "/ui/icon.svg",
            get(|h: HeaderMap| async move { serve(&ICON, &h) }),
        )
}

async fn redirect() -> Response {
    let mut response = StatusCode::PERMANENT_REDIRECT.into_response();
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("ui/"));
    response
}

fn serve(asset: &Asset, request: &HeaderMap) -> Response {
    let tag = format!("\"{:016x}\"", asset.hash);
    let unchanged = request
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim() == "*" || t.trim().trim_start_matches("W/") == tag)
        });
    let mut response = if unchanged {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, asset.content_type)],
            asset.body,
        )
            .into_response()
    };
    let headers = response.headers_mut();
    if let Ok(tag) = HeaderValue::try_from(tag) {
        headers.insert(header::ETAG, tag);
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page works under [`CSP`] only if nothing in it is inline: no `<style>`, no `style`
    /// attribute, no inline script or event handler, no HTML built from strings.
    #[test]
    fn the_files_need_nothing_the_csp_forbids() {
        let html = INDEX.body;
        for bad in ["<style", " style=", "javascript:", "http://", "https://"] {
            assert!(!html.contains(bad), "index.html holds {bad:?}");
        }
        assert_eq!(
            html.matches("<script").count(),
            html.matches("<script src=").count(),
            "every script of index.html is a file"
        );
        let handler = html.split_whitespace().any(|word| {
            word.strip_prefix("on").is_some_and(|rest| {
                rest.split_once('=')
                    .is_some_and(|(name, _)| name.chars().all(|c| c.is_ascii_lowercase()))
            })
        });
        assert!(!handler, "index.html has an inline event handler");
        for bad in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
            "'style'",
            ".style.",
            "localStorage.setItem",
        ] {
            assert!(!SCRIPT.body.contains(bad), "ui.js holds {bad:?}");
        }
        for bad in ["@import", "url(http"] {
            assert!(!STYLE.body.contains(bad), "ui.css holds {bad:?}");
        }
    }

    #[test]
    fn each_file_has_its_own_etag() {
        let hashes = [INDEX.hash, SCRIPT.hash, STYLE.hash, ICON.hash];
        for (i, a) in hashes.iter().enumerate() {
            assert!(hashes[i + 1..].iter().all(|b| a != b), "{hashes:?}");
        }
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
