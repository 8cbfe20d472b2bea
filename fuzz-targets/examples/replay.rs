//! Runs one target on files: `cargo run -p capyctl-fuzz-targets --example replay -- TARGET FILE...`
//! (a crash that a fuzz run left in `fuzz/artifacts/`, with a stable build's backtrace).

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_default();
    let Some(target) = capyctl_fuzz_targets::target(&name) else {
        eprintln!(
            "usage: replay TARGET FILE...; targets: {:?}",
            capyctl_fuzz_targets::TARGETS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
        );
        std::process::exit(2);
    };
    for file in args {
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{file}: {e}"));
        let started = std::time::Instant::now();
        target(&bytes);
        eprintln!("{file}: passed in {:?}", started.elapsed());
    }
}
