//! Runs the emergency paths once at start, on made-up data and on gpuguard itself, so their code
//! is resident (and, with `--lock-memory`, locked) before memory runs short: the floor decision
//! (choose, SIGTERM, SIGKILL on growth, the next victim, each entered as carried out) and the
//! signal path's verification.
//! Nothing is signalled and nothing is logged.

use std::path::Path;
use std::time::Duration;

use crate::act::ProcessControl;
use crate::config::Config;
use crate::policy::{evaluate, Executed, Launches, Outcome, PolicyState};
use crate::snapshot::{HostMemory, Process, ProcessTable, Snapshot};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

const CONFIG: &str = "[ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\n\
    [gpu]\nenabled = false\n\
    [[model]]\nname = \"warm\"\nmatch = { comm = \"warm\" }\nram = \"1GiB\"\n";

/// A floor incident from start to end, then the signal path's checks on this process.
pub(super) fn warm_up(control: &dyn ProcessControl) {
    std::hint::black_box(floor_incident());
    control.warm_up();
}

/// Plays a floor incident through the policy; returns the verbs it planned.
fn floor_incident() -> Vec<&'static str> {
    let Ok(config) = Config::parse(CONFIG, Path::new("(warm-up)")) else {
        return Vec::new();
    };
    let mut state = PolicyState::default();
    // (ms, MemAvailable, the victim's RSS, its state): SIGTERM, growth, SIGKILL, gone, the next
    // victim, recovered.
    let steps = [
        (0, 3 * GIB, 2 * GIB, 'R'),
        (2, 3 * GIB, 2 * GIB, 'R'),
        (4, 3 * GIB, 2 * GIB + 64 * MIB, 'R'),
        (6, 3 * GIB, 0, 'X'),
        // The next victim once the gone one's memory had its time to come back (RAM_RELEASE).
        (1006, 3 * GIB, 0, 'X'),
        (1008, 16 * GIB, 0, 'X'),
    ];
    let mut verbs = Vec::new();
    for (ms, available, rss, state_letter) in steps {
        let plan = evaluate(
            &config,
            &snapshot(ms, available, rss, state_letter),
            &Launches::default(),
            &mut state,
        );
        verbs.extend(plan.actions.iter().map(|a| a.verb.as_str()));
        let done = plan.actions.into_iter().map(|action| Executed {
            action,
            outcome: Outcome::Done,
        });
        state.apply(&done.collect::<Vec<_>>());
    }
    verbs
}

fn snapshot(ms: u64, available: u64, rss: u64, state: char) -> Snapshot {
    let at = Duration::from_millis(ms);
    let process = |pid: i32, comm: &str, rss_bytes: u64, state: char| Process {
        pid,
        start_time: pid as u64,
        ppid: 1,
        uid: 1000,
        state,
        comm: comm.into(),
        cmdline: comm.into(),
        cgroup: "/warm.slice".into(),
        rss_bytes,
        swap_bytes: Some(0),
        kernel_thread: false,
        exe: None,
        pss_bytes: None,
    };
    Snapshot {
        at,
        host: HostMemory {
            total_bytes: Some(64 * GIB),
            available_bytes: Some(available),
            swap_total_bytes: Some(0),
            swap_free_bytes: Some(0),
            psi_some_avg10: None,
            shmem_bytes: None,
        },
        processes: ProcessTable {
            pss_read: false,
            scanned_at: Some(at),
            processes: vec![
                process(10, "warm", rss, state),
                process(20, "other", GIB, 'S'),
            ],
        },
        self_pid: 1,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_warm_up_runs_the_whole_floor_path() {
        assert_eq!(
            super::floor_incident(),
            ["terminate", "kill", "terminate"],
            "SIGTERM, SIGKILL on growth, the next victim"
        );
    }
}
