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

/// Parses a human duration ("250ms", "10s", "2m", "1h 30m", "7days", "1.5h"; "0" alone): numbers
/// each followed by a unit (whitespace between them optional), in any order, added up. The grammar
/// humantime 2 parsed, kept as configs wrote it: ns (nsec, nanos), us (µs, usec), ms (msec,
/// millis), s (sec, secs, second, seconds), m (min, mins, minute, minutes), h (hr, hrs, hour,
/// hours), d (day, days), w (wk, wks, week, weeks), M (month, months: 30.44 days), y (yr, yrs,
/// year, years: 365.25 days); a fraction must come out in whole nanoseconds (whole seconds from
/// hours up).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let parsed = if t == "0" {
        Some(Duration::ZERO)
    } else {
        sum_of_items(t)
    };
    parsed
        .ok_or_else(|| format!("'{text}' is not a duration (use e.g. \"250ms\", \"10s\", \"2m\")"))
}

/// `parse_duration` past "0": `None` for anything else than items.
fn sum_of_items(text: &str) -> Option<Duration> {
    let unit_char = |c: char| c.is_ascii_alphabetic() || c == 'µ';
    let mut chars = text.chars().peekable();
    let mut total = None;
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return total; // `None` if there was nothing
        }
        chars.peek()?.is_ascii_digit().then_some(())?;
        // The number: digits (whitespace between them ignored), then a fraction's.
        let (mut whole, mut numerator, mut denominator) = (0u64, 0u64, 1u64);
        let mut fraction = false;
        while let Some(c) = chars.next_if(|c| !unit_char(*c)) {
            match c.to_digit(10) {
                Some(d) if fraction => {
                    numerator = numerator.checked_mul(10)?.checked_add(d.into())?;
                    denominator = denominator.checked_mul(10)?;
                }
                Some(d) => whole = whole.checked_mul(10)?.checked_add(d.into())?,
                None if c.is_whitespace() => {}
                None if c == '.' && !fraction => fraction = true,
                None => return None,
            }
        }
        if fraction && denominator == 1 {
            return None; // "1." has no digits after the point
        }
        let mut unit = String::new();
        while let Some(c) = chars.next_if(|c| unit_char(*c)) {
            unit.push(c);
        }
        // (seconds, nanoseconds) per unit.
        let (secs_per, nanos_per): (u64, u64) = match unit.as_str() {
            "nanos" | "nsec" | "ns" => (0, 1),
            "usec" | "us" | "µs" => (0, 1_000),
            "millis" | "msec" | "ms" => (0, 1_000_000),
            "seconds" | "second" | "secs" | "sec" | "s" => (1, 0),
            "minutes" | "minute" | "min" | "mins" | "m" => (60, 0),
            "hours" | "hour" | "hr" | "hrs" | "h" => (3600, 0),
            "days" | "day" | "d" => (86_400, 0),
            "weeks" | "week" | "wk" | "wks" | "w" => (7 * 86_400, 0),
            "months" | "month" | "M" => (2_630_016, 0),
            "years" | "year" | "yr" | "yrs" | "y" => (31_557_600, 0),
            _ => return None,
        };
        let whole = Duration::from_secs(whole.checked_mul(secs_per)?)
            .checked_add(Duration::from_nanos(whole.checked_mul(nanos_per)?))?;
        // A fraction of an hour and up in whole seconds, of less in whole nanoseconds.
        let exact = |per: u64| {
            let scaled = numerator.checked_mul(per)?;
            (scaled % denominator == 0).then_some(scaled / denominator)
        };
        let part = match (fraction, secs_per) {
            (false, _) => Duration::ZERO,
            (true, 3600..) => Duration::from_secs(exact(secs_per)?),
            (true, _) if nanos_per == 1 => return None,
            (true, _) => Duration::from_nanos(exact(secs_per * 1_000_000_000 + nanos_per)?),
        };
        total = Some(
            total
                .unwrap_or_default()
                .checked_add(whole)?
                .checked_add(part)?,
        );
    }
}

/// A duration as the messages and `status` write it: its non-zero parts, largest first, as
/// `parse_duration` reads them back ("1h 30m", "2days 3h", "1s 500ms", "0s"; a year is 365.25
/// days and a month 30.44, as there).
pub fn fmt_duration(d: Duration) -> FmtDuration {
    FmtDuration(d)
}

/// `fmt_duration`'s `Display`.
#[derive(Clone, Copy, Debug)]
pub struct FmtDuration(Duration);

impl fmt::Display for FmtDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (secs, nanos) = (self.0.as_secs(), u64::from(self.0.subsec_nanos()));
        if secs == 0 && nanos == 0 {
            return f.write_str("0s");
        }
        let in_year = secs % 31_557_600;
        let in_month = in_year % 2_630_016;
        let in_day = in_month % 86_400;
        let parts = [
            (secs / 31_557_600, "year"),
            (in_year / 2_630_016, "month"),
            (in_month / 86_400, "day"),
            (in_day / 3600, "h"),
            (in_day % 3600 / 60, "m"),
            (in_day % 60, "s"),
            (nanos / 1_000_000, "ms"),
            (nanos / 1000 % 1000, "us"),
            (nanos % 1000, "ns"),
        ];
        let mut sep = "";
        for (i, (value, name)) in parts.into_iter().enumerate() {
            if value > 0 {
                // The first three take a plural ("2days").
                let plural = if i < 3 && value > 1 { "s" } else { "" };
                write!(f, "{sep}{value}{name}{plural}")?;
                sep = " ";
            }
        }
        Ok(())
    }
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

    /// Every spelling the config, the docs and the tests use, and the corners of the grammar,
    /// read as humantime 2.4 read them (the values are its own; 3 million random strings of
    /// these pieces were compared with it when it was replaced, none read differently).
    #[test]
    fn every_duration_spelling_reads_as_it_always_has() {
        let (s, ms, ns) = (
            Duration::from_secs,
            Duration::from_millis,
            Duration::from_nanos,
        );
        let table = [
            // config.example.toml, docs/, tests/
            ("30s", s(30)),
            ("10s", s(10)),
            ("100ms", ms(100)),
            ("250ms", ms(250)),
            ("2ms", ms(2)),
            ("5m", s(300)),
            ("10m", s(600)),
            ("30m", s(1800)),
            ("1h", s(3600)),
            ("24h", s(86_400)),
            ("7d", s(7 * 86_400)),
            ("7days", s(7 * 86_400)),
            ("1h 30m", s(5400)),
            ("1h30m", s(5400)),
            ("600s", s(600)),
            ("0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("  5m  ", s(300)),
            // the long names and their plurals
            ("5 sec", s(5)),
            ("5secs", s(5)),
            ("2 seconds", s(2)),
            ("1second", s(1)),
            ("3mins", s(180)),
            ("1 minute", s(60)),
            ("10min", s(600)),
            ("2hrs", s(7200)),
            ("1hr", s(3600)),
            ("2 hours", s(7200)),
            ("1day", s(86_400)),
            ("1week", s(7 * 86_400)),
            ("2wks", s(14 * 86_400)),
            ("1w", s(7 * 86_400)),
            ("100millis", ms(100)),
            ("5msec", ms(5)),
            ("5us", ns(5000)),
            ("5µs", ns(5000)),
            ("5usec", ns(5000)),
            ("5ns", ns(5)),
            ("5nsec", ns(5)),
            ("5nanos", ns(5)),
            // months and years at fixed lengths: 30.44 and 365.25 days
            ("1M", s(2_630_016)),
            ("3months", s(3 * 2_630_016)),
            ("1month", s(2_630_016)),
            ("1y", s(31_557_600)),
            ("2 years", s(2 * 31_557_600)),
            // fractions, in any unit but nanoseconds
            ("1.5h", s(5400)),
            ("1.5d", s(129_600)),
            ("0.5w", s(302_400)),
            ("1.5y", s(47_336_400)),
            ("1h 0.5m", s(3630)),
            ("1.5h 30m", s(7200)),
            ("1.5s", ms(1500)),
            ("0.1s", ms(100)),
            ("1.50s", ms(1500)),
            // any order, repeats added up, whitespace anywhere between items
            ("1d1h", s(90_000)),
            ("1h1d", s(90_000)),
            ("3h 2d", s(183_600)),
            ("5m5m", s(600)),
            ("500ms 1s", ms(1500)),
            ("1s500ms", ms(1500)),
            ("15days 2min 2s", s(1_296_122)),
            ("1 d 2 h", s(93_600)),
            ("5 m 3 s", s(303)),
            ("1\t h", s(3600)),
            ("01m", s(60)),
            ("1 0s", s(10)),
        ];
        for (text, want) in table {
            assert_eq!(parse_duration(text), Ok(want), "{text:?}");
            // What the messages print reads back as the same duration.
            let shown = fmt_duration(want).to_string();
            assert_eq!(
                parse_duration(&shown),
                Ok(want),
                "{text:?} shown as {shown:?}"
            );
        }
        let refused = [
            "",
            "5",
            "00",
            "soon",
            "1.",
            ".5s",
            "1ns.5",
            "0.5ns",
            "1h,30m",
            "1h, 30m",
            "-5m",
            "+5m",
            "5m ago",
            "PT1H",
            "1e3s",
            "1mo",
            "0.0001h",
            "0.3333333333s",
            "99999999999999999999s",
        ];
        for text in refused {
            assert!(
                parse_duration(text).is_err(),
                "{text:?} read as {:?}",
                parse_duration(text)
            );
        }
    }

    /// As humantime 2.4 wrote them (the messages and `status` kept their text).
    #[test]
    fn durations_are_written_as_they_always_were() {
        let table = [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_secs(90), "1m 30s"),
            (Duration::from_secs(3600), "1h"),
            (Duration::from_secs(5400), "1h 30m"),
            (Duration::from_secs(86_400), "1day"),
            (Duration::from_secs(7 * 86_400), "7days"),
            (Duration::from_secs(30 * 86_400), "30days"),
            (
                Duration::from_secs(400 * 86_400),
                "1year 1month 4days 7h 26m 24s",
            ),
            (Duration::from_millis(1500), "1s 500ms"),
            (Duration::from_millis(100), "100ms"),
            (Duration::from_nanos(1_001_001), "1ms 1us 1ns"),
        ];
        for (d, want) in table {
            assert_eq!(fmt_duration(d).to_string(), want, "{d:?}");
        }
    }
}
