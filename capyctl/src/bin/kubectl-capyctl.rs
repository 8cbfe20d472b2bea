//! `kubectl-capyctl`: `capyctl` as a kubectl plugin (`kubectl capyctl ...`).

fn main() -> std::process::ExitCode {
    capyctl::main()
}
