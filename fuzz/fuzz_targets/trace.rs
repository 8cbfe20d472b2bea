#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some(target) = capyctl_fuzz_targets::target("trace") {
        target(data);
    }
});
