//! The `gpuguard` command line: one binary, one subcommand per job.
//!
//! Exit codes: 0 success; 1 runtime error; 2 bad config or bad usage.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use gpuguard::config::Config;
use gpuguard::daemon::{Daemon, Roots};

/// A bad config or bad usage.
const EXIT_CONFIG: u8 = 2;

#[derive(Parser)]
#[command(
    name = "gpuguard",
    version,
    about = "Keeps GPU machines alive: guards GPU memory and host RAM for model servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the guard in the foreground (as systemd runs it).
    Daemon {
        /// The config file.
        #[arg(long, short, default_value = "/etc/gpuguard/config.toml")]
        config: PathBuf,
    },
    /// Validate a config file: exit 0 if it is good, 2 with the file, key and value if not.
    CheckConfig {
        /// The config file.
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { config } => match Config::load(&config) {
            Ok(c) => {
                println!(
                    "config {}: ok ({} model(s), mode {:?})",
                    config.display(),
                    c.models.len(),
                    c.daemon.mode
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpuguard: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
        Command::Daemon { config: path } => {
            init_logging();
            let config = match Config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("gpuguard: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            match Daemon::new(&path, config, Roots::default()).and_then(Daemon::run) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gpuguard: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Logs to stderr, one line per event, without colours when not on a terminal (journald).
fn init_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUGUARD_LOG")
        .unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
