//! `gpuguard status`: the daemon's view as tables, as JSON (`--json`), or refreshed (`--watch`).

use std::path::Path;
use std::time::Duration;

use comfy_table::presets::UTF8_BORDERS_ONLY;
use comfy_table::{Cell, Table};

use super::exit;
use crate::ipc::client::ask;
use crate::ipc::{Request, Response};
use crate::status::StatusReport;
use crate::units::fmt_bytes;

pub fn run(socket: &Path, json: bool, watch: Option<Duration>) -> u8 {
    loop {
        let report = match ask(socket, Request::Status) {
            Ok(Response::Status(report)) => report,
            Ok(other) => {
                eprintln!("gpuguard: unexpected answer from the daemon: {other:?}");
                return exit::FAILURE;
            }
            Err(e) => {
                eprintln!("gpuguard: {e}");
                return exit::UNREACHABLE;
            }
        };
        let text = if json {
            serde_json::to_string_pretty(&report).expect("serialisable")
        } else {
            render(&report)
        };
        match watch {
            None => {
                println!("{text}");
                return exit::OK;
            }
            Some(every) => {
                // Clear the screen and draw from the top.
                println!("\x1b[2J\x1b[H{text}");
                std::thread::sleep(every);
            }
        }
    }
}

fn bytes(b: Option<u64>) -> String {
    b.map_or("?".into(), fmt_bytes)
}

fn table(headers: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY)
        .set_header(headers.iter().map(Cell::new));
    t
}

/// The report as tables, one section each.
pub fn render(r: &StatusReport) -> String {
    let mut out = format!(
        "gpuguard {} on {} — mode {}, up {}\n\n",
        r.version,
        r.hostname,
        r.mode,
        humantime::format_duration(Duration::from_secs(r.uptime_seconds as u64))
    );
    let m = &r.memory;
    out += &format!(
        "Host memory: available {} of {} (warn {}, min {}) [{}]; swap free {} of {}; PSI some avg10 {}\n\n",
        bytes(m.available_bytes),
        bytes(m.total_bytes),
        bytes(m.warn_available_bytes),
        bytes(m.min_available_bytes),
        m.level,
        bytes(m.swap_free_bytes),
        bytes(m.swap_total_bytes),
        m.psi_some_avg10.map_or("n/a".into(), |p| format!("{p:.1}%")),
    );
    let g = &r.gpu_protection;
    out += &format!(
        "GPUs: protection {}{}{}\n",
        g.state,
        g.reason
            .as_ref()
            .map_or(String::new(), |r| format!(" ({r})")),
        if g.stale { " [stale]" } else { "" }
    );
    if !r.gpus.is_empty() {
        let mut t = table(&[
            "GPU",
            "name",
            "used",
            "free",
            "total",
            "util",
            "warn/min free",
            "state",
        ]);
        for gpu in &r.gpus {
            t.add_row(vec![
                gpu.index.to_string(),
                gpu.name.clone(),
                bytes(gpu.used_bytes),
                bytes(gpu.free_bytes),
                bytes(gpu.total_bytes),
                gpu.utilization_percent
                    .map_or("?".into(), |u| format!("{u}%")),
                format!(
                    "{}/{}",
                    bytes(gpu.warn_free_bytes),
                    bytes(gpu.min_free_bytes)
                ),
                gpu.error.clone().unwrap_or_else(|| gpu.level.clone()),
            ]);
        }
        out += &format!("{t}\n");
    }
    out += "\nModels:\n";
    if r.models.is_empty() {
        out += "  (none running)\n";
    } else {
        let mut t = table(&[
            "model",
            "pids",
            "RAM used/budget",
            "GPU used/budget",
            "headroom",
            "state",
        ]);
        for model in &r.models {
            let headroom = [
                model
                    .ram_headroom_bytes
                    .map(|h| format!("RAM {}", signed(h))),
                model
                    .gpu_headroom_bytes
                    .map(|h| format!("GPU {}", signed(h))),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ");
            t.add_row(vec![
                format!("{} ({})", model.name, model.source),
                model
                    .pids
                    .iter()
                    .map(i32::to_string)
                    .collect::<Vec<_>>()
                    .join(" "),
                format!(
                    "{}/{}",
                    fmt_bytes(model.ram_bytes),
                    bytes(model.ram_budget_bytes)
                ),
                format!(
                    "{}{}/{}",
                    fmt_bytes(model.gpu_bytes),
                    if model.gpu_unknown { "+?" } else { "" },
                    bytes(model.gpu_budget_bytes)
                ),
                headroom,
                model.state.clone(),
            ]);
        }
        out += &format!("{t}\n");
    }
    out += "\nLaunch queue:\n";
    if r.queue.is_empty() && r.leases.is_empty() {
        out += "  (empty)\n";
    } else {
        let mut t = table(&["", "model", "pid", "uid", "GPU", "RAM", "for", "state"]);
        for l in &r.leases {
            t.add_row(vec![
                format!("lease {}", l.lease),
                l.model.clone(),
                l.pid.to_string(),
                l.uid.to_string(),
                format!("{} {:?}", fmt_bytes(l.gpu_bytes), l.gpus),
                fmt_bytes(l.ram_bytes),
                humantime::format_duration(Duration::from_secs(l.seconds as u64)).to_string(),
                l.state.clone(),
            ]);
        }
        for q in &r.queue {
            t.add_row(vec![
                format!("#{}", q.position),
                q.model.clone(),
                q.pid.to_string(),
                q.uid.to_string(),
                fmt_bytes(q.gpu_bytes),
                fmt_bytes(q.ram_bytes),
                humantime::format_duration(Duration::from_secs(q.waiting_seconds as u64))
                    .to_string(),
                format!("waiting for {}", q.waiting_for),
            ]);
        }
        out += &format!("{t}\n");
    }
    out += "\nHeld stopped by gpuguard:\n";
    if r.held.is_empty() {
        out += "  (none)\n";
    } else {
        for h in &r.held {
            out += &format!("  pid {} ({}): {}\n", h.pid, h.comm, h.why);
        }
    }
    out += "\nRecent actions:\n";
    if r.recent_actions.is_empty() {
        out += "  (none)\n";
    } else {
        for a in r.recent_actions.iter().rev().take(10) {
            out += &format!(
                "  {} {} {}: {} [{}]\n",
                a.at_unix, a.verb, a.target, a.reason, a.outcome
            );
        }
    }
    out
}

fn signed(bytes: i64) -> String {
    if bytes < 0 {
        format!("-{}", fmt_bytes(bytes.unsigned_abs()))
    } else {
        fmt_bytes(bytes as u64)
    }
}
