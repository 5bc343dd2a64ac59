//! Units that appear in the config and in snapshots: byte sizes (absolute or a share of a total)
//! and human durations ("250ms", "10s"), each with a parse error that quotes the bad value.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Formats a byte count the way operators read it: `1.5 GiB`.
/// `fmt_bytes`, or `?` for a figure not known.
pub fn fmt_opt_bytes(bytes: Option<u64>) -> String {
    bytes.map_or_else(|| "?".into(), fmt_bytes)
}

pub fn fmt_bytes(bytes: u64) -> String {
    ByteSize(bytes).display().iec().to_string()
}

/// A memory amount from the config: an absolute size (`"4GiB"`, `"512MiB"`, `1073741824`) or a
/// share of the resource's total (`"10%"`), so one config fits cards and hosts of any size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Amount {
    Bytes(u64),
    Percent(f64),
}

impl Amount {
    /// The amount in bytes for a resource of `total` bytes (unknown total: a percentage is unknown).
    pub fn resolve(self, total: Option<u64>) -> Option<u64> {
        match self {
            Amount::Bytes(b) => Some(b),
            Amount::Percent(p) => total.map(|t| (t as f64 * p / 100.0) as u64),
        }
    }
}

impl FromStr for Amount {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if let Some(number) = t.strip_suffix('%') {
            return match number.trim().parse::<f64>() {
                Ok(p) if (0.0..=100.0).contains(&p) => Ok(Amount::Percent(p)),
                _ => Err(format!("'{text}' is not a percentage between 0% and 100%")),
            };
        }
        // bytesize reads "4G" as 4 GB (decimal); operators of GPU boxes mean GiB, so a bare
        // K/M/G/T suffix is taken as binary, as in `free -g` and systemd's MemoryMax=.
        let normalized = match t.char_indices().last() {
            Some((i, c)) if "KMGTkmgt".contains(c) && t[..i].trim().parse::<f64>().is_ok() => {
                format!("{}{}iB", &t[..i], c.to_ascii_uppercase())
            }
            _ => t.to_string(),
        };
        match normalized.parse::<ByteSize>() {
            Ok(size) if !t.is_empty() => Ok(Amount::Bytes(size.as_u64())),
            _ => Err(format!(
                "'{text}' is not a size (use e.g. \"4GiB\", \"512MiB\" or \"10%\")"
            )),
        }
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Amount::Bytes(b) => f.write_str(&fmt_bytes(*b)),
            Amount::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected a size such as \"4GiB\" or a share such as \"10%\"")
        })? {
            Raw::Int(b) => Ok(Amount::Bytes(b)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Serialize for Amount {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// Parses a human duration ("250ms", "10s", "2m").
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|_| format!("'{text}' is not a duration (use e.g. \"250ms\", \"10s\", \"2m\")"))
}

/// serde helpers for `Duration` fields written as human durations.
pub mod duration {
    use super::*;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)
            .map_err(|_| serde::de::Error::custom("expected a duration such as \"10s\""))?;
        parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_and_shares() {
        let gib = 1u64 << 30;
        let cases = [
            ("4GiB", Some(Amount::Bytes(4 * gib))),
            ("4G", Some(Amount::Bytes(4 * gib))),
            ("512MiB", Some(Amount::Bytes(512 << 20))),
            ("1.5 GiB", Some(Amount::Bytes(3 * gib / 2))),
            ("4GB", Some(Amount::Bytes(4_000_000_000))),
            ("10%", Some(Amount::Percent(10.0))),
            ("12X", None),
            ("", None),
            ("150%", None),
            ("-1%", None),
        ];
        for (text, want) in cases {
            assert_eq!(text.parse::<Amount>().ok(), want, "{text}");
        }
    }

    #[test]
    fn resolves_share_of_total() {
        assert_eq!(Amount::Percent(10.0).resolve(Some(1000)), Some(100));
        assert_eq!(Amount::Percent(10.0).resolve(None), None);
        assert_eq!(Amount::Bytes(7).resolve(None), Some(7));
    }

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").unwrap_err().contains("'soon'"));
    }
}
