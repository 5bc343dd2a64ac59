//! Memory admission for `gpuguard launch`: does a model's declared need fit now, and on which
//! GPUs. Pure: the daemon's launch queue asks, with the snapshot and the launches still loading.
//!
//! A launch fits when, after it, every resource it needs stays above its warn floor (its min
//! floor where no warn floor is set), counting what launches still loading have yet to take.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::snapshot::{GpuStatus, Snapshot};
use crate::units::fmt_bytes;

use super::{Level, Resource};

/// What a launch needs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Need {
    /// GPU memory over all its GPUs, spread evenly.
    pub gpu_bytes: u64,
    pub ram_bytes: u64,
    /// How many GPUs (ignored when `pinned`).
    pub gpu_count: u32,
    /// GPUs the caller chose (CUDA_VISIBLE_DEVICES or --gpu): checked, not chosen.
    pub pinned: Option<Vec<u32>>,
}

impl Need {
    pub fn gpus_wanted(&self) -> u32 {
        self.pinned
            .as_ref()
            .map_or(self.gpu_count.max(1), |p| p.len().max(1) as u32)
    }

    pub fn gpu_bytes_per_gpu(&self) -> u64 {
        self.gpu_bytes.div_ceil(u64::from(self.gpus_wanted()))
    }
}

/// What a launch still loading has yet to take (its need minus what it already uses).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reservation {
    pub ram_bytes: u64,
    pub gpu_bytes: BTreeMap<u32, u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    Admit {
        gpus: Vec<u32>,
    },
    /// Not now, and why: "needed vs available" in operator terms.
    Wait {
        why: String,
    },
}

pub fn admit(
    config: &Config,
    snapshot: &Snapshot,
    levels: &BTreeMap<Resource, Level>,
    need: &Need,
    loading: &[Reservation],
) -> Admission {
    let wait = |why: String| Admission::Wait { why };
    // The queue pauses while any warn floor is crossed.
    if let Some((r, _)) = levels
        .iter()
        .find(|(_, l)| matches!(l, Level::Warn | Level::Act))
    {
        return wait(format!(
            "{r} is below its warn floor; launches pause until it recovers"
        ));
    }
    if need.ram_bytes > 0 {
        let host = &snapshot.host;
        let Some(available) = host.available_bytes else {
            return wait("MemAvailable is unknown".into());
        };
        let (warn, min) = config.ram.floor_bytes(host.total_bytes);
        let floor = warn.or(min).unwrap_or(0);
        let reserved: u64 = loading.iter().map(|r| r.ram_bytes).sum();
        let room = available.saturating_sub(floor).saturating_sub(reserved);
        if room < need.ram_bytes {
            return wait(format!(
                "RAM: needs {}, room {} (MemAvailable {} - floor {} - loading {})",
                fmt_bytes(need.ram_bytes),
                fmt_bytes(room),
                fmt_bytes(available),
                fmt_bytes(floor),
                fmt_bytes(reserved)
            ));
        }
    }
    if need.gpu_bytes == 0 && need.pinned.is_none() {
        return Admission::Admit { gpus: Vec::new() };
    }
    let gpus = &snapshot.gpus;
    match &gpus.status {
        GpuStatus::Ok if !gpus.stale => {}
        GpuStatus::Ok => return wait("GPU readings are stale (NVML is slow to answer)".into()),
        GpuStatus::Unavailable(why) => return wait(format!("GPU memory unknown: {why}")),
        GpuStatus::Off => return wait("GPU memory unknown: GPU protection is off".into()),
    }
    let per_gpu = need.gpu_bytes_per_gpu();
    // Room on each GPU after its floor and what loading launches will still take.
    let mut rooms: Vec<(u32, Option<u64>, String)> = gpus
        .devices
        .iter()
        .map(|g| {
            let (warn, min) = config.gpu.floor_bytes(g.index, &g.uuid, g.total_bytes);
            let floor = warn.or(min).unwrap_or(0);
            let reserved: u64 = loading
                .iter()
                .filter_map(|r| r.gpu_bytes.get(&g.index))
                .sum();
            let room = g
                .free_bytes
                .filter(|_| g.error.is_none())
                .map(|free| free.saturating_sub(floor).saturating_sub(reserved));
            let text = match (room, g.free_bytes) {
                (Some(room), Some(free)) => format!(
                    "GPU {}: room {} (free {} - floor {} - loading {})",
                    g.index,
                    fmt_bytes(room),
                    fmt_bytes(free),
                    fmt_bytes(floor),
                    fmt_bytes(reserved)
                ),
                _ => format!("GPU {}: free unknown", g.index),
            };
            (g.index, room, text)
        })
        .collect();
    let needs = format!(
        "needs {} on each of {} GPU(s)",
        fmt_bytes(per_gpu),
        need.gpus_wanted()
    );
    if let Some(pinned) = &need.pinned {
        let mut lacking = Vec::new();
        for index in pinned {
            match rooms.iter().find(|r| r.0 == *index) {
                None => lacking.push(format!("GPU {index}: no such GPU")),
                Some((_, room, text)) if room.is_none_or(|r| r < per_gpu) => {
                    lacking.push(text.clone())
                }
                Some(_) => {}
            }
        }
        return if lacking.is_empty() {
            Admission::Admit {
                gpus: pinned.clone(),
            }
        } else {
            wait(format!("{needs}: {}", lacking.join("; ")))
        };
    }
    // Most room first.
    rooms.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let fitting: Vec<u32> = rooms
        .iter()
        .filter(|r| r.1.is_some_and(|room| room >= per_gpu))
        .map(|r| r.0)
        .take(need.gpus_wanted() as usize)
        .collect();
    if fitting.len() < need.gpus_wanted() as usize {
        let best: Vec<String> = rooms.iter().take(4).map(|r| r.2.clone()).collect();
        return wait(format!("{needs}: {}", best.join("; ")));
    }
    let mut chosen = fitting;
    chosen.sort();
    Admission::Admit { gpus: chosen }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{Gpu, GpuSnapshot};
    use std::path::Path;

    const GIB: u64 = 1 << 30;

    fn snapshot(available: u64, free: &[u64]) -> Snapshot {
        Snapshot {
            host: crate::snapshot::HostMemory {
                total_bytes: Some(64 * GIB),
                available_bytes: Some(available),
                ..Default::default()
            },
            gpus: GpuSnapshot {
                status: GpuStatus::Ok,
                devices: free
                    .iter()
                    .enumerate()
                    .map(|(i, f)| Gpu {
                        index: i as u32,
                        total_bytes: Some(80 * GIB),
                        free_bytes: Some(*f),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn config(text: &str) -> Config {
        Config::parse(text, Path::new("t.toml")).unwrap()
    }

    #[test]
    fn picks_the_gpus_with_most_room_and_checks_pinned_ones() {
        let c = config("[ram]\nwarn_available = \"4GiB\"\nmin_available = \"2GiB\"\n[gpu]\nwarn_free = \"2GiB\"\n");
        let s = snapshot(40 * GIB, &[10 * GIB, 50 * GIB, 30 * GIB]);
        let levels = BTreeMap::new();
        let one = Need {
            gpu_bytes: 20 * GIB,
            gpu_count: 1,
            ..Default::default()
        };
        assert_eq!(
            admit(&c, &s, &levels, &one, &[]),
            Admission::Admit { gpus: vec![1] }
        );
        let two = Need {
            gpu_bytes: 40 * GIB,
            gpu_count: 2,
            ..Default::default()
        };
        assert_eq!(
            admit(&c, &s, &levels, &two, &[]),
            Admission::Admit { gpus: vec![1, 2] }
        );
        let pinned = Need {
            gpu_bytes: 20 * GIB,
            pinned: Some(vec![0]),
            ..Default::default()
        };
        let Admission::Wait { why } = admit(&c, &s, &levels, &pinned, &[]) else {
            panic!()
        };
        assert!(why.contains("needs 20.0 GiB on each of 1 GPU(s): GPU 0: room 8.0 GiB (free 10.0 GiB - floor 2.0 GiB - loading 0 B)"), "{why}");
    }

    #[test]
    fn counts_what_loading_launches_will_still_take() {
        let c = config("");
        let s = snapshot(40 * GIB, &[50 * GIB]);
        let need = Need {
            gpu_bytes: 30 * GIB,
            ram_bytes: 10 * GIB,
            gpu_count: 1,
            ..Default::default()
        };
        assert!(matches!(
            admit(&c, &s, &BTreeMap::new(), &need, &[]),
            Admission::Admit { .. }
        ));
        let loading = [Reservation {
            ram_bytes: 0,
            gpu_bytes: BTreeMap::from([(0, 25 * GIB)]),
        }];
        assert!(matches!(
            admit(&c, &s, &BTreeMap::new(), &need, &loading),
            Admission::Wait { .. }
        ));
        let loading = [Reservation {
            ram_bytes: 27 * GIB,
            gpu_bytes: BTreeMap::new(),
        }];
        let Admission::Wait { why } = admit(&c, &s, &BTreeMap::new(), &need, &loading) else {
            panic!()
        };
        assert!(why.starts_with("RAM: needs 10.0 GiB"), "{why}");
    }

    #[test]
    fn pauses_while_a_warn_floor_is_crossed_and_waits_on_unknown_gpus() {
        let c = config("");
        let s = snapshot(40 * GIB, &[50 * GIB]);
        let levels = BTreeMap::from([(Resource::Gpu(0), Level::Warn)]);
        let need = Need {
            ram_bytes: GIB,
            ..Default::default()
        };
        assert!(matches!(
            admit(&c, &s, &levels, &need, &[]),
            Admission::Wait { .. }
        ));
        let mut off = s.clone();
        off.gpus.status = GpuStatus::Unavailable("no driver".into());
        let gpu_need = Need {
            gpu_bytes: GIB,
            gpu_count: 1,
            ..Default::default()
        };
        assert_eq!(
            admit(&c, &off, &BTreeMap::new(), &gpu_need, &[]),
            Admission::Wait {
                why: "GPU memory unknown: no driver".into()
            }
        );
        assert_eq!(
            admit(&c, &off, &BTreeMap::new(), &need, &[]),
            Admission::Admit { gpus: vec![] }
        );
    }
}
