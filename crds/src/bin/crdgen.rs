//! Writes the CRD YAML of CapyCTL's custom resources into `charts/capyctl/crds/` (or the folder
//! given as the only argument). Run it as `cargo run -p capyctl-crds --bin crdgen` after changing
//! the types in `crds/src/lib.rs`; a test fails while the checked-in files differ.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(capyctl_crds::chart_crd_dir);
    let files = match capyctl_crds::crd_files() {
        Ok(files) => files,
        Err(e) => {
            eprintln!("crdgen: cannot write the CRDs as YAML: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("crdgen: cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    for (name, text) in files {
        let path = dir.join(name);
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("crdgen: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {}", path.display());
    }
    ExitCode::SUCCESS
}
