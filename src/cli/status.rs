//! `gpuguard status`: the daemon's view as tables, as JSON (`--json`), or refreshed (`--watch`).

use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use comfy_table::presets::UTF8_BORDERS_ONLY;
use comfy_table::{Cell, ContentArrangement, Table};

use super::exit;
use crate::ipc::client::ask;
use crate::protocol::{Request, Response};
use crate::status::{
    ActionRow, EngineRow, GpuProtection, GpuRow, HeldRow, LeaseRow, MemoryStatus, ModelRow,
    QueuedRow, StatusReport,
};
use crate::units::{fmt_bytes, fmt_opt_bytes as bytes};

pub fn run(socket: &Path, json: bool, watch: Option<Duration>, model: Option<&str>) -> u8 {
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
        if let Some(name) = model {
            return show_model(&report, name, json);
        }
        match (watch, json) {
            (None, true) => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("serialisable")
                );
                return exit::OK;
            }
            (None, false) => {
                println!("{}", render(&report));
                return exit::OK;
            }
            // One report per line (JSON lines), for a program reading the pipe.
            (Some(_), true) => {
                println!("{}", serde_json::to_string(&report).expect("serialisable"))
            }
            // On a terminal: clear the screen and draw from the top; into a pipe, plain reports.
            (Some(_), false) if std::io::stdout().is_terminal() => {
                println!("\x1b[2J\x1b[H{}", render(&report))
            }
            (Some(_), false) => println!("{}\n", render(&report)),
        }
        if let Some(every) = watch {
            std::thread::sleep(every);
        }
    }
}

/// The width every table of the report fits in (cells wrap; long reasons go under the table).
const WIDTH: u16 = super::WIDTH as u16;

fn table(headers: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_BORDERS_ONLY)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(WIDTH)
        .set_header(headers.iter().map(Cell::new));
    t
}

/// The report as tables, one section each.
pub fn render(r: &StatusReport) -> String {
    [
        render_header(r),
        render_memory(&r.memory),
        render_gpus(&r.gpu_protection, &r.gpus),
        render_models(&r.models),
        render_launches(&r.leases, &r.queue),
        render_held(&r.held),
        render_actions(&r.recent_actions),
    ]
    .concat()
}

fn render_header(r: &StatusReport) -> String {
    format!(
        "gpuguard {} on {} — mode {}, up {}\n\n",
        r.version,
        r.hostname,
        r.mode,
        crate::units::fmt_duration(Duration::from_secs(r.uptime_seconds as u64))
    )
}

fn render_memory(m: &MemoryStatus) -> String {
    format!(
        "Host memory: available {} of {} (warn {}, min {}) [{}]\n  shmem/tmpfs {}; swap free {} of {}; PSI some avg10 {}\n\n",
        bytes(m.host.available_bytes),
        bytes(m.host.total_bytes),
        bytes(m.warn_available_bytes),
        bytes(m.min_available_bytes),
        m.level,
        bytes(m.host.shmem_bytes),
        bytes(m.host.swap_free_bytes),
        bytes(m.host.swap_total_bytes),
        m.host.psi_some_avg10.map_or("n/a".into(), |p| format!("{p:.1}%")),
    )
}

fn render_gpus(g: &GpuProtection, gpus: &[GpuRow]) -> String {
    let line = format!(
        "protection {}{}{}",
        g.state,
        g.reason
            .as_ref()
            .map_or(String::new(), |r| format!(" ({r})")),
        if g.stale { " [stale]" } else { "" }
    );
    let mut out = super::wrapped(&line, "GPUs:", "  ");
    if gpus.is_empty() {
        return out;
    }
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
    let mut notes = Vec::new();
    for gpu in gpus {
        let state = match &gpu.error {
            Some(e) => {
                notes.push(format!("GPU {}: {e}", gpu.index));
                format!("error [{}]", notes.len())
            }
            None => gpu.level.to_string(),
        };
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
            state,
        ]);
    }
    out += &format!("{t}\n");
    for (n, note) in notes.iter().enumerate() {
        out += &super::wrapped(note, &format!("[{}]", n + 1), "    ");
    }
    out
}

fn render_models(models: &[ModelRow]) -> String {
    let mut out = "\nModels:\n".to_string();
    if models.is_empty() {
        out += "  (none running)\n";
        return out;
    }
    let mut t = table(&[
        "model",
        "pids",
        "RAM used/budget",
        "GPU used/budget",
        "headroom",
        "state",
    ]);
    for model in models {
        t.add_row(model_cells(model));
    }
    out += &format!("{t}\n");
    // What does not fit a cell: each model's engine, its share of its GPUs, the limit it is at.
    for model in models {
        let mut said = Vec::new();
        if model.engine.is_some() {
            said.push(format!("engine {}", engine_cell(model.engine.as_ref())));
        }
        if let Some(r) = model.gpu_reserved_ratio {
            said.push(format!("holds {:.0}% of its GPUs", r * 100.0));
        }
        if let Some(limit) = &model.limit {
            said.push(limit.clone());
        }
        for line in said {
            out += &super::wrapped(&line, &format!("  {}:", model.name), "      ");
        }
    }
    out
}

/// One model's row in the models table.
fn model_cells(model: &ModelRow) -> Vec<String> {
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
    // One a line: a cell that wraps must not split a figure from its unit.
    .join("\n");
    vec![
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
            bytes(model.gpu_bytes),
            if model.gpu_unknown { "+?" } else { "" },
            bytes(model.gpu_budget_bytes),
        ),
        headroom,
        model.state.to_string(),
    ]
}

fn render_launches(leases: &[LeaseRow], queue: &[QueuedRow]) -> String {
    let mut out = "\nLaunch queue:\n".to_string();
    if queue.is_empty() && leases.is_empty() {
        out += "  (empty)\n";
        return out;
    }
    let mut t = table(&["", "model", "pid", "uid", "GPU", "RAM", "for", "state"]);
    for l in leases {
        t.add_row(vec![
            format!("lease {}", l.lease),
            l.model.clone(),
            l.pid.to_string(),
            l.uid.to_string(),
            format!("{} {:?}", fmt_bytes(l.gpu_bytes), l.gpus),
            fmt_bytes(l.ram_bytes),
            crate::units::fmt_duration(Duration::from_secs(l.seconds as u64)).to_string(),
            l.state.to_string(),
        ]);
    }
    for q in queue {
        t.add_row(vec![
            format!("#{}", q.position),
            q.model.clone(),
            q.pid.to_string(),
            q.uid.to_string(),
            fmt_bytes(q.gpu_bytes),
            fmt_bytes(q.ram_bytes),
            crate::units::fmt_duration(Duration::from_secs(q.waiting_seconds as u64)).to_string(),
            format!("waiting for {}", q.waiting_for),
        ]);
    }
    out += &format!("{t}\n");
    out
}

fn render_held(held: &[HeldRow]) -> String {
    let mut out = "\nHeld stopped by gpuguard:\n".to_string();
    if held.is_empty() {
        out += "  (none)\n";
    }
    for h in held {
        out += &super::wrapped(
            &format!("pid {} ({}): {}", h.pid, h.comm, h.why),
            "  ",
            "      ",
        );
    }
    out
}

fn render_actions(actions: &[ActionRow]) -> String {
    let mut out = "\nRecent actions:\n".to_string();
    if actions.is_empty() {
        out += "  (none)\n";
    }
    for a in actions.iter().rev().take(10) {
        let line = format!(
            "{} {} {}: {} [{}]",
            a.at_unix, a.verb, a.target, a.reason, a.outcome
        );
        out += &super::wrapped(&line, "  ", "      ");
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

/// The engine's figures in one cell: "KV 100% · 8 running · 24 waiting · 3 preempted".
fn engine_cell(engine: Option<&EngineRow>) -> String {
    let Some(e) = engine else {
        return "-".into();
    };
    if e.state != "ok" {
        return format!("{}: {}", e.state, e.error.as_deref().unwrap_or(""));
    }
    let count = |v: Option<u64>| v.map_or("?".into(), |v| v.to_string());
    let s = &e.stats;
    format!(
        "KV {} · {} running · {} waiting · {} preempted",
        s.kv_cache_usage
            .map_or("?".into(), |k| format!("{:.0}%", k * 100.0)),
        count(s.requests_running),
        count(s.requests_waiting),
        count(s.preemptions_total)
    )
}

/// `status --model NAME`: one model, its engine and its processes one by one.
fn show_model(r: &StatusReport, name: &str, json: bool) -> u8 {
    let Some(m) = r.models.iter().find(|m| m.name == name) else {
        let known: Vec<&str> = r.models.iter().map(|m| m.name.as_str()).collect();
        eprintln!(
            "gpuguard: no model '{name}' (models: {})",
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        );
        return exit::FAILURE;
    };
    if json {
        println!("{}", serde_json::to_string_pretty(m).expect("serialisable"));
    } else {
        println!("{}", render_model(m));
    }
    exit::OK
}

/// One model: its budget line, its engine, which limit it is at, its processes.
pub fn render_model(m: &ModelRow) -> String {
    let mut out = format!(
        "Model {} ({}): RAM {}/{}, GPU {}{}/{}, state {}\n",
        m.name,
        m.source,
        fmt_bytes(m.ram_bytes),
        bytes(m.ram_budget_bytes),
        bytes(m.gpu_bytes),
        m.gpu_reserved_ratio.map_or(String::new(), |r| format!(
            " ({:.0}% of its GPUs)",
            r * 100.0
        )),
        bytes(m.gpu_budget_bytes),
        m.state
    );
    if let Some(e) = &m.engine {
        out += &format!(
            "Engine {}: {}\n",
            crate::snapshot::printable(&e.url),
            engine_cell(Some(e))
        );
        let s = &e.stats;
        if let (Some(blocks), Some(size)) = (s.kv_cache_blocks, s.block_size_tokens) {
            let tokens = blocks.saturating_mul(size);
            out += &format!(
                "  KV cache: {blocks} blocks of {size} tokens ({tokens} tokens{}){}\n",
                m.planned_kv_tokens.map_or(String::new(), |p| format!(
                    "; planned {p}, the engine has {:+.1}%",
                    (tokens as f64 / p as f64 - 1.0) * 100.0
                )),
                s.gpu_memory_utilization
                    .map_or(String::new(), |u| format!(", gpu_memory_utilization {u}"))
            );
        }
    }
    if let Some(limit) = &m.limit {
        out += &format!("Limit: {limit}\n");
    }
    let mut t = table(&[
        "pid",
        "ppid",
        "role",
        "comm",
        "RAM",
        "RSS",
        "GPU",
        "weights mapped",
    ]);
    // Paths do not fit a cell: each file is numbered, and listed under the table.
    let mut files: Vec<&str> = Vec::new();
    for p in &m.processes {
        let gpus: Vec<String> = p
            .gpus
            .iter()
            .map(|g| format!("GPU {}: {}", g.gpu, bytes(g.bytes)))
            .collect();
        t.add_row(vec![
            p.pid.to_string(),
            p.ppid.to_string(),
            p.role.clone(),
            p.comm.clone(),
            fmt_bytes(p.ram_bytes),
            fmt_bytes(p.rss_bytes),
            if gpus.is_empty() {
                "-".into()
            } else {
                gpus.join(", ")
            },
            p.weights_files
                .iter()
                .map(|f| {
                    let n = match files.iter().position(|known| known == f) {
                        Some(i) => i + 1,
                        None => {
                            files.push(f);
                            files.len()
                        }
                    };
                    format!("[{n}]")
                })
                .collect::<Vec<_>>()
                .join(" "),
        ]);
    }
    out += &format!("{t}\n");
    for (n, f) in files.iter().enumerate() {
        out += &format!("[{}] {f}\n", n + 1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::{EngineState, Level, Protection};
    use crate::status::ModelState;
    use crate::status::{EngineRow, GpuRow, ModelRow, ProcessGpu, ProcessRow};

    /// `status --model`: a model's processes one by one, with their role, GPU memory per GPU and
    /// the weights files they map (numbered, listed under the table). Moved from the host suite
    /// (`weights`); what the rows hold is `daemon::tests::gpu`'s.
    #[test]
    fn a_models_processes_are_shown_one_by_one() {
        let g = 1u64 << 30;
        let path = "/models/server/model.safetensors";
        let row = |pid: i32, ppid: i32, role: &str, gpu: u32, bytes: u64| ProcessRow {
            pid,
            ppid,
            comm: "python3".into(),
            role: role.into(),
            ram_bytes: g,
            rss_bytes: 2 * g,
            gpus: vec![ProcessGpu {
                gpu,
                bytes: Some(bytes),
            }],
            weights_files: vec![path.into()],
        };
        let m = ModelRow {
            name: "server".into(),
            source: crate::kinds::ModelSource::Config,
            pids: vec![100, 101, 102],
            processes: vec![
                row(100, 1, "matched", 0, g),
                row(101, 100, "child", 0, 4 * g),
                row(102, 100, "child", 1, 4 * g),
            ],
            state: ModelState::Ok,
            ..ModelRow::default()
        };
        let table = render_model(&m);
        for needle in [
            "role",
            "matched",
            "child",
            "GPU 0: 1.0 GiB",
            "GPU 1: 4.0 GiB",
            "[1] /models/server/model.safetensors",
        ] {
            assert!(table.contains(needle), "{needle:?} missing from:\n{table}");
        }
    }

    /// Round four: a bidirectional override in a metrics URL reached the terminal through
    /// `status --model`. A URL the daemon reports is shown escaped (a client's is refused
    /// first: `protocol::check_url`).
    #[test]
    fn a_models_engine_url_is_shown_escaped() {
        let m = ModelRow {
            name: "m".into(),
            engine: Some(EngineRow {
                url: "http://127.0.0.1:8000/\u{202e}scirtem".into(),
                state: EngineState::Pending,
                ..EngineRow::default()
            }),
            ..ModelRow::default()
        };
        let text = render_model(&m);
        assert!(!text.contains('\u{202e}'), "{text:?}");
        assert!(
            text.contains("Engine http://127.0.0.1:8000/\\u{202e}scirtem: "),
            "{text}"
        );
    }

    /// Eight GPUs (one with an NVML error), models with long names, budgets and an engine that
    /// cannot be scraped: every line of `gpuguard status` fits 100 columns, and the GPU's error is
    /// said under its table, numbered, not in a cell.
    #[test]
    fn the_report_fits_100_columns() {
        let g = 1u64 << 30;
        let mut r = StatusReport {
            hostname: "a3-highgpu-8g-instance-1".into(),
            ..StatusReport::default()
        };
        // What a host without the driver says (`sample::nvml`), stale since the last answer.
        r.gpu_protection = GpuProtection {
            state: Protection::Unavailable,
            reason: Some(
                "NVML library not loadable (libnvidia-ml.so.1: cannot open shared object file: \
                 No such file or directory): no NVIDIA driver?"
                    .into(),
            ),
            stale: true,
        };
        r.memory.host.total_bytes = Some(1800 * g);
        r.memory.host.available_bytes = Some(900 * g);
        r.gpus = (0..8)
            .map(|index| GpuRow {
                index,
                name: "NVIDIA H100 80GB HBM3".into(),
                total_bytes: Some(80 * g),
                used_bytes: Some(70 * g),
                free_bytes: Some(10 * g),
                utilization_percent: Some(97),
                warn_free_bytes: Some(4 * g),
                min_free_bytes: Some(2 * g),
                level: Level::Ok,
                error: (index == 3).then(|| {
                    "Unknown Error: the GPU has fallen off the bus or is otherwise inaccessible"
                        .into()
                }),
                ..GpuRow::default()
            })
            .collect();
        r.models = (0..3)
            .map(|i| ModelRow {
                name: format!("meta-llama-Llama-3.1-70B-Instruct-replica-{i}"),
                source: crate::kinds::ModelSource::Config,
                pids: (0..8).map(|p| 100_000 + p).collect(),
                ram_bytes: 60 * g,
                ram_budget_bytes: Some(96 * g),
                gpu_bytes: Some(560 * g),
                gpu_budget_bytes: Some(600 * g),
                ram_headroom_bytes: Some(36 << 30),
                gpu_headroom_bytes: Some(40 << 30),
                state: ModelState::Ok,
                gpu_reserved_ratio: Some(0.92),
                engine: Some(EngineRow {
                    url: "http://127.0.0.1:8000/metrics".into(),
                    state: EngineState::Error,
                    error: Some("unreachable: connection refused (os error 111)".into()),
                    ..EngineRow::default()
                }),
                ..ModelRow::default()
            })
            .collect();
        r.recent_actions.push(crate::status::ActionRow {
            at_unix: 1_795_690_442,
            verb: crate::policy::Verb::Terminate,
            // A process may name itself in fullwidth characters, two columns each.
            target: "model 'meta-llama-Llama-3.1-70B-Instruct-replica-0' pids [100000(python3), 100001(ＡＡＡＡＡ)]".into(),
            reason_kind: crate::kinds::ReasonKind::GpuFloor,
            reason: "GPU 3 free 1.0 GiB < min_free 2.0 GiB; largest eligible user of GPU 3: 70.0 GiB".into(),
            outcome: crate::policy::Outcome::Done,
        });
        let text = render(&r);
        let widest = text
            .lines()
            .map(unicode_width::UnicodeWidthStr::width)
            .max()
            .unwrap();
        assert!(widest <= 100, "{widest} columns:\n{text}");
        assert!(text.contains("error [1]"), "{text}");
        assert!(
            text.contains("\n[1] GPU 3: Unknown Error: the GPU has fallen off the bus"),
            "{text}"
        );
    }
}
