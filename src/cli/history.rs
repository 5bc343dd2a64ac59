//! `gpuguard history`: what the flight recorder kept (`src/history`), read-only, for any user
//! that can read the history directory, whether the daemon runs or not. `--at` prints the status
//! as it was (the same table and JSON as `status`); a time range draws host RAM and each GPU's
//! free memory over time with the floors and the actions marked, then lists the events; `--json`
//! (records, one per line) and `--csv` (samples) are for scripts.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use super::status::render;
use super::{exit, WIDTH};
use crate::config::Config;
use crate::history::{self, Record};
use crate::kinds::Severity;
use crate::snapshot::printable;
use crate::status::StatusReport;
use crate::units::fmt_bytes;

#[derive(Args)]
pub struct HistoryArgs {
    /// The status as it was at TIME (the latest sample at or before it).
    #[arg(long, conflicts_with_all = ["since", "until"])]
    at: Option<String>,
    /// From TIME (default: 1h ago). TIME: RFC 3339 ("2026-11-26T07:30:00Z", an offset), local
    /// time ("2026-11-26 07:30", "07:30" today), "now", or relative ("30m ago", "2h ago").
    #[arg(long)]
    since: Option<String>,
    /// Up to TIME (default: now).
    #[arg(long)]
    until: Option<String>,
    /// Only this GPU in the chart and CSV.
    #[arg(long)]
    gpu: Option<u32>,
    /// One model: its RAM and GPU memory against its budgets (instead of the free memory), its
    /// actions and the events that name it.
    #[arg(long)]
    model: Option<String>,
    /// Print records as JSON, one per line (with --at: the status report as `status --json`).
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print the samples as CSV (time, RAM and each GPU's figures).
    #[arg(long)]
    csv: bool,
    /// The config file whose `daemon.state_dir` holds the history.
    #[arg(long, short, default_value = "/etc/gpuguard/config.toml")]
    config: PathBuf,
    /// The history directory itself (overrides --config).
    #[arg(long)]
    dir: Option<PathBuf>,
}

pub fn run(args: HistoryArgs) -> u8 {
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => match Config::load(&args.config) {
            Ok(c) => c.daemon.state_dir.join(history::DIR),
            // No config file: the default state directory.
            Err(_) if !args.config.exists() => crate::config::DaemonConfig::default()
                .state_dir
                .join(history::DIR),
            // A config only root may read (webhook secrets): the default state directory.
            Err(_) if std::fs::File::open(&args.config).is_err() => {
                let dir = crate::config::DaemonConfig::default()
                    .state_dir
                    .join(history::DIR);
                eprintln!(
                    "gpuguard: cannot read {}: reading {} (--dir to choose)",
                    args.config.display(),
                    dir.display()
                );
                dir
            }
            Err(e) => {
                eprintln!("gpuguard: {e}");
                return exit::CONFIG;
            }
        },
    };
    let now = history::now_ms();
    let (at, since, until) = match (
        args.at.is_some().then(|| time_flag("at", &args.at, 0, now)),
        time_flag("since", &args.since, now.saturating_sub(3_600_000), now),
        time_flag("until", &args.until, now, now),
    ) {
        (Some(Err(e)), ..) | (_, Err(e), _) | (_, _, Err(e)) => {
            eprintln!("gpuguard: {e}");
            return exit::CONFIG;
        }
        (at, Ok(since), Ok(until)) => (at.map(Result::unwrap), since, until),
    };
    if since > until && at.is_none() {
        eprintln!("gpuguard: --since is after --until");
        return exit::CONFIG;
    }
    // One segment in memory at a time: only what is asked for is kept.
    let mut latest: Option<(u64, Box<StatusReport>)> = None;
    let mut kept: Vec<Record> = Vec::new();
    let read = visit(&dir, |r| match (at, r) {
        (Some(at), Record::Sample { at_ms, status, .. }) if at_ms <= at => {
            latest = Some((at_ms, status));
        }
        (Some(_), _) => {}
        (None, mut r) if (since..=until).contains(&r.at_ms()) => {
            // The policy's input is printed by --json only (the chart draws the status).
            if let (false, Record::Sample { input, .. }) = (args.json, &mut r) {
                *input = None;
            }
            kept.push(r)
        }
        (None, _) => {}
    });
    if let Err(code) = read {
        return code;
    }
    if let Some(at) = at {
        let Some((taken, status)) = latest else {
            eprintln!(
                "gpuguard: no sample at or before {} in {}",
                local(at),
                dir.display()
            );
            return exit::FAILURE;
        };
        if args.json {
            println!(
                "{}",
                serde_json::to_string(&status).expect("a report serializes")
            );
        } else {
            println!(
                "as recorded at {} ({})",
                local(taken),
                history::format_ms(taken)
            );
            show(&render(&status));
        }
        return exit::OK;
    }
    let records: Vec<&Record> = kept.iter().collect();
    if args.json {
        for r in records {
            println!("{}", serde_json::to_string(r).expect("a record serializes"));
        }
    } else if args.csv {
        show(&csv(&records, args.gpu, args.model.as_deref()));
    } else {
        show(&chart(
            &records,
            args.gpu,
            args.model.as_deref(),
            since,
            until,
            &dir,
        ));
    }
    exit::OK
}

/// Hands every record of the history in `dir` to `each` (`history::visit`); says on stderr
/// what could not be read, and fails with the exit code when the directory cannot be.
pub(super) fn visit(dir: &Path, each: impl FnMut(Record)) -> Result<(), u8> {
    match history::visit(dir, each) {
        Ok(warnings) => {
            for w in &warnings {
                eprintln!("gpuguard: warning: {}", printable(w));
            }
            Ok(())
        }
        Err(e) => {
            eprintln!(
                "gpuguard: cannot read the history in {}: {e}",
                dir.display()
            );
            Err(exit::FAILURE)
        }
    }
}

/// Prints what was read from the history directory line by line, its control characters
/// escaped: the daemon escapes the names processes chose when it samples them, but `--dir` may
/// point at files anyone wrote, and they must not rewrite the reader's terminal.
pub(super) fn show(text: &str) {
    print!("{}", shown(text));
}

fn shown(text: &str) -> String {
    text.lines()
        .map(|l| format!("{}\n", printable(l)))
        .collect()
}

/// The time `--FLAG TEXT` gives (Unix milliseconds), `default` when not given; the error names
/// the flag and what was given.
pub(super) fn time_flag(
    flag: &str,
    text: &Option<String>,
    default: u64,
    now_ms: u64,
) -> Result<u64, String> {
    match text {
        None => Ok(default),
        Some(t) => parse_time(t, now_ms).map_err(|e| format!("--{flag} '{t}': {e}")),
    }
}

/// Parses a time given on the command line into Unix milliseconds.
pub(super) fn parse_time(text: &str, now_ms: u64) -> Result<u64, String> {
    let t = text.trim();
    if t == "now" {
        return Ok(now_ms);
    }
    if let Some(ago) = t.strip_suffix(" ago").or_else(|| t.strip_suffix("ago")) {
        let d = crate::units::parse_duration(ago)?;
        return Ok(now_ms.saturating_sub(d.as_millis() as u64));
    }
    if let Ok(ts) = t.parse::<jiff::Timestamp>() {
        return Ok(ts.as_millisecond().max(0) as u64);
    }
    let tz = jiff::tz::TimeZone::system();
    let civil = t
        .parse::<jiff::civil::DateTime>()
        .or_else(|_| {
            let today = jiff::Timestamp::from_millisecond(now_ms as i64)
                .map_err(|e| e.to_string())?
                .to_zoned_datetime(tz.clone())
                .date();
            t.parse::<jiff::civil::Time>()
                .map(|time| today.to_datetime(time))
                .map_err(|e| e.to_string())
        })
        .map_err(|_| {
            "not a time: give RFC 3339, local \"YYYY-MM-DD HH:MM[:SS]\" or \"HH:MM\", \"now\" or \"30m ago\"".to_string()
        })?;
    let zoned = civil.to_zoned_datetime(tz).map_err(|e| e.to_string())?;
    Ok(zoned.timestamp().as_millisecond().max(0) as u64)
}

/// A Unix time in milliseconds in the local time zone, to the second.
pub(super) fn local(ms: u64) -> String {
    local_as(ms, "%Y-%m-%d %H:%M:%S %Z")
}

/// A Unix time in milliseconds in the local time zone, as `format` (strftime) writes it.
pub(super) fn local_as(ms: u64, format: &str) -> String {
    jiff::Timestamp::from_millisecond(ms as i64)
        .map(|t| {
            t.to_zoned_datetime(jiff::tz::TimeZone::system())
                .strftime(format)
                .to_string()
        })
        .unwrap_or_else(|_| history::format_ms(ms))
}

fn samples<'a>(records: &[&'a Record]) -> Vec<(u64, &'a StatusReport)> {
    records
        .iter()
        .filter_map(|r| match r {
            Record::Sample { at_ms, status, .. } => Some((*at_ms, status.as_ref())),
            _ => None,
        })
        .collect()
}

/// The samples as CSV: time, RAM available and its floors, then per GPU free and used; with a
/// model, its use and budgets instead.
fn csv(records: &[&Record], only_gpu: Option<u32>, model: Option<&str>) -> String {
    let samples = samples(records);
    let n = |v: Option<u64>| v.map_or(String::new(), |b| b.to_string());
    if let Some(name) = model {
        let mut out = String::from(
            "time,model,state,ram_bytes,ram_budget_bytes,gpu_bytes,gpu_budget_bytes\n",
        );
        for (at, s) in samples {
            if let Some(m) = s.models.iter().find(|m| m.name == name) {
                let _ = writeln!(
                    out,
                    "{},{},{},{},{},{},{}",
                    history::format_ms(at),
                    m.name,
                    m.state,
                    m.ram_bytes,
                    n(m.ram_budget_bytes),
                    n(m.gpu_bytes),
                    n(m.gpu_budget_bytes)
                );
            }
        }
        return out;
    }
    let gpus: Vec<u32> = gpu_indices(&samples, only_gpu);
    let mut out = String::from(
        "time,ram_available_bytes,ram_total_bytes,ram_warn_bytes,ram_min_bytes,ram_level",
    );
    for g in &gpus {
        let _ = write!(
            out,
            ",gpu{g}_free_bytes,gpu{g}_used_bytes,gpu{g}_warn_free_bytes,gpu{g}_min_free_bytes,gpu{g}_level"
        );
    }
    out.push('\n');
    for (at, s) in samples {
        let m = &s.memory;
        let _ = write!(
            out,
            "{},{},{},{},{},{}",
            history::format_ms(at),
            n(m.host.available_bytes),
            n(m.host.total_bytes),
            n(m.warn_available_bytes),
            n(m.min_available_bytes),
            m.level
        );
        for g in &gpus {
            match s.gpus.iter().find(|r| r.index == *g) {
                Some(r) => {
                    let _ = write!(
                        out,
                        ",{},{},{},{},{}",
                        n(r.free_bytes),
                        n(r.used_bytes),
                        n(r.warn_free_bytes),
                        n(r.min_free_bytes),
                        r.level
                    );
                }
                None => out.push_str(",,,,,"),
            }
        }
        out.push('\n');
    }
    out
}

fn gpu_indices(samples: &[(u64, &StatusReport)], only: Option<u32>) -> Vec<u32> {
    let mut gpus: Vec<u32> = samples
        .iter()
        .flat_map(|(_, s)| s.gpus.iter().map(|g| g.index))
        .filter(|i| only.is_none_or(|o| o == *i))
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    gpus
}

/// Rows of the chart at most (each the lowest figures of its stretch of time).
const ROWS: usize = 30;
/// Width of one bar.
const BAR: usize = 24;
/// Columns drawn side by side (RAM and two GPUs; more GPUs go in further blocks).
const COLUMNS_PER_BLOCK: usize = 3;

/// A bar of `width` for `free` of `total`, with the floors marked: `|` the warn floor, `!` the
/// act floor (`min`), `#` what is free.
fn bar(
    width: usize,
    free: Option<u64>,
    total: Option<u64>,
    warn: Option<u64>,
    min: Option<u64>,
) -> String {
    let (Some(free), Some(total)) = (free, total.filter(|&t| t > 0)) else {
        return format!("{:width$}", "?");
    };
    let cell = |b: u64| ((b as f64 / total as f64) * width as f64).round() as usize;
    let filled = cell(free).min(width);
    let mut s: Vec<char> = (0..width)
        .map(|i| if i < filled { '#' } else { '.' })
        .collect();
    for (floor, mark) in [(warn, '|'), (min, '!')] {
        if let Some(f) = floor {
            s[cell(f).min(width - 1)] = mark;
        }
    }
    s.into_iter().collect()
}

/// What a column reads of a sample.
type Reader = Box<dyn Fn(&StatusReport) -> Option<Figure>>;

/// One column of the chart: a figure of each sample drawn as a bar of `scale`, with two marks.
struct Column {
    title: String,
    /// The figure, its scale (the bar's full width) and the two marks (`|` and `!`).
    read: Reader,
    /// Each row shows the lowest figure of its stretch (free memory), else the highest (use).
    lowest: bool,
}

struct Figure {
    value: u64,
    scale: Option<u64>,
    marks: (Option<u64>, Option<u64>),
}

/// The columns: host RAM and each GPU's free memory against the floors (`|` warn, `!` act), or
/// with a model, its RAM and GPU memory against its budgets (`!`).
fn columns(samples: &[(u64, &StatusReport)], gpu: Option<u32>, model: Option<&str>) -> Vec<Column> {
    if let Some(name) = model {
        let name = name.to_string();
        let model = move |s: &StatusReport| s.models.iter().find(|m| m.name == name).cloned();
        let (m1, m2) = (model.clone(), model);
        let peak_gpu: u64 = samples
            .iter()
            .filter_map(|(_, s)| m1(s)?.gpu_bytes)
            .max()
            .unwrap_or(0);
        let peak_ram: u64 = samples
            .iter()
            .filter_map(|(_, s)| Some(m1(s)?.ram_bytes))
            .max()
            .unwrap_or(0);
        let m3 = m1.clone();
        return vec![
            Column {
                title: "model RAM used".into(),
                read: Box::new(move |s| {
                    let m = m3(s)?;
                    Some(Figure {
                        value: m.ram_bytes,
                        scale: Some(peak_ram.max(m.ram_budget_bytes.unwrap_or(0))),
                        marks: (None, m.ram_budget_bytes),
                    })
                }),
                lowest: false,
            },
            Column {
                title: "model GPU used".into(),
                read: Box::new(move |s| {
                    let m = m2(s)?;
                    Some(Figure {
                        value: m.gpu_bytes?,
                        scale: Some(peak_gpu.max(m.gpu_budget_bytes.unwrap_or(0))),
                        marks: (None, m.gpu_budget_bytes),
                    })
                }),
                lowest: false,
            },
        ];
    }
    let mut out = vec![Column {
        title: "RAM available".into(),
        read: Box::new(|s| {
            let m = &s.memory;
            Some(Figure {
                value: m.host.available_bytes?,
                scale: m.host.total_bytes,
                marks: (m.warn_available_bytes, m.min_available_bytes),
            })
        }),
        lowest: true,
    }];
    for g in gpu_indices(samples, gpu) {
        out.push(Column {
            title: format!("GPU {g} free"),
            read: Box::new(move |s| {
                let r = s.gpus.iter().find(|r| r.index == g)?;
                Some(Figure {
                    value: r.free_bytes?,
                    scale: r.total_bytes,
                    marks: (r.warn_free_bytes, r.min_free_bytes),
                })
            }),
            lowest: true,
        });
    }
    out
}

/// Host RAM and each GPU's free memory (or one model's use) over time, one row per stretch of
/// time (its lowest free memory, or its highest use), floors or budgets marked, `*` where
/// actions were taken; then the events and actions.
fn chart(
    records: &[&Record],
    gpu: Option<u32>,
    model: Option<&str>,
    since: u64,
    until: u64,
    dir: &Path,
) -> String {
    let samples = samples(records);
    let mut out = String::new();
    let about_model = |text: &str| model.is_none_or(|m| text.contains(&format!("'{m}'")));
    if samples.is_empty() {
        let _ = writeln!(
            out,
            "no samples from {} to {} in {}",
            local(since),
            local(until),
            dir.display()
        );
    } else {
        let columns = columns(&samples, gpu, model);
        let first = samples[0].0;
        let last = samples[samples.len() - 1].0;
        // (A clock stepped back can put a later sample before an earlier one.)
        let step = (last.saturating_sub(first) / ROWS as u64).max(1);
        let actions: Vec<u64> = records
            .iter()
            .filter_map(|r| match r {
                Record::Action { at_ms, action } if about_model(&action.target) => Some(*at_ms),
                _ => None,
            })
            .collect();
        // At most three columns side by side, their bars as wide as 100 columns allow; more
        // GPUs are drawn in further blocks of the same rows.
        for (n, group) in columns.chunks(COLUMNS_PER_BLOCK).enumerate() {
            if n > 0 {
                out.push('\n');
            }
            let width = ((WIDTH - 19) / group.len())
                .saturating_sub(12)
                .clamp(8, BAR);
            let _ = write!(out, "{:19}", "time (local)");
            for c in group {
                let _ = write!(out, "  {:w$}", c.title, w = width + 10);
            }
            out.truncate(out.trim_end_matches(' ').len());
            out.push('\n');
            let mut i = 0;
            while i < samples.len() {
                let start = samples[i].0;
                let mut j = i;
                while j + 1 < samples.len() && samples[j + 1].0 < start + step {
                    j += 1;
                }
                let stretch = &samples[i..=j];
                let end = samples.get(j + 1).map_or(u64::MAX, |n| n.0);
                let acted = actions.iter().any(|&a| a >= start && a < end);
                let when = local_as(start, "%m-%d %H:%M:%S");
                let _ = write!(out, "{when:14}{:>5}", if acted { "*" } else { "" });
                for c in group {
                    let figures = stretch.iter().filter_map(|(_, s)| (c.read)(s));
                    let chosen = if c.lowest {
                        figures.min_by_key(|f| f.value)
                    } else {
                        figures.max_by_key(|f| f.value)
                    };
                    let _ = match chosen {
                        Some(f) => write!(
                            out,
                            "  {} {:>9}",
                            bar(width, Some(f.value), f.scale, f.marks.0, f.marks.1),
                            fmt_bytes(f.value)
                        ),
                        None => write!(out, "  {} {:>9}", bar(width, None, None, None, None), "?"),
                    };
                }
                out.push('\n');
                i = j + 1;
            }
        }
        let _ = writeln!(
            out,
            "{}, * actions taken; each row the {} of its {}s",
            if model.is_some() {
                "# used, ! budget"
            } else {
                "# free, | warn floor, ! act floor"
            },
            if model.is_some() { "highest" } else { "lowest" },
            (step / 1000).max(1)
        );
    }
    let notes: Vec<String> = records
        .iter()
        .filter_map(|r| match r {
            Record::Event {
                at_ms,
                severity,
                kind,
                message,
            } if (*severity != Severity::Info || kind == "daemon_started")
                && about_model(message) =>
            {
                Some(format!("{}  {severity:8} {kind}: {message}", local(*at_ms)))
            }
            Record::Action { at_ms, action } if about_model(&action.target) => Some(format!(
                "{}  action   {} {}: {} ({})",
                local(*at_ms),
                action.verb,
                action.target,
                action.reason,
                action.outcome
            )),
            Record::Start { at_ms, version, .. } => {
                Some(format!("{}  start    gpuguard {version}", local(*at_ms)))
            }
            Record::Stop { at_ms } => Some(format!("{}  stop     clean", local(*at_ms))),
            _ => None,
        })
        .collect();
    if !notes.is_empty() {
        out.push('\n');
        for n in notes {
            out.push_str(&n);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_in_every_form_a_user_types() {
        let now = 1_764_140_000_000; // 2025-11-26T06:53:20Z
        assert_eq!(parse_time("now", now), Ok(now));
        assert_eq!(parse_time("30m ago", now), Ok(now - 30 * 60_000));
        assert_eq!(parse_time("2h ago", now), Ok(now - 7_200_000));
        assert_eq!(
            parse_time("2025-11-26T06:00:00Z", now),
            Ok(1_764_136_800_000)
        );
        assert_eq!(
            parse_time("2025-11-26T07:00:00+01:00", now),
            Ok(1_764_136_800_000)
        );
        // Local forms depend on the machine's zone: they come back as that zone reads them.
        let local_form = parse_time("2025-11-26 06:00", now).unwrap();
        let zone = jiff::tz::TimeZone::system();
        let back = jiff::Timestamp::from_millisecond(local_form as i64)
            .unwrap()
            .to_zoned_datetime(zone)
            .strftime("%Y-%m-%d %H:%M")
            .to_string();
        assert_eq!(back, "2025-11-26 06:00");
        assert!(parse_time("yesterday-ish", now).is_err());
        assert!(parse_time("5 parsecs ago", now).is_err());
    }

    #[test]
    fn what_a_history_file_says_cannot_rewrite_the_terminal() {
        let forged = Record::Event {
            at_ms: 1_764_140_000_000,
            severity: Severity::Critical,
            kind: "x".into(),
            message: "\u{1b}[2J\u{1b}]0;owned\u{7}\r\u{202e}gnirts".into(),
        };
        let text = chart(&[&forged], None, None, 0, u64::MAX, Path::new("/x"));
        let out = shown(&text);
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(out.contains("\\u{1b}[2J"), "{out}");
        assert_eq!(out.lines().count(), text.lines().count());
    }

    /// RAM and eight GPUs over an hour: no line of the chart is wider than 100 columns (three
    /// columns a block, the bars as wide as that leaves), every GPU is drawn, every row of each
    /// block has the same width.
    #[test]
    fn the_chart_of_eight_gpus_fits_100_columns() {
        let g = 1u64 << 30;
        let mut status = StatusReport::default();
        status.memory.host.total_bytes = Some(64 * g);
        status.memory.host.available_bytes = Some(20 * g);
        status.gpus = (0..8)
            .map(|index| crate::status::GpuRow {
                index,
                total_bytes: Some(80 * g),
                free_bytes: Some(u64::from(index + 1) * 8 * g),
                ..Default::default()
            })
            .collect();
        let records: Vec<Record> = (0..60u64)
            .map(|minute| Record::Sample {
                at_ms: 1_764_140_000_000 + minute * 60_000,
                status: Box::new(status.clone()),
                input: None,
            })
            .collect();
        let refs: Vec<&Record> = records.iter().collect();
        let text = chart(&refs, None, None, 0, u64::MAX, Path::new("/x"));
        let widest = text.lines().map(|l| l.chars().count()).max().unwrap();
        assert!(widest <= 100, "{widest}:\n{text}");
        for index in 0..8 {
            assert!(text.contains(&format!("GPU {index} free")), "{text}");
        }
        // RAM + GPU 0 + GPU 1, then 2-4, then 5-7: three blocks, 100 columns at three a block.
        assert_eq!(text.matches("time (local)").count(), 3, "{text}");
        assert!(text.lines().any(|l| l.chars().count() == 100), "{text}");
    }

    /// Samples out of time order (the wall clock stepped back) draw, they do not panic.
    #[test]
    fn a_clock_stepped_back_still_draws() {
        let sample = |at_ms| Record::Sample {
            at_ms,
            status: Box::default(),
            input: None,
        };
        let (later, earlier) = (sample(1_764_140_060_000), sample(1_764_140_000_000));
        let text = chart(
            &[&later, &earlier],
            None,
            None,
            0,
            u64::MAX,
            Path::new("/x"),
        );
        assert!(text.starts_with("time (local)"), "{text}");
    }

    #[test]
    fn a_bar_marks_what_is_free_and_both_floors() {
        let g = 1 << 30;
        let b = bar(BAR, Some(12 * g), Some(24 * g), Some(6 * g), Some(3 * g));
        assert_eq!(b.chars().count(), BAR);
        assert_eq!(b.chars().filter(|&c| c == '#').count(), 12 - 2, "{b}");
        assert_eq!(b.find('|'), Some(6), "{b}");
        assert_eq!(b.find('!'), Some(3), "{b}");
        assert!(bar(BAR, None, Some(g), None, None).starts_with('?'));
    }
}
