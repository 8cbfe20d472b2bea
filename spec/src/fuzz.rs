//! Fuzz targets of the documents' parsers (see `fuzz/` and `fuzz-targets/`): each takes
//! arbitrary bytes, runs the parser CapyCTL runs on a file, a request body or the command line,
//! and panics only when an invariant fails. Not part of the crate's API.
//!
//! - [`units`]: durations and byte sizes, as text, JSON and YAML;
//! - [`deployment`]: a deployment document as YAML (a file) and as JSON (the management API);
//! - [`settings`]: host, server and standalone documents (and [`units`] on the same text);
//! - [`overrides`]: `--set` arguments and `CAPYCTL_SET__` variables over a standalone, host or
//!   server document.

use crate::documents::{
    self, DeploymentDoc, HostDoc, ServerDoc, StandaloneDoc, parse_deployment_json,
    parse_deployment_str, parse_host_str, parse_server_str, parse_standalone_str,
};
use crate::overrides::Overrides;
use crate::units::{ByteSize, DurationSetting};

/// Durations and byte sizes: a value read prints canonically, and the print reads back as the
/// same value; the text read as a JSON or YAML string reads the same.
pub fn units(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(d) = text.parse::<DurationSetting>() {
        let printed = d.to_string();
        assert_eq!(
            printed.parse::<DurationSetting>().ok(),
            Some(d),
            "{printed}"
        );
    }
    if let Ok(b) = text.parse::<ByteSize>() {
        let printed = b.to_string();
        assert_eq!(printed.parse::<ByteSize>().ok(), Some(b), "{printed}");
    }
    let _ = serde_json::from_str::<DurationSetting>(text);
    let _ = serde_json::from_str::<ByteSize>(text);
    let quoted = serde_json::Value::String(text.to_string()).to_string();
    assert_eq!(
        serde_json::from_str::<DurationSetting>(&quoted).ok(),
        text.parse::<DurationSetting>().ok()
    );
    assert_eq!(
        serde_json::from_str::<ByteSize>(&quoted).ok(),
        text.parse::<ByteSize>().ok()
    );
    if documents::depth::check(text).is_ok() {
        let _ = serde_yaml_ng::from_str::<DurationSetting>(text);
        let _ = serde_yaml_ng::from_str::<ByteSize>(text);
    }
}

/// A deployment document, as a YAML file and as a JSON body: an error prints; a document read
/// writes back (YAML and JSON) into text that reads as the same document.
pub fn deployment(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_deployment_str("fuzz.yaml", text) {
        Ok(doc) => deployment_round_trips(&doc),
        Err(e) => drop(e.to_string()),
    }
    match parse_deployment_json("fuzz.json", text) {
        Ok(doc) => deployment_round_trips(&doc),
        Err(e) => drop(e.to_string()),
    }
}

fn deployment_round_trips(doc: &DeploymentDoc) {
    let yaml = serde_yaml_ng::to_string(doc).expect("a document writes as YAML");
    match parse_deployment_str("again.yaml", &yaml) {
        Ok(again) => assert_eq!(&again, doc, "{yaml}"),
        Err(e) => panic!("the document written as {yaml:?} is refused: {e}"),
    }
    let json = serde_json::to_string(doc).expect("a document writes as JSON");
    match parse_deployment_json("again.json", &json) {
        Ok(again) => assert_eq!(&again, doc, "{json}"),
        Err(e) => panic!("the document written as {json:?} is refused: {e}"),
    }
}

/// Host, server and standalone documents: an error prints; a document read writes back into
/// YAML that resolves to the same settings.
pub fn settings(data: &[u8]) {
    units(data);
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let none = Overrides::none();
    let host = parse_host_str("fuzz.yaml", text, &none);
    let server = parse_server_str("fuzz.yaml", text, &none);
    let standalone = parse_standalone_str("fuzz.yaml", text, &none);
    for e in [
        host.as_ref().err(),
        server.as_ref().err(),
        standalone.as_ref().err(),
    ]
    .into_iter()
    .flatten()
    {
        drop(e.to_string());
    }
    if documents::depth::check(text).is_err() {
        return;
    }
    if let (Ok(doc), Ok(host)) = (serde_yaml_ng::from_str::<HostDoc>(text), &host) {
        let yaml = serde_yaml_ng::to_string(&doc).expect("a document writes as YAML");
        match parse_host_str("again.yaml", &yaml, &none) {
            Ok(again) => assert_eq!(&again, host, "{yaml}"),
            Err(e) => panic!("the document written as {yaml:?} is refused: {e}"),
        }
    }
    if let (Ok(doc), Ok(server)) = (serde_yaml_ng::from_str::<ServerDoc>(text), &server) {
        let yaml = serde_yaml_ng::to_string(&doc).expect("a document writes as YAML");
        match parse_server_str("again.yaml", &yaml, &none) {
            Ok(again) => assert_eq!(&again, server, "{yaml}"),
            Err(e) => panic!("the document written as {yaml:?} is refused: {e}"),
        }
    }
    if let (Ok(doc), Ok(standalone)) = (serde_yaml_ng::from_str::<StandaloneDoc>(text), &standalone)
    {
        let yaml = serde_yaml_ng::to_string(&doc).expect("a document writes as YAML");
        match parse_standalone_str("again.yaml", &yaml, &none) {
            Ok(again) => assert_eq!(&again, standalone, "{yaml}"),
            Err(e) => panic!("the document written as {yaml:?} is refused: {e}"),
        }
    }
}

/// Overrides over a document. The input's lines: `CAPYCTL_SET__...=value` lines are variables,
/// `--set key=value` lines arguments, the others the document (standalone, host and server;
/// also none). Errors print; overrides that apply to a document apply the same to the empty
/// document's defaults when the document is empty.
pub fn overrides(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut sets = Vec::new();
    let mut env = Vec::new();
    let mut doc = String::new();
    for line in text.split('\n') {
        if let Some(set) = line.strip_prefix("--set ") {
            sets.push(set);
        } else if line.starts_with("CAPYCTL_SET__")
            && let Some((name, value)) = line.split_once('=')
        {
            env.push((name, value));
        } else {
            doc.push_str(line);
            doc.push('\n');
        }
    }
    let overrides = match Overrides::from_args_and_env(&sets, env) {
        Ok(o) => o,
        Err(e) => return drop(e.to_string()),
    };
    let standalone = documents::standalone_from_overrides(&overrides);
    let server = documents::server_from_overrides(&overrides);
    if let Err(e) = &standalone {
        drop(e.to_string());
    }
    if let Err(e) = &server {
        drop(e.to_string());
    }
    let results = [
        parse_standalone_str("fuzz.yaml", &doc, &overrides).map(drop),
        parse_host_str("fuzz.yaml", &doc, &overrides).map(drop),
        parse_server_str("fuzz.yaml", &doc, &overrides).map(drop),
    ];
    for result in results {
        if let Err(e) = result {
            drop(e.to_string());
        }
    }
    // An empty mapping for a document is the defaults.
    assert_eq!(
        parse_standalone_str("empty.yaml", "{}", &overrides).ok(),
        standalone.ok()
    );
    assert_eq!(
        parse_server_str("empty.yaml", "{}", &overrides).ok(),
        server.ok()
    );
}
