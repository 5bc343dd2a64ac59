//! `gpuguard replay --config NEW.toml`: the flight recorder's samples through the real policy
//! with another config (`history::replay`), printed beside the actions that were taken: a table
//! of both sides by time (each action numbered, its target and reason listed under the table so
//! that the table fits 100 columns), what differs, and the floors and budgets the new config
//! would have crossed. `--json` for scripts. Read-only; works with the daemon down.

use std::path::PathBuf;

use clap::Args;

use super::exit;
use super::history::{local, local_as, show, time_flag, visit};
use crate::config::Config;
use crate::history::replay::{Replay, ReplayReport, Step};
use crate::history::{self};

#[derive(Args)]
pub struct ReplayArgs {
    /// The config to replay with (the one to try; its `daemon.state_dir` holds the history
    /// unless --dir says otherwise).
    #[arg(long, short)]
    config: PathBuf,
    /// From TIME (default: 24h ago). TIME: RFC 3339, local time ("2026-11-26 07:30", "07:30"
    /// today), "now", or relative ("30m ago").
    #[arg(long)]
    since: Option<String>,
    /// Up to TIME (default: now).
    #[arg(long)]
    until: Option<String>,
    /// The history directory (default: `history/` under the config's `daemon.state_dir`).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: ReplayArgs) -> u8 {
    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuguard: {e}");
            return exit::CONFIG;
        }
    };
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| config.daemon.state_dir.join(history::DIR));
    let now = history::now_ms();
    let (since, until) = match (
        time_flag(
            "since",
            &args.since,
            now.saturating_sub(24 * 3_600_000),
            now,
        ),
        time_flag("until", &args.until, now, now),
    ) {
        (Ok(s), Ok(u)) if s <= u => (s, u),
        (Ok(_), Ok(_)) => {
            eprintln!("gpuguard: --since is after --until");
            return exit::CONFIG;
        }
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("gpuguard: {e}");
            return exit::CONFIG;
        }
    };
    let mut replay = Replay::new(&config, since, until);
    if let Err(code) = visit(&dir, |r| replay.feed(r)) {
        return code;
    }
    let report = replay.finish();
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("a report serializes")
        );
    } else {
        let name = args.config.file_name().map_or_else(
            || args.config.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let heading = format!(
            "replay of {} from {} to {} with {}",
            dir.display(),
            local(since),
            local(until),
            args.config.display()
        );
        show(&render(&report, &heading, &name));
    }
    exit::OK
}

/// Width of the time column, and of each side's.
const TIME_WIDTH: usize = 14;
const SIDE_WIDTH: usize = 42;

/// The report for a terminal: the heading, the table of both sides, the numbered actions, what
/// differs, the new config's events.
fn render(report: &ReplayReport, heading: &str, name: &str) -> String {
    let mut out = format!(
        "{heading}\n{} sample(s) in {} run(s) replayed",
        report.samples, report.runs
    );
    if report.samples_without_input > 0 {
        out.push_str(&format!(
            "; {} sample(s) recorded without the policy's input (before replay existed) skipped",
            report.samples_without_input
        ));
    }
    if report.processes_unknown > 0 {
        out.push_str(&format!(
            "; {} process sample(s) left out (what the process is was never recorded)",
            report.processes_unknown
        ));
    }
    out.push_str("\n\n");
    // Both sides by time; each action numbered in that order.
    let mut rows: Vec<(u64, bool, &Step)> = report
        .recorded
        .iter()
        .map(|s| (s.at_ms, false, s))
        .chain(report.replayed.iter().map(|s| (s.at_ms, true, s)))
        .collect();
    rows.sort_by_key(|&(at, replayed, _)| (at, replayed));
    if rows.is_empty() {
        out.push_str(&format!(
            "no action, recorded or with {name}, in this range\n"
        ));
    } else {
        let cut = |text: String| -> String {
            if text.chars().count() <= SIDE_WIDTH {
                text
            } else {
                let mut t: String = text.chars().take(SIDE_WIDTH - 3).collect();
                t.push_str("...");
                t
            }
        };
        out.push_str(&format!(
            "{:<TIME_WIDTH$}  {:<SIDE_WIDTH$}  {}\n",
            "TIME",
            "TAKEN (the config then)",
            cut(format!("WITH {name}"))
        ));
        for (n, (at, replayed, step)) in rows.iter().enumerate() {
            let cell = cut(format!(
                "[{}] {} {}",
                n + 1,
                step.verb,
                short_target(&step.target)
            ));
            let (left, right) = if *replayed {
                ("-".to_string(), cell)
            } else {
                (cell, "-".to_string())
            };
            out.push_str(&format!(
                "{:<TIME_WIDTH$}  {left:<SIDE_WIDTH$}  {right}\n",
                local_as(*at, "%m-%d %H:%M:%S")
            ));
        }
        out.push('\n');
        for (n, (_, replayed, step)) in rows.iter().enumerate() {
            let side = if *replayed { "would" } else { "taken" };
            let outcome = step
                .outcome
                .as_ref()
                .map_or(String::new(), |o| format!(" ({o})"));
            let both = if step.on_both_sides {
                ""
            } else {
                "; only this side"
            };
            out.push_str(&format!(
                "[{}] {side}: {} {}{outcome}: {}{both}\n",
                n + 1,
                step.verb,
                step.target,
                step.reason
            ));
        }
    }
    let only = |steps: &[Step]| -> Vec<String> {
        let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
        for s in steps.iter().filter(|s| !s.on_both_sides) {
            *counts.entry(s.verb.as_str()).or_default() += 1;
        }
        counts.iter().map(|(v, n)| format!("{n} {v}")).collect()
    };
    let (extra, missing) = (only(&report.replayed), only(&report.recorded));
    let both = report.replayed.iter().filter(|s| s.on_both_sides).count();
    let none = |v: Vec<String>| {
        if v.is_empty() {
            "none".into()
        } else {
            v.join(", ")
        }
    };
    out.push_str(&format!(
        "\nonly with {name}: {}\nonly taken then: {}\non both sides: {both}\n",
        none(extra),
        none(missing),
    ));
    if !report.events.is_empty() {
        out.push_str(&format!("\nevents with {name}:\n"));
        for e in &report.events {
            out.push_str(&format!(
                "{} {} {}: {}\n",
                local_as(e.at_ms, "%m-%d %H:%M:%S"),
                e.severity,
                e.kind,
                e.message
            ));
        }
    }
    out
}

/// A target as the table shows it: "model 'x'" without its pids, or "pid 12(comm)".
fn short_target(target: &str) -> &str {
    target.find(" pids [").map_or(target, |cut| &target[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(at_ms: u64, verb: &str, target: &str, both: bool, outcome: Option<&str>) -> Step {
        Step {
            at_ms,
            verb: *crate::policy::Verb::ALL
                .iter()
                .find(|v| v.as_str() == verb)
                .unwrap(),
            target: target.into(),
            reason: "RAM available 1.0 GiB < min_available 2.0 GiB".into(),
            outcome: outcome.map(|o| o.to_string().try_into().unwrap()),
            on_both_sides: both,
        }
    }

    /// Both sides by time in one table no wider than 100 columns, the long parts under it, and
    /// the difference counted by verb.
    #[test]
    fn the_table_fits_100_columns_and_says_what_differs() {
        let long = format!("model '{}' pids [1(a), 2(b), 3(c)]", "m".repeat(80));
        let report = ReplayReport {
            samples: 3,
            runs: 1,
            recorded: vec![step(2_000, "stop", &long, false, Some("done"))],
            replayed: vec![
                step(1_000, "terminate", "pid 42(hog)", false, None),
                step(3_000, "kill", "pid 43(hog2)", false, None),
            ],
            ..ReplayReport::default()
        };
        let text = render(&report, "replay of /x", "new.toml");
        assert!(
            text.lines()
                .all(|l| l.chars().count() <= 100 || l.starts_with('[')),
            "{text}"
        );
        let table: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("TIME"))
            .take(4)
            .collect();
        assert!(
            table[1].contains("-") && table[1].ends_with("[1] terminate pid 42(hog)"),
            "{text}"
        );
        assert!(
            table[2].contains("[2] stop model 'mmm") && table[2].contains("...  -"),
            "{text}"
        );
        assert!(
            text.contains(&format!("[2] taken: stop {long} (done)")),
            "{text}"
        );
        assert!(
            text.contains("only with new.toml: 1 kill, 1 terminate\nonly taken then: 1 stop\non both sides: 0\n"),
            "{text}"
        );
    }
}
