//! `capyctl`: see the library.

fn main() -> std::process::ExitCode {
    capyctl::main()
}
