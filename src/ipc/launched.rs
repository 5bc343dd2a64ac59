//! A launched process as the ledger sees it (`reserve::Launched`): the pidfd pinned when its
//! `gpuguard launch` connected (it `exec`s the server: same process), and a poller of its ready
//! URL on a thread of its own. An answer counts only from a socket of the process or its
//! descendants (`sample::own_sockets`); another account's listener at the URL's addresses is not
//! asked, and the log says so.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::peer::exited;
use crate::reserve::{Launched, ReadyUrl};
use crate::sample::own_sockets::OwnSockets;
use crate::sample::sockets;
use crate::snapshot::ProcessId;

pub struct PinnedProcess {
    pub pidfd: OwnedFd,
    /// The process the pidfd refers to.
    pub id: ProcessId,
    pub proc_root: PathBuf,
}

impl Launched for PinnedProcess {
    fn exited(&self) -> bool {
        exited(&self.pidfd)
    }

    fn watch_ready(&self, url: &str) -> Box<dyn ReadyUrl> {
        Box::new(Poller::start(
            url.to_string(),
            self.id,
            self.proc_root.clone(),
        ))
    }
}

/// Polls a readiness URL every 250 ms until the launched process's tree answers it 2xx, or it
/// is dropped.
struct Poller {
    answered: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Poller {
    fn start(url: String, process: ProcessId, proc_root: PathBuf) -> Poller {
        let answered = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, quit) = (answered.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("ready-url".into())
            .spawn(move || {
                let asker = OwnSockets::new(Duration::from_secs(2), proc_root.clone());
                // Each socket of another account found at the URL is logged once.
                let mut logged = BTreeSet::new();
                while !quit.load(Ordering::Relaxed) {
                    let asked = asker.get(
                        &url,
                        || sockets::tree(&proc_root, process),
                        |response| Ok(response.status().is_success()),
                    );
                    for other in asked.ignored {
                        if logged.insert(other.clone()) {
                            tracing::warn!(
                                "ready URL {url} of pid {}: {other}, not of the launched \
                                 processes: not asked, its answer would not count",
                                process.pid
                            );
                        }
                    }
                    if asked.answer == Ok(true) {
                        flag.store(true, Ordering::Relaxed);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot poll a ready URL: {e}");
        }
        Poller { answered, stop }
    }
}

impl ReadyUrl for Poller {
    fn answered(&self) -> bool {
        self.answered.load(Ordering::Relaxed)
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
