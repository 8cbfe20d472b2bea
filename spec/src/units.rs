//! Units used by settings and documents: durations (`500ms`, `2s`, `5m`, `1h`) and byte sizes
//! (`64MiB`, `40GiB`, `1GB`, `1048576`).
//!
//! Both types are written as strings in documents and in Kubernetes objects, and print back in a
//! canonical form (the largest unit that divides the value exactly), so a value read and written
//! again stays the same value.
//!
//! NB: a duration must carry a unit. A bare number such as `3600` is refused, because a reader
//! cannot tell seconds from milliseconds; write `3600s`. A byte size may be a bare number of bytes.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a duration or byte size could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// The text is not a duration.
    #[error(
        "`{0}` is not a duration: use a number followed by ms, s, m or h (e.g. 500ms, 2s, 5m, 1h)"
    )]
    NotADuration(String),
    /// The text is not a byte size.
    #[error(
        "`{0}` is not a byte size: use a number of bytes or a number followed by KiB, MiB, GiB, TiB, KB, MB, GB or TB (e.g. 64MiB)"
    )]
    NotAByteSize(String),
    /// The value does not fit the type.
    #[error("`{0}` is too large")]
    TooLarge(String),
}

/// A duration setting, written `<whole number><unit>` with unit `ms`, `s`, `m` or `h`.
///
/// Prints canonically with the largest unit that divides it exactly: `3600s` prints as `1h`,
/// `1500ms` as `1500ms`. Sub-millisecond precision is not representable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DurationSetting(Duration);

impl DurationSetting {
    /// A duration of `ms` milliseconds.
    pub const fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// A duration of `s` seconds.
    pub const fn from_secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }

    /// The duration as a [`std::time::Duration`].
    pub const fn as_duration(self) -> Duration {
        self.0
    }

    /// Whole milliseconds (saturating).
    pub fn as_millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }
}

impl From<Duration> for DurationSetting {
    /// Truncates to whole milliseconds.
    fn from(d: Duration) -> Self {
        Self::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

impl From<DurationSetting> for Duration {
    fn from(d: DurationSetting) -> Self {
        d.0
    }
}

/// Writes a duration canonically (`1h`, `30m`, `2s`, `500ms`).
pub fn format_duration(d: Duration) -> String {
    DurationSetting::from(d).to_string()
}

impl fmt::Display for DurationSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.as_millis();
        if ms == 0 {
            f.write_str("0s")
        } else if ms.is_multiple_of(3_600_000) {
            write!(f, "{}h", ms / 3_600_000)
        } else if ms.is_multiple_of(60_000) {
            write!(f, "{}m", ms / 60_000)
        } else if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

impl FromStr for DurationSetting {
    type Err = UnitError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let t = text.trim();
        let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (number, unit) = t.split_at(digits_end);
        if number.is_empty() {
            return Err(UnitError::NotADuration(text.to_string()));
        }
        let factor_ms: u64 = match unit {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return Err(UnitError::NotADuration(text.to_string())),
        };
        let n: u64 = number
            .parse()
            .map_err(|_| UnitError::TooLarge(text.to_string()))?;
        let ms = n
            .checked_mul(factor_ms)
            .ok_or_else(|| UnitError::TooLarge(text.to_string()))?;
        Ok(Self::from_millis(ms))
    }
}

impl Serialize for DurationSetting {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

struct DurationVisitor;

impl Visitor<'_> for DurationVisitor {
    type Value = DurationSetting;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration such as 500ms, 2s, 5m or 1h")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        v.parse().map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Err(E::custom(UnitError::NotADuration(v.to_string())))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Err(E::custom(UnitError::NotADuration(v.to_string())))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Err(E::custom(UnitError::NotADuration(v.to_string())))
    }
}

impl<'de> Deserialize<'de> for DurationSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DurationVisitor)
    }
}

impl JsonSchema for DurationSetting {
    fn schema_name() -> Cow<'static, str> {
        "DurationSetting".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^[0-9]+(ms|s|m|h)$",
        })
    }
}

const KIB: u64 = 1024;
const MIB: u64 = KIB * 1024;
const GIB: u64 = MIB * 1024;
const TIB: u64 = GIB * 1024;

/// A size in bytes, written as a bare number of bytes or `<whole number><unit>` with a binary
/// unit (`KiB`, `MiB`, `GiB`, `TiB`) or a decimal one (`KB`, `MB`, `GB`, `TB`; also `B`).
///
/// Prints canonically with the unit that divides it exactly and gives the smallest number
/// (binary on a tie: `1024` prints `1KiB`, `2000000000000` prints `2TB`), else as `<n>B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(u64);

impl ByteSize {
    /// `n` bytes.
    pub const fn bytes(n: u64) -> Self {
        Self(n)
    }

    /// `n` KiB.
    pub const fn kib(n: u64) -> Self {
        Self(n * KIB)
    }

    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        Self(n * MIB)
    }

    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        Self(n * GIB)
    }

    /// The size in bytes.
    pub const fn as_u64(self) -> u64 {
        self.0
    }
}

impl From<u64> for ByteSize {
    fn from(n: u64) -> Self {
        Self(n)
    }
}

impl From<ByteSize> for u64 {
    fn from(b: ByteSize) -> Self {
        b.0
    }
}

/// Writes a byte count canonically (`64MiB`, `1GB`, `100B`).
pub fn format_bytes(n: u64) -> String {
    ByteSize(n).to_string()
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        if n == 0 {
            return f.write_str("0B");
        }
        // The exact unit giving the smallest number; binary first on a tie.
        let best = [
            (TIB, "TiB"),
            (GIB, "GiB"),
            (MIB, "MiB"),
            (KIB, "KiB"),
            (1_000_000_000_000, "TB"),
            (1_000_000_000, "GB"),
            (1_000_000, "MB"),
            (1_000, "KB"),
        ]
        .into_iter()
        .filter(|(size, _)| n.is_multiple_of(*size))
        .min_by_key(|(size, _)| n / size);
        if let Some((size, unit)) = best {
            return write!(f, "{}{unit}", n / size);
        }
        write!(f, "{n}B")
    }
}

impl FromStr for ByteSize {
    type Err = UnitError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let t = text.trim();
        let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (number, unit) = t.split_at(digits_end);
        if number.is_empty() {
            return Err(UnitError::NotAByteSize(text.to_string()));
        }
        let factor: u64 = match unit {
            "" | "B" => 1,
            "KiB" => KIB,
            "MiB" => MIB,
            "GiB" => GIB,
            "TiB" => TIB,
            "KB" | "kB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "TB" => 1_000_000_000_000,
            _ => return Err(UnitError::NotAByteSize(text.to_string())),
        };
        let n: u64 = number
            .parse()
            .map_err(|_| UnitError::TooLarge(text.to_string()))?;
        n.checked_mul(factor)
            .map(Self)
            .ok_or_else(|| UnitError::TooLarge(text.to_string()))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

struct ByteSizeVisitor;

impl Visitor<'_> for ByteSizeVisitor {
    type Value = ByteSize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte size such as 64MiB, 40GiB or a number of bytes")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        v.parse().map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(ByteSize(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        u64::try_from(v)
            .map(ByteSize)
            .map_err(|_| E::custom(UnitError::NotAByteSize(v.to_string())))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Err(E::custom(UnitError::NotAByteSize(v.to_string())))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ByteSizeVisitor)
    }
}

impl JsonSchema for ByteSize {
    fn schema_name() -> Cow<'static, str> {
        "ByteSize".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": "^[0-9]+(B|KiB|MiB|GiB|TiB|KB|kB|MB|GB|TB)?$",
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_print_canonically() {
        for (text, ms, canon) in [
            ("500ms", 500, "500ms"),
            ("2s", 2000, "2s"),
            ("5m", 300_000, "5m"),
            ("1h", 3_600_000, "1h"),
            ("3600s", 3_600_000, "1h"),
            ("1800s", 1_800_000, "30m"),
            ("1500ms", 1500, "1500ms"),
            ("90s", 90_000, "90s"),
            (" 2s ", 2000, "2s"),
            ("0s", 0, "0s"),
        ] {
            let d: DurationSetting = text.parse().unwrap();
            assert_eq!(d.as_millis(), ms, "{text}");
            assert_eq!(d.to_string(), canon, "{text}");
            assert_eq!(canon.parse::<DurationSetting>().unwrap(), d);
        }
    }

    #[test]
    fn bad_durations_are_refused_clearly() {
        for text in ["2x", "", "s", "1.5s", "-1s", "2 s", "3600", "1d", "10 ms"] {
            let err = text.parse::<DurationSetting>().unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "`{text}` is not a duration: use a number followed by ms, s, m or h (e.g. 500ms, 2s, 5m, 1h)"
                )
            );
        }
        assert!(matches!(
            "99999999999999999999h".parse::<DurationSetting>(),
            Err(UnitError::TooLarge(_))
        ));
        assert!(matches!(
            "18446744073709551615h".parse::<DurationSetting>(),
            Err(UnitError::TooLarge(_))
        ));
    }

    #[test]
    fn bare_number_duration_is_refused_in_yaml() {
        let err = serde_yaml_ng::from_str::<DurationSetting>("3600").unwrap_err();
        assert!(
            err.to_string().contains("`3600` is not a duration"),
            "{err}"
        );
        let d: DurationSetting = serde_yaml_ng::from_str("\"3600s\"").unwrap();
        assert_eq!(d.as_duration(), Duration::from_secs(3600));
    }

    #[test]
    fn byte_sizes_parse_and_print_canonically() {
        for (text, bytes, canon) in [
            ("64MiB", 64 * MIB, "64MiB"),
            ("40GiB", 40 * GIB, "40GiB"),
            ("512KiB", 512 * KIB, "512KiB"),
            ("1TiB", TIB, "1TiB"),
            ("1024GiB", TIB, "1TiB"),
            ("1GB", 1_000_000_000, "1GB"),
            ("500MB", 500_000_000, "500MB"),
            ("1KB", 1000, "1KB"),
            ("1kB", 1000, "1KB"),
            ("2TB", 2_000_000_000_000, "2TB"),
            ("1048576", MIB, "1MiB"),
            ("100", 100, "100B"),
            ("100B", 100, "100B"),
            ("0", 0, "0B"),
        ] {
            let b: ByteSize = text.parse().unwrap();
            assert_eq!(b.as_u64(), bytes, "{text}");
            assert_eq!(b.to_string(), canon, "{text}");
            assert_eq!(canon.parse::<ByteSize>().unwrap(), b);
        }
    }

    #[test]
    fn bad_byte_sizes_are_refused_clearly() {
        for text in ["64M", "1.5GiB", "GiB", "", "-1", "64 MiB", "1gib"] {
            let err = text.parse::<ByteSize>().unwrap_err();
            assert!(
                err.to_string().starts_with(&format!(
                    "`{text}` is not a byte size: use a number of bytes"
                )),
                "{err}"
            );
        }
        assert!(matches!(
            "100000000TiB".parse::<ByteSize>(),
            Err(UnitError::TooLarge(_))
        ));
    }

    #[test]
    fn byte_size_accepts_a_bare_integer_in_yaml_and_serializes_as_string() {
        let b: ByteSize = serde_yaml_ng::from_str("1024").unwrap();
        assert_eq!(b, ByteSize::kib(1));
        assert_eq!(serde_json::to_string(&b).unwrap(), "\"1KiB\"");
        assert!(serde_yaml_ng::from_str::<ByteSize>("-5").is_err());
        assert_eq!(
            serde_json::to_string(&DurationSetting::from_secs(120)).unwrap(),
            "\"2m\""
        );
    }
}
