//! What the daemon does about faults around it: floors that cannot be right on this host
//! (refused on reload; at start by `preflight.rs`), GPUs that are lost (said once, as an event;
//! the condition, status and metric come from the snapshot), and what a previous run left held.

use tracing::warn;

use crate::act::Leftovers;
use crate::alert::Alerter;
use crate::config::{Config, ConfigError, HostTotals};
use crate::kinds::EventKind;
use crate::policy::{About, Event, Resource, Severity};

use super::sampler::Sampler;
use super::Daemon;

impl Daemon {
    /// A reloaded config, checked against this host's totals as last sampled; `state_dir` and
    /// `launch.socket` stay what the daemon started with (they change only at restart).
    pub(super) fn vet_reload(&self, mut config: Config) -> Result<Config, ConfigError> {
        let s = &self.sampler.snapshot;
        let totals = HostTotals {
            ram_bytes: s.host.total_bytes,
            swap_bytes: s.host.swap_total_bytes,
            gpus: super::preflight::gpu_totals(&s.gpus.devices),
        };
        config.check_host(&totals, &self.config_path)?;
        if config.daemon.state_dir != self.config.daemon.state_dir {
            warn!(
                "daemon.state_dir changes only at restart: still {}",
                self.config.daemon.state_dir.display()
            );
            config.daemon.state_dir = self.config.daemon.state_dir.clone();
        }
        config.launch.socket = self.config.launch.socket.clone();
        Ok(config)
    }
}

impl Sampler {
    /// Says once when a GPU is lost (GPU_IS_LOST, or gone from NVML's device list) and when it
    /// is back. The condition `gpu_lost` (alerts), status and metrics follow the snapshot.
    pub(super) fn note_lost_gpus(&mut self, events: &mut Vec<Event>) {
        let devices = &self.snapshot.gpus.devices;
        for g in devices.iter().filter(|g| g.lost) {
            if self.lost_gpus.insert(g.index) {
                events.push(
                    Event::new(
                        Severity::Critical,
                        EventKind::GpuLost,
                        format!(
                            "GPU {} ({}) lost: {}; its readings are unknown: nothing is killed for it, and processes held for it are resumed at max_stop",
                            g.index,
                            if g.uuid.is_empty() { "uuid unknown" } else { &g.uuid },
                            g.error.as_deref().unwrap_or("no answer")
                        ),
                    )
                    .about(gpu_about(g.index)),
                );
            }
        }
        let back: Vec<u32> = self
            .lost_gpus
            .iter()
            .copied()
            .filter(|&i| devices.iter().any(|g| g.index == i && !g.lost))
            .collect();
        for index in back {
            self.lost_gpus.remove(&index);
            events.push(
                Event::new(
                    Severity::Info,
                    EventKind::GpuRecovered,
                    format!("GPU {index} answers NVML again"),
                )
                .about(gpu_about(index)),
            );
        }
    }
}

/// Tells the alert pipeline what a previous run left held (a record that could not be read is
/// critical: processes may still be stopped). The log has it already.
pub(super) fn announce_leftovers(alerter: &mut Alerter, leftovers: &Leftovers) {
    if !leftovers.undone.is_empty() {
        alerter.lifecycle(
            EventKind::LeftoversUndone,
            Severity::Warning,
            leftovers.undone.join("; "),
        );
    }
    for kept in &leftovers.kept {
        alerter.lifecycle(EventKind::LeftoversKept, Severity::Critical, kept.clone());
    }
    for problem in &leftovers.problems {
        alerter.lifecycle(
            EventKind::StateFileCorrupt,
            Severity::Critical,
            problem.clone(),
        );
    }
}

fn gpu_about(index: u32) -> About {
    About {
        resource: Some(Resource::Gpu(index)),
        ..About::default()
    }
}
