//! `cargo run --example generate-assets -- DIR`: the man pages and shell completions, generated
//! from the CLI definition itself (`gpuguard::cli::Cli::command()`) so the packaged documentation
//! cannot drift from the binary, and the packaged config. An example, not a subcommand: clap_mangen
//! and clap_complete are dev-dependencies, never linked into the daemon. The assets are the same
//! for every architecture, so the build host writes them (`packaging/build-release.sh`), and the
//! packages carry what it writes:
//!
//! - `DIR/man/gpuguard.1`, and `DIR/man/gpuguard-SUBCOMMAND.1` for each visible subcommand
//! - `DIR/completions/gpuguard.bash`, `DIR/completions/_gpuguard` (zsh),
//!   `DIR/completions/gpuguard.fish`
//! - `DIR/config.toml`, the conffile installed as /etc/gpuguard/config.toml: `config.example.toml`
//!   (every key with its default, documented) with its example models commented out

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::CommandFactory;
use clap_complete::Shell;
use clap_mangen::roff::{bold, italic, roman, Roff};
use clap_mangen::Man;

use gpuguard::cli::{exit, Cli};

/// The binary's name, as installed and as completions know it.
const BIN: &str = "gpuguard";

/// Every key with its default and its documentation; the packaged config is derived from it.
const EXAMPLE_CONFIG: &str = include_str!("../config.example.toml");

/// What the installed config does, said once at its top.
const PACKAGED_HEADER: &str = "\
# /etc/gpuguard/config.toml, installed by the gpuguard package. It is a conffile: your edits are
# kept on upgrade. After an edit: systemctl reload gpuguard (a file with an error fails the reload
# and the running config is kept).
#
# As installed, gpuguard enforces one thing: the host RAM floor below. When MemAvailable falls
# under [ram] min_available (5%) it terminates the largest process that is not protected (sshd,
# systemd, the cloud guest agents... see [protect]), before the kernel OOM killer fires or the VM
# wedges and SSH drops. GPU floors and model budgets are off until you set them. To watch first,
# set mode = \"observe\" under [daemon]: it then decides and logs, but never signals a process.
#
";

fn main() -> std::process::ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), None) = (args.next(), args.next()) else {
        eprintln!("usage: generate-assets DIR");
        return exit::FAILURE.into();
    };
    run(Path::new(&dir)).into()
}

fn run(dir: &Path) -> u8 {
    match write_assets(dir) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            exit::OK
        }
        Err(e) => {
            eprintln!("gpuguard: generate-assets: {e:#}");
            exit::FAILURE
        }
    }
}

/// Writes every man page and completion script under `dir`; returns the files written.
fn write_assets(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let man_dir = dir.join("man");
    let completions_dir = dir.join("completions");
    for d in [&man_dir, &completions_dir] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }

    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    let date = man_date();
    let main_page = man_dir.join(format!("{BIN}.1"));
    write_file(&main_page, &main_man_page(&cmd, &date)?)?;
    written.push(main_page);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let page = man(sub.clone(), &date);
        let path = man_dir.join(page.get_filename());
        let mut text = Vec::new();
        page.render(&mut text)?;
        text.extend_from_slice(see_also(&[&format!("{BIN}(1)")]).as_bytes());
        write_file(&path, &single_preamble(text))?;
        written.push(path);
    }

    let config = dir.join("config.toml");
    write_file(&config, packaged_config().as_bytes())?;
    written.push(config);

    for (shell, name) in [
        (Shell::Bash, format!("{BIN}.bash")),
        (Shell::Zsh, format!("_{BIN}")),
        (Shell::Fish, format!("{BIN}.fish")),
    ] {
        let mut text = Vec::new();
        clap_complete::generate(shell, &mut user_facing(Cli::command()), BIN, &mut text);
        let path = completions_dir.join(name);
        write_file(&path, &text)?;
        written.push(path);
    }
    Ok(written)
}

/// `config.example.toml` as installed: the header above, and every `[[model]]` table commented out
/// (an example model must never match a real process on a host that installed the package).
fn packaged_config() -> String {
    let mut out = String::from(PACKAGED_HEADER);
    let mut in_model = false;
    for line in EXAMPLE_CONFIG.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            in_model = trimmed.starts_with("[[model]]");
        }
        if in_model && !trimmed.is_empty() && !trimmed.starts_with('#') {
            out.push_str("# ");
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The CLI without its hidden subcommands (clap_complete's zsh generator would offer them).
fn user_facing(cmd: clap::Command) -> clap::Command {
    let visible: Vec<clap::Command> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let mut trimmed = clap::Command::new(BIN)
        .version(env!("CARGO_PKG_VERSION"))
        .subcommand_required(true)
        .subcommands(visible);
    if let Some(about) = cmd.get_about() {
        trimmed = trimmed.about(about.clone());
    }
    trimmed
}

fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.flush())
        .with_context(|| format!("writing {}", path.display()))
}

/// A page's header: every .TH field set (an empty date would shift the ones after it).
fn man(cmd: clap::Command, date: &str) -> Man {
    Man::new(cmd)
        .date(date)
        .source(format!("{BIN} {}", env!("CARGO_PKG_VERSION")))
        .manual("gpuguard manual")
}

/// SOURCE_DATE_EPOCH (reproducible builds; build-deb.sh sets it from the last commit), else today.
fn man_date() -> String {
    let when = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or_else(std::time::SystemTime::now, |secs| {
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)
        });
    let at = jiff::Timestamp::try_from(when).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
    at.strftime("%Y-%m-%d").to_string()
}

/// Each clap_mangen section starts with the same two-line apostrophe preamble; keep the first.
fn single_preamble(text: Vec<u8>) -> Vec<u8> {
    const PREAMBLE: &str = concat!(r".ie \n(.g .ds Aq \(aq", "\n", ".el .ds Aq '", "\n");
    let text = String::from_utf8(text).expect("roff output is UTF-8");
    match text.split_once(PREAMBLE) {
        Some((before, after)) => format!("{before}{PREAMBLE}{}", after.replace(PREAMBLE, "")),
        None => text,
    }
    .into_bytes()
}

/// gpuguard(1): clap_mangen's standard sections, then what a daemon's page needs and clap does
/// not know: what it is for, exit status, signals, files, environment.
fn main_man_page(cmd: &clap::Command, date: &str) -> anyhow::Result<Vec<u8>> {
    let man = man(cmd.clone(), date);
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;

    let mut roff = Roff::new();
    section(&mut roff, "DESCRIPTION");
    roff.text([roman(
        "gpuguard keeps GPU machines alive. As a systemd service (gpuguard daemon) it watches GPU \
         memory through NVML and host RAM through /proc, enforces free-memory floors and \
         per-model budgets, and stops or kills the offending process before the kernel OOM \
         killer fires or the machine wedges. Processes such as sshd, systemd and the cloud \
         guest agents are never chosen.",
    )]);
    roff.control("PP", []);
    roff.text([roman(
        "Model servers started with gpuguard launch wait in the daemon's queue until their \
         memory fits, so two models never load into the same memory at once. gpuguard status \
         shows GPUs, host memory, models, the queue and recent actions.",
    )]);
    out.extend_from_slice(roff.render().as_bytes());

    man.render_options_section(&mut out)?;
    man.render_subcommands_section(&mut out)?;

    let mut roff = Roff::new();
    section(&mut roff, "EXIT STATUS");
    for (code, meaning) in [
        (exit::OK, "Success."),
        (
            exit::FAILURE,
            "A runtime error: an I/O error; daemon: another gpuguard holds its state directory, \
             or enforces on this host while this one would (it may let go: systemd tries again).",
        ),
        (
            exit::CONFIG,
            "A bad config file or bad usage; daemon, check-config: a config that cannot work on \
             this host (a floor above its memory, a secret file that does not read, a port or \
             socket another program holds), which systemd does not restart; launch, permit: the \
             daemon called the request invalid (invalid: a bad value, a model that does not \
             exist).",
        ),
        (
            exit::NEVER_FITS,
            "launch, permit: it can never fit on this host as asked (too_large: more than any \
             GPU or the host's RAM above its floor, GPU memory on a host without a GPU, above \
             its model's budget); the command was not started. Retrying here is pointless: \
             with systemd, RestartPreventExitStatus=65.",
        ),
        (
            exit::UNREACHABLE,
            "The daemon is not reachable on its socket.",
        ),
        (
            exit::TRY_LATER,
            "launch, permit: not now (timeout, queue_full, max_permits, or host_maintenance and \
             preempted while the host drains); the command was not started. Try again later, \
             or on another host.",
        ),
        (
            exit::REFUSED,
            "launch, permit, release: the daemon refused the request (not_allowed: the caller \
             may not use that model or pool).",
        ),
        (
            exit::CANNOT_EXECUTE,
            "launch, permit: the command could not be executed.",
        ),
        (
            exit::NOT_FOUND,
            "launch, permit: the command was not found.",
        ),
    ] {
        item(&mut roff, vec![bold(code.to_string())], meaning);
    }

    section(&mut roff, "SIGNALS");
    item(
        &mut roff,
        vec![bold("SIGHUP")],
        "Reload the config file (systemctl reload gpuguard). A file with an error is reported \
         and the running config is kept.",
    );
    item(
        &mut roff,
        vec![bold("SIGTERM"), roman(", "), bold("SIGINT")],
        "Resume every process gpuguard holds stopped, then exit.",
    );

    section(&mut roff, "FILES");
    for (file, what) in [
        (
            "/etc/gpuguard/config.toml",
            "The config file: floors, per-model budgets, protected processes. Every key is \
             optional and documented in the file; check it with gpuguard check-config.",
        ),
        (
            gpuguard::config::DEFAULT_SOCKET,
            "The daemon's unix socket, used by status, launch and release.",
        ),
        (
            "/var/lib/gpuguard",
            "State: the processes gpuguard holds stopped (resumed after a crash) and the event log.",
        ),
        (
            "/usr/lib/systemd/system/gpuguard.service",
            "The systemd unit. Logs go to the journal: journalctl -u gpuguard.",
        ),
    ] {
        item(&mut roff, vec![italic(file)], what);
    }

    section(&mut roff, "ENVIRONMENT");
    for (var, what) in [
        (
            "GPUGUARD_LOG",
            "Log filter for the daemon (default info; debug logs one line per tick).",
        ),
        (
            "GPUGUARD_SOCKET",
            "The daemon's socket for status, launch and release.",
        ),
        (
            "GPUGUARD_LEASE",
            "Set by launch for the command it runs: the lease that release frees.",
        ),
        (
            "GPUGUARD_MODEL, GPUGUARD_GPU_MEMORY_BYTES, GPUGUARD_RAM_BYTES",
            "Set by launch for the command it runs: the model's name and admitted budget.",
        ),
        (
            "CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER",
            "Set by launch when it places the model on GPUs.",
        ),
    ] {
        item(&mut roff, vec![bold(var)], what);
    }
    out.extend_from_slice(roff.render().as_bytes());

    man.render_version_section(&mut out)?;
    out.extend_from_slice(see_also(&["systemctl(1)", "journalctl(1)"]).as_bytes());
    Ok(single_preamble(out))
}

fn section(roff: &mut Roff, name: &str) {
    roff.control("SH", [name]);
}

fn item(roff: &mut Roff, tag: Vec<clap_mangen::roff::Inline>, text: &str) {
    roff.control("TP", []);
    roff.text(tag);
    roff.text([roman(text)]);
}

fn see_also(pages: &[&str]) -> String {
    let mut roff = Roff::new();
    section(&mut roff, "SEE ALSO");
    roff.text([roman(pages.join(", "))]);
    roff.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated man pages and completions exist and know every visible subcommand.
    #[test]
    fn assets_cover_every_subcommand() {
        let dir = tempfile::tempdir().unwrap();
        let files = write_assets(dir.path()).unwrap();
        let read = |rel: &str| {
            let path = dir.path().join(rel);
            assert!(files.contains(&path), "{rel} not reported: {files:?}");
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"))
        };
        let main = read("man/gpuguard.1");
        assert!(main.contains("\n.TH gpuguard 1 "), "{main}");
        for needle in [
            "EXIT STATUS",
            "SIGHUP",
            "/etc/gpuguard/config.toml",
            "GPUGUARD_LEASE",
        ] {
            assert!(main.contains(needle), "gpuguard.1 lacks {needle}");
        }
        let bash = read("completions/gpuguard.bash");
        let zsh = read("completions/_gpuguard");
        let fish = read("completions/gpuguard.fish");

        let cmd = Cli::command();
        let subs: Vec<&str> = cmd
            .get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| s.get_name())
            .collect();
        assert!(
            subs.contains(&"daemon") && subs.contains(&"launch"),
            "{subs:?}"
        );
        for sub in &subs {
            let reference = format!("gpuguard-{sub}(1)").replace('-', r"\-");
            assert!(main.contains(&reference), "gpuguard.1 lacks {reference}");
            let page = read(&format!("man/gpuguard-{sub}.1"));
            assert!(page.contains(".SH SYNOPSIS"), "gpuguard-{sub}.1");
            for (shell, text) in [("bash", &bash), ("zsh", &zsh), ("fish", &fish)] {
                assert!(text.contains(sub), "{shell} completion lacks {sub}");
            }
        }
        assert!(read("config.toml").starts_with(PACKAGED_HEADER));
        // The hidden packaging helper stays out of the user-facing documentation.
        for text in [&main, &bash, &zsh, &fish] {
            assert!(!text.contains("generate-assets"));
        }
    }

    /// The installed config is valid, enforces the RAM floor and defines no model.
    #[test]
    fn packaged_config_is_valid_and_has_no_models() {
        let text = packaged_config();
        let config = gpuguard::config::Config::parse(&text, Path::new("/etc/gpuguard/config.toml"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(config.models.is_empty(), "{:?}", config.models);
        assert_eq!(config.daemon.mode, gpuguard::config::Mode::Enforce);
        assert!(
            EXAMPLE_CONFIG.contains("\n[[model]]\n"),
            "the example lost its model"
        );
        assert!(!text.contains("\n[[model]]"));
        assert!(text.contains("\n# [[model]]\n# name = "));
        // Everything after the model examples is still live.
        assert!(text.contains("\n[protect]\n"));
    }
}
