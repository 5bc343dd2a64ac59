//! Each floor's reading for a tick: the figure, its warn and act floors, whether it may be acted
//! on, and what victims are ranked by.

use super::*;

/// One resource's reading against its floors.
pub(in crate::policy) struct Reading {
    pub resource: Resource,
    pub available: Option<u64>,
    pub warn: Option<u64>,
    pub min: Option<u64>,
    /// Something other than `available` says act (swap, PSI), and why.
    pub act_because: Option<String>,
    pub warn_because: Option<String>,
    /// Why the reading is unknown, if the source said (e.g. NVML: the GPU fell off the bus).
    pub error: Option<String>,
    /// False when the reading is stale: it may alert, never act.
    pub may_act: bool,
    pub action: FloorAction,
    /// When the figure was sampled (daemon clock): RAM every tick, a GPU when NVML answered.
    pub sampled_at: Option<Duration>,
    /// What victims are ranked by.
    pub short: Short,
    /// RAM: `Shmem` (tmpfs, shared memory), for messages and the unattributable-shortfall rule.
    pub shmem: Option<u64>,
}

impl Reading {
    pub(in crate::policy) fn level(&self) -> Level {
        let Some(available) = self.available else {
            return Level::Unknown;
        };
        if self.min.is_some_and(|m| available < m) || self.act_because.is_some() {
            Level::Act
        } else if self.warn.is_some_and(|w| available < w) || self.warn_because.is_some() {
            Level::Warn
        } else {
            Level::Ok
        }
    }

    /// What a victim must give back for the resource to recover, up to the warn floor (where
    /// the brake forgets the victim), else the act floor. `None` for swap, whose per-process
    /// figures count shared pages in every process that maps them (RAM's are summed only where
    /// the daemon read their proportional share, PSS).
    pub(in crate::policy) fn need(&self) -> Option<u64> {
        if self.short == Short::Swap {
            return None;
        }
        let floor = self.warn.or(self.min)?;
        Some(floor.saturating_sub(self.available?))
    }

    /// How far below its act floor the reading is (`None`: unknown).
    pub(in crate::policy) fn shortfall(&self) -> Option<u64> {
        Some(self.min?.saturating_sub(self.available?))
    }

    /// Far below the floor (under half of it): no time for SIGTERM's grace.
    pub(in crate::policy) fn far_below(&self) -> bool {
        matches!((self.available, self.min), (Some(a), Some(m)) if a < m / 2)
    }

    pub(in crate::policy) fn describe(&self) -> String {
        let what = match self.resource {
            Resource::Ram => "RAM available".to_string(),
            Resource::Gpu(i) => format!("GPU {i} free"),
        };
        let (warn_key, min_key) = match self.resource {
            Resource::Ram => ("warn_available", "min_available"),
            Resource::Gpu(_) => ("warn_free", "min_free"),
        };
        let mut text = match self.available {
            None => match &self.error {
                Some(e) => format!("{what} unknown ({e})"),
                None => format!("{what} unknown"),
            },
            Some(a) => match (self.min, self.warn) {
                (Some(m), _) if a < m => format!("{what} {} < {min_key} {}", bytes(a), bytes(m)),
                (_, Some(w)) if a < w => format!("{what} {} < {warn_key} {}", bytes(a), bytes(w)),
                _ => format!("{what} {}", bytes(a)),
            },
        };
        for because in [&self.act_because, &self.warn_because]
            .into_iter()
            .flatten()
        {
            text.push_str("; ");
            text.push_str(because);
        }
        if let (Some(shmem), Level::Warn | Level::Act) = (self.shmem, self.level()) {
            text.push_str(&format!("; Shmem (tmpfs, shared memory) {}", bytes(shmem)));
        }
        text
    }

    /// Above the warn floor by MemAvailable (or the act floor where there is no warn floor).
    pub(in crate::policy) fn above_warn(&self) -> bool {
        match (self.available, self.warn.or(self.min)) {
            (Some(a), Some(w)) => a >= w,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// What the executor reads again just before acting: MemAvailable, when it being below
    /// `min_available` is why this acts. An act for swap or PSI has no MemAvailable level that
    /// means "recovered" (it is above the floor already), so it gets no recheck.
    pub(in crate::policy) fn recheck(&self) -> Option<Recheck> {
        match (self.resource, self.available, self.min) {
            (Resource::Ram, Some(a), Some(m)) if a < m => Some(Recheck {
                resource: Resource::Ram,
                below_bytes: m,
            }),
            _ => None,
        }
    }

    pub(in crate::policy) fn kind(&self) -> ReasonKind {
        match self.resource {
            Resource::Ram => ReasonKind::RamFloor,
            Resource::Gpu(_) => ReasonKind::GpuFloor,
        }
    }
}

/// The readings of this snapshot, with their floors resolved against the totals. A reading that
/// is missing, inconsistent or against a floor that cannot be right is unknown (`available` is
/// `None`, `error` says why). `tracked`: resources the policy holds state for (an incident, a
/// level, a held process), which get a reading even with no floor or no GPU left.
pub(in crate::policy) fn readings(
    config: &Config,
    snapshot: &Snapshot,
    tracked: &[Resource],
) -> Vec<Reading> {
    let mut out = vec![ram_reading(config, snapshot)];
    for gpu in &snapshot.gpus.devices {
        let resource = Resource::Gpu(gpu.index);
        // No floors configured: no reading (an unknown total only makes the floors unknown).
        if config.gpu.floors_for(gpu.index, &gpu.uuid) == (None, None)
            && !tracked.contains(&resource)
        {
            continue;
        }
        let (warn, min) = config
            .gpu
            .floor_bytes(gpu.index, &gpu.uuid, gpu.total_bytes);
        let error = gpu
            .untrusted()
            .or_else(|| impossible_floor("min_free", min, gpu.total_bytes));
        out.push(Reading {
            resource,
            available: gpu.free_bytes.filter(|_| error.is_none()),
            warn,
            min,
            act_because: None,
            warn_because: None,
            error,
            may_act: !snapshot.gpus.stale,
            action: config.gpu.action,
            sampled_at: snapshot.gpus.sampled_at,
            short: Short::Gpu(gpu.index),
            shmem: None,
        });
    }
    // A GPU the policy was watching that NVML no longer lists: unknown, never "fine".
    for &resource in tracked {
        let Resource::Gpu(index) = resource else {
            continue;
        };
        if snapshot.gpus.devices.iter().all(|g| g.index != index) {
            out.push(Reading {
                resource,
                available: None,
                warn: None,
                min: None,
                act_because: None,
                warn_because: None,
                error: Some("no longer reported by NVML".into()),
                may_act: false,
                action: config.gpu.action,
                sampled_at: None,
                short: Short::Gpu(index),
                shmem: None,
            });
        }
    }
    out
}

/// Host RAM against its floors: MemAvailable, and swap and PSI where configured.
pub(in crate::policy) fn ram_reading(config: &Config, snapshot: &Snapshot) -> Reading {
    let host = &snapshot.host;
    let ram = &config.ram;
    let mut act_because = None;
    let mut warn_because = None;
    let (warn, min) = ram.floor_bytes(host.total_bytes);
    let error = host
        .inconsistency()
        .or_else(|| impossible_floor("min_available", min, host.total_bytes));
    let available = host.available_bytes.filter(|_| error.is_none());
    let mut swap_short = false;
    if let (Some(floor), Some(total), Some(free)) = (
        ram.min_swap_free,
        host.swap_total_bytes,
        host.trusted_swap_free_bytes(),
    ) {
        if let Some(floor) = floor
            .resolve(Some(total))
            .filter(|&f| total > 0 && f < total)
        {
            if free < floor {
                swap_short = true;
                act_because = Some(format!(
                    "swap free {} < min_swap_free {}",
                    bytes(free),
                    bytes(floor)
                ));
            }
        }
    }
    let psi = host
        .psi_some_avg10
        .filter(|p| p.is_finite() && (0.0..=100.0).contains(p));
    if let (Some(limit), Some(psi)) = (ram.psi_some_avg10, psi) {
        if psi > limit {
            let text = format!("PSI memory some avg10 {psi:.1}% > {limit:.1}%");
            let low = matches!((available, warn), (Some(a), Some(w)) if a < w);
            if low && act_because.is_none() {
                act_because = Some(text);
            } else {
                warn_because = Some(text);
            }
        }
    }
    let ram_short = matches!((available, min), (Some(a), Some(m)) if a < m);
    Reading {
        resource: Resource::Ram,
        available,
        warn,
        min,
        act_because,
        warn_because,
        error,
        may_act: true,
        action: ram.action,
        sampled_at: Some(snapshot.at),
        short: if swap_short && !ram_short {
            Short::Swap
        } else {
            Short::Ram
        },
        shmem: host.shmem_bytes,
    }
}

/// An act floor at or above the total would make every process a victim, always: the config
/// checks refuse it, and should one get through (a GPU seen only later), it is not enforced.
pub(in crate::policy) fn impossible_floor(
    key: &str,
    min: Option<u64>,
    total: Option<u64>,
) -> Option<String> {
    match (min, total) {
        (Some(m), Some(t)) if m >= t => Some(format!(
            "{key} {} is at or above the total {}: floor not enforced",
            bytes(m),
            bytes(t)
        )),
        _ => None,
    }
}

/// Why a reading may not be acted on, for messages.
pub(in crate::policy) fn untrusted(reading: &Reading) -> String {
    match (&reading.error, reading.may_act) {
        (Some(e), _) => format!("{} reading is unknown ({e})", reading.resource),
        (None, false) => format!("{} reading is stale", reading.resource),
        (None, true) => format!("{} reading is unknown", reading.resource),
    }
}
