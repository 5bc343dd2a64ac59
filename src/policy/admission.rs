//! Memory admission: does a reservation (a model launch, or a request's permit) fit now, and on
//! which GPUs. Pure: the reservation table (`src/reserve/`) hands it the room it computed from the
//! latest snapshot, the floors and every other outstanding reservation.
//!
//! Room on a resource is what may still be taken without crossing its warn floor (its act floor
//! where no warn floor is set): free memory minus the floor minus what other reservations have
//! been promised but not taken yet. A reservation fits when what it asks for is within the room
//! of every resource it needs.

use serde::{Deserialize, Serialize};

use crate::units::fmt_bytes;

/// What a reservation asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Demand {
    /// GPU memory on each GPU it is placed on.
    pub gpu_bytes_per_gpu: u64,
    /// How many GPUs it is placed on; 0 = it needs no GPU.
    pub gpu_count: u32,
    /// GPUs the caller chose (CUDA_VISIBLE_DEVICES, --gpu, a permit's `gpu`): checked, not chosen.
    pub pinned: Option<Vec<u32>>,
    pub ram_bytes: u64,
}

impl Demand {
    /// How many GPUs it takes.
    pub fn gpus_wanted(&self) -> usize {
        match &self.pinned {
            Some(p) => p.len(),
            None => self.gpu_count as usize,
        }
    }

    pub fn gpu_bytes_total(&self) -> u64 {
        self.gpu_bytes_per_gpu
            .saturating_mul(self.gpus_wanted() as u64)
    }
}

/// One GPU as admission sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuRoom {
    pub index: u32,
    /// What may still be taken; `None` when the GPU's reading is unknown or stale (nothing is
    /// placed on a GPU we cannot see). Negative: the floor is crossed or promises exceed it.
    pub room: Option<i64>,
    /// The GPU's memory minus its floor: a demand above it can never fit here.
    pub ceiling: Option<u64>,
    /// Free memory, the floor and what others have been promised, to explain a refusal.
    pub free: Option<u64>,
    pub floor: u64,
    pub promised: u64,
    /// Where the pool already holds memory: preferred when placing a demand that names no GPU.
    pub preferred: bool,
}

/// Host RAM as admission sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RamRoom {
    pub room: Option<i64>,
    pub ceiling: Option<u64>,
    pub available: Option<u64>,
    pub floor: u64,
    pub promised: u64,
}

/// The answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fit {
    /// It fits on these GPUs (empty when it needs none).
    Now { gpus: Vec<u32> },
    /// Not now; it may later. The text says what was needed and what was there.
    Later(Shortfall),
    /// It can never fit on this host (more than a whole GPU or the host's RAM, above its floor).
    Never(Shortfall),
}

/// What was asked against what there was, for a refusal the caller can act on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shortfall {
    pub message: String,
    /// The room there was on the resource that was short (GPU: the best candidate GPU).
    pub free_gpu_bytes: Option<u64>,
    pub free_ram_bytes: Option<u64>,
    /// The GPU the shortfall is about, if one.
    pub gpu: Option<u32>,
}

fn show(room: Option<i64>) -> String {
    match room {
        None => "unknown".into(),
        Some(r) if r < 0 => format!("-{}", fmt_bytes(r.unsigned_abs())),
        Some(r) => fmt_bytes(r as u64),
    }
}

fn positive(room: Option<i64>) -> Option<u64> {
    room.map(|r| r.max(0) as u64)
}

fn describe_gpu(g: &GpuRoom) -> String {
    match g.free {
        Some(free) => format!(
            "GPU {}: room {} (free {} - floor {} - promised {})",
            g.index,
            show(g.room),
            fmt_bytes(free),
            fmt_bytes(g.floor),
            fmt_bytes(g.promised)
        ),
        None => format!("GPU {}: free memory unknown", g.index),
    }
}

/// Where a demand fits, given the room on every GPU and in RAM.
pub fn place(demand: &Demand, gpus: &[GpuRoom], ram: &RamRoom) -> Fit {
    if let Some(shortfall) = ram_shortfall(demand, ram) {
        return shortfall;
    }
    if demand.gpus_wanted() == 0 {
        return Fit::Now { gpus: Vec::new() };
    }
    let per_gpu = demand.gpu_bytes_per_gpu;
    let needs = format!(
        "needs {} on each of {} GPU(s)",
        fmt_bytes(per_gpu),
        demand.gpus_wanted()
    );
    let fits = |g: &GpuRoom| g.room.is_some_and(|r| r >= per_gpu as i64);
    let can_ever = |g: &GpuRoom| g.ceiling.is_none_or(|c| c >= per_gpu);
    if let Some(pinned) = &demand.pinned {
        let mut lacking = Vec::new();
        let mut never = false;
        let mut short: Option<&GpuRoom> = None;
        for index in pinned {
            match gpus.iter().find(|g| g.index == *index) {
                None => {
                    lacking.push(format!("GPU {index}: no such GPU"));
                    never = !gpus.is_empty();
                }
                Some(g) if !fits(g) => {
                    never |= !can_ever(g);
                    lacking.push(describe_gpu(g));
                    short.get_or_insert(g);
                }
                Some(_) => {}
            }
        }
        if lacking.is_empty() {
            return Fit::Now {
                gpus: pinned.clone(),
            };
        }
        let shortfall = Shortfall {
            message: format!("{needs}: {}", lacking.join("; ")),
            free_gpu_bytes: short.and_then(|g| positive(g.room)),
            free_ram_bytes: positive(ram.room),
            gpu: short.map(|g| g.index),
        };
        return if never {
            Fit::Never(shortfall)
        } else {
            Fit::Later(shortfall)
        };
    }
    // Preferred GPUs first (where the pool already is), then most room, then lowest index.
    let mut order: Vec<&GpuRoom> = gpus.iter().collect();
    order.sort_by(|a, b| {
        b.preferred
            .cmp(&a.preferred)
            .then(b.room.cmp(&a.room))
            .then(a.index.cmp(&b.index))
    });
    let mut chosen: Vec<u32> = order
        .iter()
        .filter(|g| fits(g))
        .take(demand.gpus_wanted())
        .map(|g| g.index)
        .collect();
    if chosen.len() == demand.gpus_wanted() {
        chosen.sort_unstable();
        return Fit::Now { gpus: chosen };
    }
    let possible = gpus.iter().filter(|g| can_ever(g)).count();
    let best: Vec<String> = order.iter().take(4).map(|g| describe_gpu(g)).collect();
    let shortfall = Shortfall {
        message: if gpus.is_empty() {
            format!("{needs}: no GPU is known")
        } else {
            format!("{needs}: {}", best.join("; "))
        },
        free_gpu_bytes: order.first().and_then(|g| positive(g.room)),
        free_ram_bytes: positive(ram.room),
        gpu: order.first().map(|g| g.index),
    };
    // Only when every GPU is known can "never" be said; an unknown one may be large.
    let all_known = !gpus.is_empty() && gpus.iter().all(|g| g.ceiling.is_some());
    if all_known && possible < demand.gpus_wanted() {
        Fit::Never(shortfall)
    } else {
        Fit::Later(shortfall)
    }
}

fn ram_shortfall(demand: &Demand, ram: &RamRoom) -> Option<Fit> {
    if demand.ram_bytes == 0 {
        return None;
    }
    if ram.room.is_some_and(|r| r >= demand.ram_bytes as i64) {
        return None;
    }
    let message = match ram.available {
        Some(available) => format!(
            "RAM: needs {}, room {} (MemAvailable {} - floor {} - promised {})",
            fmt_bytes(demand.ram_bytes),
            show(ram.room),
            fmt_bytes(available),
            fmt_bytes(ram.floor),
            fmt_bytes(ram.promised)
        ),
        None => format!(
            "RAM: needs {}, MemAvailable unknown",
            fmt_bytes(demand.ram_bytes)
        ),
    };
    let shortfall = Shortfall {
        message,
        free_gpu_bytes: None,
        free_ram_bytes: positive(ram.room),
        gpu: None,
    };
    Some(if ram.ceiling.is_some_and(|c| c < demand.ram_bytes) {
        Fit::Never(shortfall)
    } else {
        Fit::Later(shortfall)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, room_gib: i64, total_gib: u64) -> GpuRoom {
        GpuRoom {
            index,
            room: Some(room_gib * GIB as i64),
            ceiling: Some(total_gib * GIB),
            free: Some((room_gib.max(0) as u64 + 2) * GIB),
            floor: 2 * GIB,
            promised: 0,
            preferred: false,
        }
    }

    fn ram(room_gib: i64) -> RamRoom {
        RamRoom {
            room: Some(room_gib * GIB as i64),
            ceiling: Some(60 * GIB),
            available: Some(40 * GIB),
            floor: 4 * GIB,
            promised: 0,
        }
    }

    fn demand(per_gpu_gib: u64, count: u32) -> Demand {
        Demand {
            gpu_bytes_per_gpu: per_gpu_gib * GIB,
            gpu_count: count,
            ..Default::default()
        }
    }

    #[test]
    fn picks_the_gpus_with_most_room_preferring_the_pools_own() {
        let gpus = [gpu(0, 8, 80), gpu(1, 48, 80), gpu(2, 28, 80)];
        assert_eq!(
            place(&demand(20, 1), &gpus, &ram(10)),
            Fit::Now { gpus: vec![1] }
        );
        assert_eq!(
            place(&demand(20, 2), &gpus, &ram(10)),
            Fit::Now { gpus: vec![1, 2] }
        );
        let mut preferring = gpus.clone();
        preferring[2].preferred = true;
        assert_eq!(
            place(&demand(20, 1), &preferring, &ram(10)),
            Fit::Now { gpus: vec![2] }
        );
    }

    #[test]
    fn a_pinned_gpu_is_checked_and_the_refusal_says_what_was_there() {
        let gpus = [gpu(0, 8, 80), gpu(1, 48, 80)];
        let pinned = Demand {
            pinned: Some(vec![0]),
            ..demand(20, 1)
        };
        let Fit::Later(s) = place(&pinned, &gpus, &ram(10)) else {
            panic!()
        };
        assert_eq!(
            s.message,
            "needs 20.0 GiB on each of 1 GPU(s): GPU 0: room 8.0 GiB (free 10.0 GiB - floor 2.0 GiB - promised 0 B)"
        );
        assert_eq!(s.free_gpu_bytes, Some(8 * GIB));
        assert_eq!(s.gpu, Some(0));
    }

    #[test]
    fn more_than_any_gpu_or_the_host_is_never_and_said_at_once() {
        let gpus = [gpu(0, 10, 24), gpu(1, 10, 24)];
        assert!(matches!(
            place(&demand(30, 1), &gpus, &ram(10)),
            Fit::Never(_)
        ));
        assert!(matches!(
            place(&demand(20, 3), &gpus, &ram(10)),
            Fit::Never(_)
        ));
        assert!(matches!(
            place(&demand(20, 1), &gpus, &ram(10)),
            Fit::Later(_)
        ));
        let ram_hog = Demand {
            ram_bytes: 100 * GIB,
            ..Default::default()
        };
        assert!(matches!(place(&ram_hog, &gpus, &ram(10)), Fit::Never(_)));
        // An unknown GPU may be large: not "never".
        let mut unknown = gpus.to_vec();
        unknown[1].ceiling = None;
        unknown[1].room = None;
        assert!(matches!(
            place(&demand(30, 1), &unknown, &ram(10)),
            Fit::Later(_)
        ));
    }

    #[test]
    fn ram_is_checked_first_and_negative_room_never_fits() {
        let gpus = [gpu(0, -1, 80)];
        let d = Demand {
            ram_bytes: 12 * GIB,
            ..demand(1, 1)
        };
        let Fit::Later(s) = place(&d, &gpus, &ram(10)) else {
            panic!()
        };
        assert!(
            s.message.starts_with("RAM: needs 12.0 GiB, room 10.0 GiB"),
            "{}",
            s.message
        );
        let Fit::Later(s) = place(&demand(1, 1), &gpus, &ram(10)) else {
            panic!()
        };
        assert!(s.message.contains("room -1.0 GiB"), "{}", s.message);
        assert_eq!(s.free_gpu_bytes, Some(0));
        assert_eq!(
            place(&Demand::default(), &gpus, &ram(0)),
            Fit::Now { gpus: vec![] }
        );
    }
}
