//! Validating deserializers used by the documents (`deserialize_with`). The checks run inside
//! serde visitors, so a refused value's error carries the line of the value for free.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserializer;
use serde::de::{self, MapAccess, SeqAccess, Visitor};

use crate::settings::{self, Bounds};
use crate::units::{ByteSize, DurationSetting};

/// A check that deserializes one value.
trait Check<'de>: Sized {
    type Value;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error>;
}

struct OptionOf<C>(C);

impl<'de, C: Check<'de>> Visitor<'de> for OptionOf<C> {
    type Value = Option<C::Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an optional value")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.run(d).map(Some)
    }
}

fn opt<'de, D: Deserializer<'de>, C: Check<'de>>(d: D, c: C) -> Result<Option<C::Value>, D::Error> {
    d.deserialize_option(OptionOf(c))
}

fn out_of_range<E: de::Error>(value: impl fmt::Display, range: impl fmt::Display) -> E {
    E::custom(format!("{value} is out of range ({range})"))
}

// ---- durations ----

struct DurationIn(&'static Bounds<Duration>);

impl Visitor<'_> for DurationIn {
    type Value = DurationSetting;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a duration from {}", self.0)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let d: DurationSetting = v.parse().map_err(E::custom)?;
        if self.0.contains(d.as_duration()) {
            Ok(d)
        } else {
            Err(out_of_range(d, self.0))
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Err(E::custom(crate::units::UnitError::NotADuration(
            v.to_string(),
        )))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Err(E::custom(crate::units::UnitError::NotADuration(
            v.to_string(),
        )))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Err(E::custom(crate::units::UnitError::NotADuration(
            v.to_string(),
        )))
    }
}

impl<'de> Check<'de> for DurationIn {
    type Value = DurationSetting;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

// ---- integers ----

struct U32In(&'static Bounds<u32>);

impl Visitor<'_> for U32In {
    type Value = u32;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an integer from {}", self.0)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        match u32::try_from(v) {
            Ok(n) if self.0.contains(n) => Ok(n),
            _ => Err(out_of_range(v, self.0)),
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(n) => self.visit_u64(n),
            Err(_) => Err(out_of_range(v, self.0)),
        }
    }
}

impl<'de> Check<'de> for U32In {
    type Value = u32;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// Any `i32` (a deployment's `priority`).
struct I32;

impl Visitor<'_> for I32 {
    type Value = i32;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an integer from {} to {}", i32::MIN, i32::MAX)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        i32::try_from(v).map_err(|_| out_of_range(v, format_args!("{} to {}", i32::MIN, i32::MAX)))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        i32::try_from(v).map_err(|_| out_of_range(v, format_args!("{} to {}", i32::MIN, i32::MAX)))
    }
}

impl<'de> Check<'de> for I32 {
    type Value = i32;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

// ---- byte sizes ----

struct BytesIn(&'static Bounds<ByteSize>);

impl BytesIn {
    fn check<E: de::Error>(&self, b: ByteSize) -> Result<ByteSize, E> {
        if self.0.contains(b) {
            Ok(b)
        } else {
            Err(out_of_range(b, self.0))
        }
    }
}

impl Visitor<'_> for BytesIn {
    type Value = ByteSize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a byte size from {}", self.0)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let b: ByteSize = v.parse().map_err(E::custom)?;
        self.check(b)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        self.check(ByteSize::bytes(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(n) => self.visit_u64(n),
            Err(_) => Err(out_of_range(v, self.0)),
        }
    }
}

impl<'de> Check<'de> for BytesIn {
    type Value = ByteSize;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// Any size above zero.
const NONZERO_BYTES: Bounds<ByteSize> = Bounds {
    min: ByteSize::bytes(1),
    max: ByteSize::bytes(u64::MAX),
};

struct NonZeroBytes;

impl<'de> Check<'de> for NonZeroBytes {
    type Value = ByteSize;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte size such as 40GiB")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                let b: ByteSize = v.parse().map_err(E::custom)?;
                self.visit_u64(b.as_u64())
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                if NONZERO_BYTES.contains(ByteSize::bytes(v)) {
                    Ok(ByteSize::bytes(v))
                } else {
                    Err(E::custom("a size of 0 bytes is not allowed"))
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                match u64::try_from(v) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(crate::units::UnitError::NotAByteSize(
                        v.to_string(),
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

// ---- strings ----

/// A string checked by a function returning the refusal message.
struct Text {
    expecting: &'static str,
    check: fn(&str) -> Result<(), String>,
}

impl Visitor<'_> for Text {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        (self.check)(v).map_err(E::custom)?;
        Ok(v.to_string())
    }
}

impl<'de> Check<'de> for Text {
    type Value = String;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

/// Whether `name` is a DNS-1123 label: at most 63 of `a-z`, `0-9`, `-`, starting and ending with
/// a letter or digit.
pub fn is_dns_label(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.first() != Some(&b'-')
        && b.last() != Some(&b'-')
}

pub(crate) fn check_dns_label(name: &str) -> Result<(), String> {
    if is_dns_label(name) {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is not a valid name: use 1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit"
        ))
    }
}

fn check_non_empty(s: &str) -> Result<(), String> {
    if s.trim().is_empty() {
        Err("must not be empty".to_string())
    } else {
        Ok(())
    }
}

fn check_host_id(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 253 || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Err(format!(
            "`{s}` is not a valid host ID: use 1 to 253 characters without spaces"
        ))
    } else {
        Ok(())
    }
}

// ---- lists and maps ----

/// A list of strings checked as a whole.
struct StringList {
    expecting: &'static str,
    check: fn(&[String]) -> Result<(), String>,
}

impl<'de> Visitor<'de> for StringList {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(s) = seq.next_element::<String>()? {
            out.push(s);
        }
        (self.check)(&out).map_err(de::Error::custom)?;
        Ok(out)
    }
}

impl<'de> Check<'de> for StringList {
    type Value = Vec<String>;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

fn check_command(cmd: &[String]) -> Result<(), String> {
    match cmd.first() {
        None => Err("must name a program: give at least one item".to_string()),
        Some(p) if p.trim().is_empty() => {
            Err("the program (first item) must not be empty".to_string())
        }
        Some(_) => Ok(()),
    }
}

fn check_options(options: &[String]) -> Result<(), String> {
    if options.len() < 2 {
        return Err(format!(
            "a decision needs at least 2 options, found {}",
            options.len()
        ));
    }
    let mut seen = BTreeSet::new();
    for o in options {
        if o.is_empty() {
            return Err("options must not be empty strings".to_string());
        }
        if !seen.insert(o.as_str()) {
            return Err(format!(
                "option `{o}` is listed twice; options must be distinct"
            ));
        }
    }
    Ok(())
}

/// Environment variables: names non-empty, without `=` or NUL; values strings.
struct EnvMap;

impl<'de> Visitor<'de> for EnvMap {
    type Value = BTreeMap<String, String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping of environment variable names to strings")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(k) = map.next_key::<String>()? {
            if k.is_empty() || k.contains(['=', '\0']) {
                return Err(de::Error::custom(format!(
                    "`{k}` is not a valid environment variable name"
                )));
            }
            let v: String = map.next_value()?;
            out.insert(k, v);
        }
        Ok(out)
    }
}

impl<'de> Check<'de> for EnvMap {
    type Value = BTreeMap<String, String>;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

// ---- socket addresses ----

struct Addr;

impl Visitor<'_> for Addr {
    type Value = SocketAddr;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a socket address such as 127.0.0.1:8080 or [::1]:8080")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        v.trim().parse().map_err(|_| {
            E::custom(format!(
                "`{v}` is not a socket address: use IP:PORT, e.g. 127.0.0.1:8080 or [::1]:8080"
            ))
        })
    }
}

impl<'de> Check<'de> for Addr {
    type Value = SocketAddr;
    fn run<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

// ---- the functions named by `deserialize_with` ----

macro_rules! opt_fns {
    ($($name:ident: $ty:ty = $check:expr;)+) => {
        $(
            pub(crate) fn $name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<$ty>, D::Error> {
                opt(d, $check)
            }
        )+
    };
}

opt_fns! {
    admission_window: DurationSetting = DurationIn(&settings::ADMISSION_WINDOW_BOUNDS);
    request_deadline: DurationSetting = DurationIn(&settings::REQUEST_DEADLINE_BOUNDS);
    stream_idle_timeout: DurationSetting = DurationIn(&settings::STREAM_IDLE_TIMEOUT_BOUNDS);
    drain_timeout: DurationSetting = DurationIn(&settings::DRAIN_TIMEOUT_BOUNDS);
    wake_timeout: DurationSetting = DurationIn(&settings::WAKE_TIMEOUT_BOUNDS);
    idle_timeout: DurationSetting = DurationIn(&settings::IDLE_TIMEOUT_BOUNDS);
    max_pending_per_deployment: u32 = U32In(&settings::MAX_PENDING_PER_DEPLOYMENT_BOUNDS);
    max_pending_total: u32 = U32In(&settings::MAX_PENDING_TOTAL_BOUNDS);
    max_concurrent_requests: u32 = U32In(&settings::MAX_CONCURRENT_REQUESTS_BOUNDS);
    replicas: u32 = U32In(&settings::REPLICAS_BOUNDS);
    scale_min: u32 = U32In(&settings::SCALE_MIN_BOUNDS);
    target_in_flight: u32 = U32In(&settings::TARGET_IN_FLIGHT_BOUNDS);
    scale_down_delay: DurationSetting = DurationIn(&settings::SCALE_DOWN_DELAY_BOUNDS);
    gpus_per_instance: u32 = U32In(&settings::GPUS_PER_INSTANCE_BOUNDS);
    priority: i32 = I32;
    max_buffered_bytes_total: ByteSize = BytesIn(&settings::MAX_BUFFERED_BYTES_TOTAL_BOUNDS);
    nonzero_bytes_opt: ByteSize = NonZeroBytes;
    socket_addr: SocketAddr = Addr;
    host_id: String = Text { expecting: "a host ID", check: check_host_id };
    non_empty_opt: String = Text { expecting: "a non-empty string", check: check_non_empty };
    command: Vec<String> = StringList { expecting: "a list of strings: the program and its first arguments", check: check_command };
    env_opt: BTreeMap<String, String> = EnvMap;
}

pub(crate) fn dns_label<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Text {
        expecting: "a name (a DNS-1123 label)",
        check: check_dns_label,
    }
    .run(d)
}

pub(crate) fn non_empty<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Text {
        expecting: "a non-empty string",
        check: check_non_empty,
    }
    .run(d)
}

pub(crate) fn max_loaded<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    U32In(&settings::ADAPTERS_MAX_LOADED_BOUNDS).run(d)
}

pub(crate) fn max_rank<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    U32In(&settings::ADAPTERS_MAX_RANK_BOUNDS).run(d)
}

pub(crate) fn nonzero_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<ByteSize, D::Error> {
    NonZeroBytes.run(d)
}

pub(crate) fn options<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    StringList {
        expecting: "a list of at least 2 distinct options",
        check: check_options,
    }
    .run(d)
}

pub(crate) fn env<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    EnvMap.run(d)
}

pub(crate) fn path<'de, D: Deserializer<'de>>(d: D) -> Result<std::path::PathBuf, D::Error> {
    non_empty(d).map(std::path::PathBuf::from)
}

pub(crate) fn path_opt<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<std::path::PathBuf>, D::Error> {
    non_empty_opt(d).map(|p| p.map(std::path::PathBuf::from))
}
