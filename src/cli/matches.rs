//! `gpuguard check-config` on this host's processes: the warnings about what the rules catch
//! (`policy::rules::survey`: too many processes, processes no model takes in, two models
//! catching one process) and, with `--matches`, a table of what each `[[model]]` and `[protect]`
//! rule catches now. The processes come from one full round of the daemon's own scanner
//! (`sample::scan`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use comfy_table::presets::UTF8_BORDERS_ONLY;
use comfy_table::{Cell, ContentArrangement, Table};

use crate::config::Config;
use crate::policy::rules::{survey, Seen, Survey};
use crate::sample::procfs::{ProcReader, ReadError};
use crate::sample::scan::{apply, ScanRequest, Scanner};
use crate::snapshot::ProcessTable;

/// At most this many processes a rule catches are shown in its row.
const SHOWN: usize = 4;

/// Reads /proc, then says what the rules of `config` (loaded from `path`) catch: the table if
/// `table`, then the warnings (on stderr, as the config's other warnings).
pub fn run(path: &Path, config: &Config, table: bool) {
    let warn = |text: &str| eprintln!("gpuguard: config {}: warning: {text}", path.display());
    let processes = match scan() {
        Ok(p) => p,
        Err(e) => {
            warn(&format!(
                "cannot list /proc ({e}): what the [[model]] rules catch is not checked"
            ));
            return;
        }
    };
    // No guard: the check's own ancestors are not the daemon's (under systemd it has none).
    let survey = survey(config, &processes, 0);
    if table {
        println!(
            "{}",
            render(&survey, processes.processes.len(), &mut user_name)
        );
    }
    for warning in &survey.warnings {
        warn(&warning.to_string());
    }
}

/// Every process now, as the daemon's first scan reads them, less this command itself.
fn scan() -> Result<ProcessTable, ReadError> {
    let mut scanner = Scanner::new(ProcReader::new("/proc"));
    let mut round = scanner.round(ScanRequest {
        full: true,
        rotation_period: Duration::from_secs(60),
        ..ScanRequest::default()
    });
    if let Some(e) = round.stats.list_error {
        return Err(e);
    }
    let mut processes = Vec::new();
    apply(&mut processes, &mut round);
    let me = std::process::id() as i32;
    processes.retain(|p| p.pid != me);
    Ok(ProcessTable {
        scanned_at: Some(Duration::ZERO),
        pss_read: false,
        processes,
    })
}

/// A uid's user name, else the number.
fn user_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(user)) => user.name,
        _ => uid.to_string(),
    }
}

/// One row per rule: its name, how many processes it takes in, a few of them, and how many its
/// match caught that it does not take in, by why.
fn render(survey: &Survey, scanned: usize, user: &mut dyn FnMut(u32) -> String) -> String {
    let mut names: BTreeMap<u32, String> = BTreeMap::new();
    let mut name = |uid: u32| names.entry(uid).or_insert_with(|| user(uid)).clone();
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(super::WIDTH as u16)
        .set_header(["rule", "processes", "such as (pid, name, user)", "left out"].map(Cell::new));
    for rule in &survey.rules {
        let mut shown: Vec<String> = rule
            .caught
            .iter()
            .take(SHOWN)
            .map(|p: &Seen| format!("{} {} {}", p.pid, p.comm, name(p.uid)))
            .collect();
        if rule.caught.len() > SHOWN {
            shown.push(format!("… {} more", rule.caught.len() - SHOWN));
        }
        let mut why: BTreeMap<String, usize> = BTreeMap::new();
        for (_, reason) in &rule.left_out {
            *why.entry(reason.to_string()).or_default() += 1;
        }
        let left_out: Vec<String> = why.iter().map(|(w, n)| format!("{n} {w}")).collect();
        t.add_row([
            Cell::new(&rule.rule),
            Cell::new(rule.caught.len()),
            Cell::new(shown.join("\n")),
            Cell::new(if left_out.is_empty() {
                "-".to_string()
            } else {
                left_out.join("\n")
            }),
        ]);
    }
    let note = "A model takes in what its match catches and their descendants; \"left out\": what \
                its match catches that is not its (no model takes in pid 1, kernel threads, \
                gpuguard and what started it, [protect]ed processes, ssh and console login \
                sessions). Started from a shell, the daemon leaves that shell and what started it \
                out too; under systemd it has no such ancestors.";
    format!(
        "What the rules catch among the {scanned} processes on this host now:\n{t}\n{}",
        super::wrapped(note, "", "").trim_end()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::Process;

    fn process(pid: i32, ppid: i32, uid: u32, comm: &str, cmdline: &str) -> Process {
        Process {
            pid,
            start_time: 100 + pid as u64,
            ppid,
            uid,
            state: 'S',
            comm: comm.into(),
            cmdline: cmdline.into(),
            cgroup: "/user.slice".into(),
            ..Process::default()
        }
    }

    #[test]
    fn the_table_has_a_row_per_rule_and_fits_the_terminal() {
        let config = Config::parse(
            "[[model]]\nname = \"all-root\"\nmatch = { user = \"0\" }\n\
             [[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve\" }\n",
            Path::new("c.toml"),
        )
        .unwrap();
        let mut procs = vec![
            process(1, 0, 0, "systemd", "/sbin/init"),
            process(700, 1, 0, "sshd", "sshd: /usr/sbin/sshd -D [listener]"),
            process(800, 700, 0, "sshd", "sshd: root@pts/0"),
            process(801, 800, 0, "bash", "-bash"),
        ];
        for pid in 900..910 {
            procs.push(process(
                pid,
                801,
                0,
                "python3",
                "python3 -m vllm serve qwen",
            ));
        }
        let table = ProcessTable {
            processes: procs,
            ..ProcessTable::default()
        };
        let text = render(&survey(&config, &table, 0), 14, &mut |uid| {
            if uid == 0 {
                "root".into()
            } else {
                uid.to_string()
            }
        });
        assert!(
            text.lines()
                .all(|l| l.chars().count() <= super::super::WIDTH),
            "{text}"
        );
        for want in [
            "model[0] 'all-root'",
            "model[1] 'vllm'",
            "[protect]",
            "900 python3 root",
            "… 6 more",
            "1 pid 1",
            "10 in model[0] 'all-root'",
        ] {
            assert!(text.contains(want), "{want:?} missing:\n{text}");
        }
    }
}
