//! The daemon's one tokio runtime: the socket server (`ipc::server`) and the metrics endpoint
//! (`metrics::serve`) are tasks on it, on the `io` thread (current-thread: the control loop
//! never waits behind it). Each is its own task tree: a panic in one ends that task alone (tokio
//! catches it), so a metrics endpoint that fails or panics leaves the socket served, and the
//! other way round. Their connection caps are their own.

use anyhow::Context;

/// Starts the runtime on the `io` thread, where it runs until the process exits; what is
/// spawned on the handle runs there.
pub(crate) fn start() -> anyhow::Result<tokio::runtime::Handle> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the socket's and metrics' runtime")?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("io".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))
        .context("starting the io thread")?;
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two servers' isolation is the runtime's: a task that panics (the metrics endpoint,
    /// say) ends alone, and what else runs there, or is spawned later, goes on.
    #[test]
    fn a_task_that_panics_leaves_the_others_running() {
        let io = start().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let before = tx.clone();
        let survivor = io.spawn(async move {
            let _ = before.send("running before");
            std::future::pending::<()>().await;
        });
        let panicked = io.spawn(async { panic!("a metrics endpoint that panics") });
        assert_eq!(rx.recv().unwrap(), "running before");
        while !panicked.is_finished() {
            std::thread::yield_now();
        }
        io.spawn(async move {
            let _ = tx.send("spawned after");
        });
        assert_eq!(rx.recv().unwrap(), "spawned after");
        assert!(!survivor.is_finished(), "the other task still runs");
    }
}
