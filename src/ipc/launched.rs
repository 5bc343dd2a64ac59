//! A launched process as the ledger sees it (`reserve::Launched`): the pidfd pinned when its
//! `gpuguard launch` connected (it `exec`s the server: same process), and a poller of its ready
//! URL on a thread of its own.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::peer::exited;
use crate::reserve::{Launched, ReadyUrl};

pub struct PinnedProcess(pub OwnedFd);

impl Launched for PinnedProcess {
    fn exited(&self) -> bool {
        exited(&self.0)
    }

    fn watch_ready(&self, url: &str) -> Box<dyn ReadyUrl> {
        Box::new(Poller::start(url.to_string()))
    }
}

/// Polls a readiness URL every 250 ms until it answers 2xx or is dropped.
struct Poller {
    answered: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Poller {
    fn start(url: String) -> Poller {
        let answered = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, quit) = (answered.clone(), stop.clone());
        let agent = crate::http::agent(Duration::from_secs(2));
        let spawned = std::thread::Builder::new()
            .name("ready-url".into())
            .spawn(move || {
                while !quit.load(Ordering::Relaxed) {
                    if let Ok(response) = agent.get(&url).call() {
                        if response.status().is_success() {
                            flag.store(true, Ordering::Relaxed);
                            return;
                        }
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
