//! Memory admission: does a reservation (a model launch, or a request's permit) fit now, and on
//! which GPUs; could it ever fit on this host. Pure: the reservation table (`crates/ledger/src/reserve/`) hands
//! it the room it computed from the latest snapshot, the floors and every other outstanding
//! reservation, and the host's ceilings.
//!
//! Room on a resource is what may still be taken without crossing its warn floor (its act floor
//! where no warn floor is set): free memory minus the floor minus what other reservations have
//! been promised but not taken yet. A reservation fits when what it asks for is within the room
//! of every resource it needs. Its ceiling is the resource's whole memory minus the floor: a
//! demand above the ceiling can never fit, whatever is reserved or freed.

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

    fn needs_gpus(&self) -> String {
        format!(
            "needs {} on each of {} GPU(s)",
            fmt_bytes(self.gpu_bytes_per_gpu),
            self.gpus_wanted()
        )
    }
}

/// One GPU as admission sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuRoom {
    pub index: u32,
    /// What may still be taken; `None` when the GPU's reading is unknown or stale (nothing is
    /// placed on a GPU we cannot see). Negative: the floor is crossed or promises exceed it.
    pub room: Option<i64>,
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
    pub available: Option<u64>,
    pub floor: u64,
    pub promised: u64,
}

/// The host's memory as no reservation changes it: each GPU's and the RAM, less their floors.
/// A demand beyond it can never fit here, whichever pool it is for and whatever is reserved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ceilings {
    /// Each GPU the readings list, by index, with its memory less its floor (`None`: unknown,
    /// it may be large).
    pub gpus: Vec<(u32, Option<u64>)>,
    /// Why the host has no GPU at all, when its readings say so (no NVML, no driver, GPU
    /// support disabled, none found). An empty `gpus` without it is not known yet: the GPUs
    /// may be there (NVML starting, a reading that failed or is stale).
    pub no_gpu: Option<String>,
    /// The host's RAM less its floor (`None`: unknown).
    pub ram: Option<u64>,
}

/// The answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fit {
    /// It fits on these GPUs (empty when it needs none).
    Now { gpus: Vec<u32> },
    /// Not now; it may later. The text says what was needed and what was there.
    Later(Shortfall),
    /// It can never fit on this host while its config stands (more than a whole GPU or the
    /// host's RAM above its floor, a GPU on a host without one, above a model's budget or a
    /// uid's cap).
    Never(Shortfall),
}

/// What a demand was short of: a refusal's reason is derived from it, never read from the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Short {
    /// Host RAM above its floor.
    Ram,
    /// GPU memory above the floor on the GPU(s) it could go on.
    Gpu,
    /// A GPU, on a host that has none (or none of that index).
    NoGpu,
    /// The model's `max_permits` slots.
    MaxPermits,
    /// The model's budget.
    Budget,
    /// The uid's share, or all accounts' other than root (`[clients] max_reserved_per_uid`,
    /// `max_reserved`).
    UidCap,
    /// Its turn: requests of its pool ahead of it.
    Turn,
    /// The launch lock (another model is loading), or launches paused below a warn floor.
    LaunchLock,
    /// What the daemon needs to decide: a GPU reading newer than the request, a process scan
    /// that finds the caller's model.
    Reading,
}

/// What was asked against what there was, for a refusal the caller can act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    pub short: Short,
    pub message: String,
    /// The room there was on the resource that was short (GPU: the best candidate GPU).
    pub free_gpu_bytes: Option<u64>,
    pub free_ram_bytes: Option<u64>,
    /// The GPU the shortfall is about, if one.
    pub gpu: Option<u32>,
}

impl Shortfall {
    /// Short of `short`, as `message` says; no figures.
    pub fn new(short: Short, message: impl Into<String>) -> Shortfall {
        Shortfall {
            short,
            message: message.into(),
            free_gpu_bytes: None,
            free_ram_bytes: None,
            gpu: None,
        }
    }
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

/// Why `demand` can never fit on this host, if it cannot: more RAM than the host has above its
/// floor, more GPU memory than any (or enough) of its GPUs has above its floor, a GPU that is
/// not there. Only what the readings tell for certain: an unknown GPU, or GPUs not read yet,
/// may be large.
pub fn never(demand: &Demand, host: &Ceilings) -> Option<Shortfall> {
    if let Some(ceiling) = host.ram.filter(|&c| c < demand.ram_bytes) {
        return Some(Shortfall::new(
            Short::Ram,
            format!(
                "RAM: needs {}, more than the host's RAM above its floor ({})",
                fmt_bytes(demand.ram_bytes),
                fmt_bytes(ceiling)
            ),
        ));
    }
    let wanted = demand.gpus_wanted();
    if wanted == 0 {
        return None;
    }
    let per_gpu = demand.gpu_bytes_per_gpu;
    if host.gpus.is_empty() {
        let why = host.no_gpu.as_ref()?;
        return Some(Shortfall::new(
            Short::NoGpu,
            format!("{}: this host has no GPU ({why})", demand.needs_gpus()),
        ));
    }
    let ceiling = |index: u32| host.gpus.iter().find(|(i, _)| *i == index);
    if let Some(pinned) = &demand.pinned {
        let mut short = None;
        let mut lacking = Vec::new();
        for &index in pinned {
            match ceiling(index) {
                None => {
                    short = Some(Short::NoGpu);
                    lacking.push(format!("GPU {index}: no such GPU"));
                }
                Some(&(_, Some(c))) if c < per_gpu => {
                    short.get_or_insert(Short::Gpu);
                    lacking.push(format!("GPU {index}: {} above its floor", fmt_bytes(c)));
                }
                Some(_) => {}
            }
        }
        let short = short?;
        return Some(Shortfall {
            gpu: pinned.first().copied(),
            ..Shortfall::new(
                short,
                format!("{}: {}", demand.needs_gpus(), lacking.join("; ")),
            )
        });
    }
    // Only when every GPU is known can "never" be said; an unknown one may be large.
    let all_known = host.gpus.iter().all(|(_, c)| c.is_some());
    let possible = host
        .gpus
        .iter()
        .filter(|(_, c)| c.is_none_or(|c| c >= per_gpu))
        .count();
    if !all_known || possible >= wanted {
        return None;
    }
    let gpus: Vec<String> = host
        .gpus
        .iter()
        .take(8)
        .map(|&(i, c)| format!("GPU {i}: {} above its floor", fmt_bytes(c.unwrap_or(0))))
        .collect();
    Some(Shortfall::new(
        Short::Gpu,
        format!(
            "{}: the host has {} GPU(s), {possible} of them large enough ({})",
            demand.needs_gpus(),
            host.gpus.len(),
            gpus.join("; ")
        ),
    ))
}

/// Where a demand fits now, given the room on every GPU and in RAM; else what it waits for.
/// (Whether it could ever fit is `never`'s to say.)
pub fn place(demand: &Demand, gpus: &[GpuRoom], ram: &RamRoom) -> Result<Vec<u32>, Shortfall> {
    ram_shortfall(demand, ram)?;
    if demand.gpus_wanted() == 0 {
        return Ok(Vec::new());
    }
    let per_gpu = demand.gpu_bytes_per_gpu;
    let needs = demand.needs_gpus();
    let fits = |g: &GpuRoom| g.room.is_some_and(|r| r >= per_gpu as i64);
    if let Some(pinned) = &demand.pinned {
        let mut lacking = Vec::new();
        let mut short: Option<&GpuRoom> = None;
        for index in pinned {
            match gpus.iter().find(|g| g.index == *index) {
                None => lacking.push(format!("GPU {index}: not read yet")),
                Some(g) if !fits(g) => {
                    lacking.push(describe_gpu(g));
                    short.get_or_insert(g);
                }
                Some(_) => {}
            }
        }
        if lacking.is_empty() {
            return Ok(pinned.clone());
        }
        return Err(Shortfall {
            short: Short::Gpu,
            message: format!("{needs}: {}", lacking.join("; ")),
            free_gpu_bytes: short.and_then(|g| positive(g.room)),
            free_ram_bytes: positive(ram.room),
            gpu: short.map(|g| g.index),
        });
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
        return Ok(chosen);
    }
    let best: Vec<String> = order.iter().take(4).map(|g| describe_gpu(g)).collect();
    Err(Shortfall {
        short: Short::Gpu,
        message: if gpus.is_empty() {
            format!("{needs}: no GPU is known yet")
        } else {
            format!("{needs}: {}", best.join("; "))
        },
        free_gpu_bytes: order.first().and_then(|g| positive(g.room)),
        free_ram_bytes: positive(ram.room),
        gpu: order.first().map(|g| g.index),
    })
}

fn ram_shortfall(demand: &Demand, ram: &RamRoom) -> Result<(), Shortfall> {
    if demand.ram_bytes == 0 || ram.room.is_some_and(|r| r >= demand.ram_bytes as i64) {
        return Ok(());
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
    Err(Shortfall {
        free_ram_bytes: positive(ram.room),
        ..Shortfall::new(Short::Ram, message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, room_gib: i64) -> GpuRoom {
        GpuRoom {
            index,
            room: Some(room_gib * GIB as i64),
            free: Some((room_gib.max(0) as u64 + 2) * GIB),
            floor: 2 * GIB,
            promised: 0,
            preferred: false,
        }
    }

    fn ram(room_gib: i64) -> RamRoom {
        RamRoom {
            room: Some(room_gib * GIB as i64),
            available: Some(40 * GIB),
            floor: 4 * GIB,
            promised: 0,
        }
    }

    /// A host of GPUs of these sizes above their floors (GiB; `None`: unknown) and 60 GiB of RAM
    /// above its floor.
    fn host(gpus: &[Option<u64>]) -> Ceilings {
        Ceilings {
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, c)| (i as u32, c.map(|c| c * GIB)))
                .collect(),
            no_gpu: None,
            ram: Some(60 * GIB),
        }
    }

    fn demand(per_gpu_gib: u64, count: u32) -> Demand {
        Demand {
            gpu_bytes_per_gpu: per_gpu_gib * GIB,
            gpu_count: count,
            ..Default::default()
        }
    }

    fn pinned(per_gpu_gib: u64, gpus: &[u32]) -> Demand {
        Demand {
            pinned: Some(gpus.to_vec()),
            ..demand(per_gpu_gib, gpus.len() as u32)
        }
    }

    #[test]
    fn picks_the_gpus_with_most_room_preferring_the_pools_own() {
        let gpus = [gpu(0, 8), gpu(1, 48), gpu(2, 28)];
        assert_eq!(place(&demand(20, 1), &gpus, &ram(10)), Ok(vec![1]));
        assert_eq!(place(&demand(20, 2), &gpus, &ram(10)), Ok(vec![1, 2]));
        let mut preferring = gpus.clone();
        preferring[2].preferred = true;
        assert_eq!(place(&demand(20, 1), &preferring, &ram(10)), Ok(vec![2]));
    }

    #[test]
    fn a_pinned_gpu_is_checked_and_the_refusal_says_what_was_there() {
        let gpus = [gpu(0, 8), gpu(1, 48)];
        let s = place(&pinned(20, &[0]), &gpus, &ram(10)).unwrap_err();
        assert_eq!(
            s.message,
            "needs 20.0 GiB on each of 1 GPU(s): GPU 0: room 8.0 GiB (free 10.0 GiB - floor 2.0 GiB - promised 0 B)"
        );
        assert_eq!(s.short, Short::Gpu);
        assert_eq!(s.free_gpu_bytes, Some(8 * GIB));
        assert_eq!(s.gpu, Some(0));
    }

    #[test]
    fn more_than_any_gpu_or_the_host_is_never_and_says_what_was_short() {
        let h = host(&[Some(24), Some(24)]);
        let short = |d: &Demand, h: &Ceilings| never(d, h).map(|s| s.short);
        assert_eq!(short(&demand(30, 1), &h), Some(Short::Gpu));
        assert_eq!(short(&demand(20, 3), &h), Some(Short::Gpu));
        assert_eq!(short(&demand(20, 2), &h), None);
        assert_eq!(short(&pinned(30, &[1]), &h), Some(Short::Gpu));
        assert_eq!(short(&pinned(1, &[2]), &h), Some(Short::NoGpu));
        let ram_hog = Demand {
            ram_bytes: 100 * GIB,
            ..Default::default()
        };
        let s = never(&ram_hog, &h).unwrap();
        assert_eq!(s.short, Short::Ram);
        assert_eq!(
            s.message,
            "RAM: needs 100.0 GiB, more than the host's RAM above its floor (60.0 GiB)"
        );
        // An unknown GPU may be large, and so may GPUs not read yet: not "never".
        assert_eq!(short(&demand(30, 1), &host(&[Some(24), None])), None);
        assert_eq!(short(&pinned(30, &[1]), &host(&[Some(24), None])), None);
        assert_eq!(short(&demand(1, 1), &host(&[])), None);
        assert_eq!(short(&pinned(1, &[0]), &host(&[])), None);
        // Unknown RAM may be large.
        let unknown_ram = Ceilings {
            ram: None,
            ..host(&[])
        };
        assert_eq!(short(&ram_hog, &unknown_ram), None);
    }

    #[test]
    fn a_gpu_on_a_host_without_one_is_never_and_no_gpu_is_needed_for_ram() {
        let none = Ceilings {
            no_gpu: Some("NVML library not loadable: no NVIDIA driver?".into()),
            ..host(&[])
        };
        let s = never(&demand(20, 1), &none).unwrap();
        assert_eq!(s.short, Short::NoGpu);
        assert_eq!(
            s.message,
            "needs 20.0 GiB on each of 1 GPU(s): this host has no GPU (NVML library not loadable: no NVIDIA driver?)"
        );
        // A GPU by index, even of no size, is a GPU.
        assert_eq!(
            never(&pinned(0, &[0]), &none).map(|s| s.short),
            Some(Short::NoGpu)
        );
        let ram_only = Demand {
            ram_bytes: GIB,
            ..Default::default()
        };
        assert_eq!(never(&ram_only, &none), None);
    }

    #[test]
    fn ram_is_checked_first_and_negative_room_never_fits() {
        let gpus = [gpu(0, -1)];
        let d = Demand {
            ram_bytes: 12 * GIB,
            ..demand(1, 1)
        };
        let s = place(&d, &gpus, &ram(10)).unwrap_err();
        assert_eq!(s.short, Short::Ram);
        assert!(
            s.message.starts_with("RAM: needs 12.0 GiB, room 10.0 GiB"),
            "{}",
            s.message
        );
        let s = place(&demand(1, 1), &gpus, &ram(10)).unwrap_err();
        assert!(s.message.contains("room -1.0 GiB"), "{}", s.message);
        assert_eq!(s.free_gpu_bytes, Some(0));
        assert_eq!(place(&Demand::default(), &gpus, &ram(0)), Ok(vec![]));
    }
}
