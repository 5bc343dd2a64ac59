//! Memory permits over the socket (issue #12): acquire + release round trips against the real
//! daemon (release build) with the fake NVML, from 64 concurrent clients on this machine.
//!
//!   cargo bench --bench permits      (or: bench/permits.sh, which adds the no-op server's floor
//!                                     and the Python side)
//!
//! Cases: one client (the bare round trip); 64 clients as fast as they can (the most permits per
//! second); 64 clients in an open loop at each of `PERMIT_RATES` permits/s (default 20 000 and
//! 10 000; latency from the instant each permit was due); 64 threads each paced, 20 000/s in
//! all. Prints a Markdown table: permits/s, latency p50/p99/p99.9 in microseconds, and the
//! server's CPU over the window. `PERMIT_SERVER` runs the cases against another server (the
//! no-op bench/permit_echo.c) instead of gpuguard.
//! Targets: p99 <= 200 us with 64 clients, >= 20 000 permits/s sustained.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gpuguard");
const FAKE_NVML: &str = gpuguard_fake_nvml::DIR;
const GIB: u64 = 1 << 30;

struct Daemon {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The daemon with one 80 GiB fake GPU: every permit of the bench fits.
fn daemon() -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("nvml");
    std::fs::write(
        &state,
        format!("device 0 uuid=GPU-bench total={} used={}\n", 80 * GIB, GIB),
    )
    .unwrap();
    let socket = dir.path().join("gpuguard.sock");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nstate_dir = \"{}\"\n[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n\
             [gpu]\nnvml_library = \"{FAKE_NVML}/libnvidia-ml.so.1\"\n[launch]\nsocket = \"{}\"\n\
             [alert]\nevent_log = false\n",
            dir.path().join("state").display(),
            socket.display()
        ),
    )
    .unwrap();
    // PERMIT_DAEMON_NICE: the daemon's niceness (default 0); PERMIT_DAEMON_CPUS: the CPUs it
    // may run on (taskset list, default all); PERMIT_DAEMON_BIN: another gpuguard binary (a
    // baseline) instead of this build's.
    let nice = std::env::var("PERMIT_DAEMON_NICE").unwrap_or_else(|_| "0".into());
    let cpus = std::env::var("PERMIT_DAEMON_CPUS").unwrap_or_else(|_| "0-1023".into());
    // PERMIT_SERVER: a bare socket server instead of a daemon (bench/permit_echo.c, given
    // the socket's path): the floor any daemon's round trip stands on, on this machine.
    let mut command = Command::new("taskset");
    command.args(["-c", &cpus, "nice", "-n", &nice]);
    match std::env::var("PERMIT_SERVER") {
        Ok(server) => command.arg(server).arg(&socket),
        Err(_) => command
            .arg(std::env::var("PERMIT_DAEMON_BIN").unwrap_or_else(|_| BIN.into()))
            .args(["daemon", "--config"])
            .arg(&config),
    };
    let child = command
        .env("FAKE_NVML_STATE", &state)
        .env("GPUGUARD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "the daemon did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Until NVML has answered, GPU permits wait.
    std::thread::sleep(Duration::from_millis(500));
    Daemon {
        child,
        socket,
        _dir: dir,
    }
}

/// One client's connection, speaking the protocol by hand (the client's own cost stays small).
/// It waits for readability only, as asyncio's streams do: tokio's own `UnixStream` also waits
/// for write space, so every read the server makes (which frees the client's sent bytes) would
/// wake the client's thread for nothing, a cost of the load generator charged to the server.
/// A request is a hundred bytes written to a socket whose answers are all read: it never waits.
struct Client {
    stream: tokio::io::unix::AsyncFd<UnixStream>,
    buf: Vec<u8>,
    line: String,
    next: u64,
}

impl Client {
    async fn connect(socket: &Path) -> Client {
        let stream = UnixStream::connect(socket).unwrap();
        stream.set_nonblocking(true).unwrap();
        Client {
            // SAFETY: the stream is owned by the AsyncFd, so its descriptor stays open and the
            // same for the AsyncFd's whole life.
            stream: unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    stream,
                    tokio::io::Interest::READABLE,
                )
            }
            .unwrap(),
            buf: Vec::with_capacity(4096),
            line: String::new(),
            next: 0,
        }
    }

    fn send(&mut self, line: String) {
        use std::io::Write;
        self.stream.get_ref().write_all(line.as_bytes()).unwrap();
    }

    async fn answer(&mut self) -> &str {
        use std::io::Read;
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                self.line.clear();
                self.line
                    .push_str(std::str::from_utf8(&self.buf[..=end]).unwrap());
                self.buf.drain(..=end);
                return &self.line;
            }
            let mut guard = self.stream.readable().await.unwrap();
            let mut chunk = [0u8; 4096];
            match guard.try_io(|fd| fd.get_ref().read(&mut chunk)) {
                Ok(Ok(0)) => panic!("the server closed the connection"),
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
                Ok(Err(e)) => panic!("reading an answer: {e}"),
                Err(_would_block) => {}
            }
        }
    }

    /// One acquire + release; panics if the permit is not granted.
    async fn round_trip(&mut self) {
        self.next += 1;
        let id = self.next;
        self.send(format!(
            "{{\"version\":1,\"type\":\"acquire\",\"id\":{id},\"gpu_bytes\":67108864,\"timeout_ms\":5000}}\n"
        ));
        let answer = self.answer().await;
        let permit = permit_of(answer).unwrap_or_else(|| panic!("not granted: {answer}"));
        self.next += 1;
        let id = self.next;
        self.send(format!(
            "{{\"version\":1,\"type\":\"release_permit\",\"id\":{id},\"permit\":{permit}}}\n"
        ));
        let answer = self.answer().await;
        assert!(answer.contains("\"released\""), "{answer}");
    }
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

struct Outcome {
    permits: usize,
    seconds: f64,
    latencies_us: Vec<f64>,
    daemon_cpu: f64,
}

/// `clients` connections for `window`, as tasks on one thread (as an asyncio server would
/// run them); `rate` permits/s in all (None: each as fast as it can). Latency is measured from
/// the moment each acquire is sent; a client that cannot keep its pace shows as a lower rate.
fn run(d: &Daemon, clients: usize, rate: Option<f64>, window: Duration) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let pid = d.child.id();
    runtime.block_on(async {
        let mut connected = Vec::new();
        for _ in 0..clients {
            let mut c = Client::connect(&d.socket).await;
            c.round_trip().await; // warm
            connected.push(c);
        }
        let cpu_before = cpu_ticks(pid);
        let began = Instant::now();
        let period = rate.map(|r| Duration::from_secs_f64(clients as f64 / r));
        let tasks: Vec<_> = connected
            .into_iter()
            .enumerate()
            .map(|(i, mut client)| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    let start = tokio::time::Instant::now();
                    let mut due =
                        start + period.map_or(Duration::ZERO, |p| p * i as u32 / clients as u32);
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(p) = period {
                            tokio::time::sleep_until(due).await;
                            due += p;
                        }
                        let sent = Instant::now();
                        client.round_trip().await;
                        latencies.push(sent.elapsed().as_secs_f64() * 1e6);
                    }
                    latencies
                })
            })
            .collect();
        tokio::time::sleep(window).await;
        stop.store(true, Ordering::Relaxed);
        let seconds = began.elapsed().as_secs_f64();
        let cpu = (cpu_ticks(pid) - cpu_before) as f64 / 100.0 / seconds;
        let mut latencies_us = Vec::new();
        for t in tasks {
            latencies_us.extend(t.await.unwrap());
        }
        latencies_us.sort_by(f64::total_cmp);
        Outcome {
            permits: latencies_us.len(),
            seconds,
            latencies_us,
            daemon_cpu: cpu,
        }
    })
}

/// Blocking client over std sockets, for the threaded runner. It polls for an answer before
/// reading it, as Python's blocking sockets do when they have a timeout: a thread asleep in
/// `read` on a unix stream socket is woken (for nothing) each time the server reads what it
/// sent, one asleep in `poll` only for what it asked.
struct BlockingClient {
    write: UnixStream,
    read: std::io::BufReader<UnixStream>,
    line: String,
    next: u64,
}

impl BlockingClient {
    fn connect(socket: &Path) -> BlockingClient {
        let stream = UnixStream::connect(socket).unwrap();
        BlockingClient {
            read: std::io::BufReader::new(stream.try_clone().unwrap()),
            write: stream,
            line: String::new(),
            next: 0,
        }
    }

    fn round_trip(&mut self) {
        use std::io::Write;
        self.next += 2;
        let id = self.next;
        writeln!(
            self.write,
            r#"{{"version":1,"type":"acquire","id":{id},"gpu_bytes":67108864,"timeout_ms":5000}}"#
        )
        .unwrap();
        self.read_answer();
        let permit = permit_of(&self.line).unwrap_or_else(|| panic!("not granted: {}", self.line));
        writeln!(
            self.write,
            r#"{{"version":1,"type":"release_permit","id":{},"permit":{permit}}}"#,
            id + 1
        )
        .unwrap();
        self.read_answer();
    }

    fn read_answer(&mut self) {
        use rustix::event::{poll, PollFd, PollFlags};
        use std::io::BufRead;
        if self.read.buffer().is_empty() {
            let mut fds = [PollFd::new(self.read.get_ref(), PollFlags::IN)];
            while poll(&mut fds, None).is_err() {}
        }
        self.line.clear();
        self.read.read_line(&mut self.line).unwrap();
    }
}

/// `clients` threads, each with its own connection, each starting a permit every
/// `clients / rate` s (spread evenly, precise sleeps): arrivals as independent workers of a
/// server make them, not in the clumps a millisecond timer makes.
fn run_threads(d: &Daemon, clients: usize, rate: f64, window: Duration) -> Outcome {
    let stop = Arc::new(AtomicBool::new(false));
    let period = Duration::from_secs_f64(clients as f64 / rate);
    let began = Instant::now() + Duration::from_millis(200);
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (socket, stop) = (d.socket.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut client = BlockingClient::connect(&socket);
                client.round_trip();
                let mut due = began + period * i as u32 / clients as u32;
                let mut latencies = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    let sent = Instant::now();
                    client.round_trip();
                    latencies.push(sent.elapsed().as_secs_f64() * 1e6);
                    due += period;
                }
                latencies
            })
        })
        .collect();
    std::thread::sleep(began.saturating_duration_since(Instant::now()));
    let cpu_before = cpu_ticks(d.child.id());
    let start = Instant::now();
    std::thread::sleep(window);
    stop.store(true, Ordering::Relaxed);
    let seconds = start.elapsed().as_secs_f64();
    let cpu = (cpu_ticks(d.child.id()) - cpu_before) as f64 / 100.0 / seconds;
    let mut latencies_us: Vec<f64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    latencies_us.sort_by(f64::total_cmp);
    Outcome {
        permits: latencies_us.len(),
        seconds,
        latencies_us,
        daemon_cpu: cpu,
    }
}

/// Open loop: permits are due at evenly spaced instants (`rate` per second), each started on one
/// of `clients` connections that is free (all of them open together). A dispatcher thread sleeps
/// to each arrival (timer slack 1 ns), so arrivals are on time, not in the clumps a millisecond
/// timer makes; the connections' round trips run as tasks on another
/// thread. Latency runs from the instant a permit was due to its release being answered.
fn run_open_loop(d: &Daemon, clients: usize, rate: f64, window: Duration) -> Outcome {
    let (go_tx, go_rx) =
        std::sync::mpsc::channel::<Vec<tokio::sync::mpsc::UnboundedSender<Instant>>>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, f64)>();
    let socket = d.socket.clone();
    let connections = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut starters = Vec::new();
            let mut tasks = Vec::new();
            for i in 0..clients {
                let mut client = Client::connect(&socket).await;
                client.round_trip().await; // warm
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
                let done = done_tx.clone();
                tasks.push(tokio::spawn(async move {
                    while let Some(due) = rx.recv().await {
                        client.round_trip().await;
                        let _ = done.send((i, due.elapsed().as_secs_f64() * 1e6));
                    }
                }));
                starters.push(tx);
            }
            go_tx.send(starters).unwrap();
            for t in tasks {
                let _ = t.await;
            }
        });
    });
    let starters = go_rx.recv().unwrap();
    // Sleeps end on time (the default 50 µs timer slack would clump arrivals).
    let _ = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1));
    let pid = d.child.id();
    let mut free: Vec<usize> = (0..clients).collect();
    let mut backlog = std::collections::VecDeque::new();
    let mut latencies = Vec::new();
    let period = Duration::from_secs_f64(1.0 / rate);
    let cpu_before = cpu_ticks(pid);
    let began = Instant::now();
    let mut due = began;
    while began.elapsed() < window {
        while let Ok((i, latency)) = done_rx.try_recv() {
            latencies.push(latency);
            free.push(i);
        }
        let now = Instant::now();
        while now >= due {
            backlog.push_back(due);
            due += period;
        }
        while !backlog.is_empty() && !free.is_empty() {
            let (at, i) = (backlog.pop_front().unwrap(), free.pop().unwrap());
            let _ = starters[i].send(at);
        }
        let ahead = due.saturating_duration_since(Instant::now());
        if ahead > Duration::from_micros(10) {
            std::thread::sleep(ahead);
        }
    }
    let seconds = began.elapsed().as_secs_f64();
    let cpu = (cpu_ticks(pid) - cpu_before) as f64 / 100.0 / seconds;
    drop(starters);
    let _ = connections.join();
    while let Ok((_, latency)) = done_rx.try_recv() {
        latencies.push(latency);
    }
    latencies.sort_by(f64::total_cmp);
    Outcome {
        permits: latencies.len(),
        seconds,
        latencies_us: latencies,
        daemon_cpu: cpu,
    }
}

/// `PERMIT_LOAD_SOCKET=PATH`: background load for the reaction benchmark (bench/reaction.sh,
/// background `permits`): 64 threads paced to 20 000 RAM permits/s (1 MiB each, no wait) against
/// a daemon someone else started, for `PERMIT_SECONDS` or until killed. Under the RAM floor the
/// daemon refuses them: the load goes on all the same. SIGTERM ends it; it prints one summary
/// line to stderr.
fn load(socket: &Path) {
    use std::io::{BufRead, Write};
    let seconds: u64 = std::env::var("PERMIT_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone()).unwrap();
    let clients = 64;
    let period = Duration::from_secs_f64(clients as f64 / 20_000.0);
    let end = Instant::now() + Duration::from_secs(seconds);
    let began = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (socket, stop) = (socket.to_path_buf(), stop.clone());
            std::thread::spawn(move || {
                let Ok(stream) = UnixStream::connect(&socket) else {
                    return (0, 0);
                };
                let mut read = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut write = stream;
                let (mut granted, mut refused, mut line) = (0u64, 0u64, String::new());
                let mut due = began + period * i as u32 / clients as u32;
                for id in (1u64..).step_by(2) {
                    let now = Instant::now();
                    if now >= end || stop.load(Ordering::Relaxed) {
                        break;
                    }
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    due += period;
                    let ask = format!(
                        "{{\"version\":1,\"type\":\"acquire\",\"id\":{id},\"ram_bytes\":1048576,\"gpu_bytes\":0,\"timeout_ms\":0}}\n"
                    );
                    line.clear();
                    if write.write_all(ask.as_bytes()).is_err() || read.read_line(&mut line).is_err()
                    {
                        break;
                    }
                    let Some(permit) = permit_of(&line) else {
                        refused += 1;
                        continue;
                    };
                    granted += 1;
                    let release = format!(
                        "{{\"version\":1,\"type\":\"release_permit\",\"id\":{},\"permit\":{permit}}}\n",
                        id + 1
                    );
                    line.clear();
                    if write.write_all(release.as_bytes()).is_err()
                        || read.read_line(&mut line).is_err()
                    {
                        break;
                    }
                }
                (granted, refused)
            })
        })
        .collect();
    let (granted, refused) = handles
        .into_iter()
        .map(|h| h.join().unwrap_or((0, 0)))
        .fold((0, 0), |(g, r), (a, b)| (g + a, r + b));
    let secs = began.elapsed().as_secs_f64();
    eprintln!(
        "permit load: {:.0} granted/s, {:.0} refused/s over {secs:.1} s",
        granted as f64 / secs,
        refused as f64 / secs
    );
}

/// The permit number of a `granted` answer (a plain scan: the bench measures the daemon, not
/// a JSON parser).
fn permit_of(answer: &str) -> Option<u64> {
    answer
        .split("\"permit\":")
        .nth(1)
        .and_then(|rest| rest.split([',', '}']).next())
        .and_then(|n| n.parse().ok())
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// 20000 -> "20 000", as the tables write rates.
fn thousands(rate: f64) -> String {
    let n = rate.round() as u64;
    if n >= 1000 {
        format!("{} {:03}", n / 1000, n % 1000)
    } else {
        n.to_string()
    }
}

#[derive(Clone, Copy)]
enum Pacing {
    /// Tasks on one thread, back to back.
    Tasks,
    /// One dispatcher, arrivals on time, a pool of connections.
    OpenLoop,
    /// A thread per connection, each sleeping to its own next arrival.
    Threads,
}

fn main() {
    // `cargo bench` passes --bench; a filter argument is not used.
    if let Ok(socket) = std::env::var("PERMIT_LOAD_SOCKET") {
        return load(Path::new(&socket));
    }
    let d = daemon();
    let window = Duration::from_secs(
        std::env::var("PERMIT_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10),
    );
    println!("| case | permits/s | p50 µs | p99 µs | p99.9 µs | daemon CPU (cores) |");
    println!("|---|---|---|---|---|---|");
    // PERMIT_RATES: the open-loop rates (permits/s, space-separated; default "20000 10000"),
    // to find the load up to which a p99 target holds.
    let rates: Vec<f64> = std::env::var("PERMIT_RATES")
        .unwrap_or_else(|_| "20000 10000".into())
        .split_whitespace()
        .map(|r| r.parse().expect("PERMIT_RATES: numbers of permits/s"))
        .collect();
    let mut cases = vec![
        ("1 client, back to back".to_string(), 1, None, Pacing::Tasks),
        (
            "64 clients, back to back".to_string(),
            64,
            None,
            Pacing::Tasks,
        ),
    ];
    for rate in rates {
        cases.push((
            format!("64 clients, open loop, {}/s", thousands(rate)),
            64,
            Some(rate),
            Pacing::OpenLoop,
        ));
    }
    cases.push((
        "64 threads, each paced, 20 000/s".to_string(),
        64,
        Some(20_000.0),
        Pacing::Threads,
    ));
    for (name, clients, rate, how) in cases {
        let o = match (how, rate) {
            (Pacing::OpenLoop, Some(rate)) => run_open_loop(&d, clients, rate, window),
            (Pacing::Threads, Some(rate)) => run_threads(&d, clients, rate, window),
            _ => run(&d, clients, rate, window),
        };
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} |",
            o.permits as f64 / o.seconds,
            quantile(&o.latencies_us, 0.5),
            quantile(&o.latencies_us, 0.99),
            quantile(&o.latencies_us, 0.999),
            o.daemon_cpu
        );
    }
    python_side(&d, window);
}

/// With `PERMIT_PYTHON` (an interpreter with the client installed: bench/permits.sh sets it),
/// the same round trip from Python beside asyncio/threading semaphores, against this daemon.
fn python_side(d: &Daemon, window: Duration) {
    let Ok(python) = std::env::var("PERMIT_PYTHON") else {
        println!("\n(PERMIT_PYTHON not set: no Python rows; bench/permits.sh sets it)");
        return;
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/permits_python.py");
    println!("\n| Python, back to back | permits/s | p50 µs | p99 µs |");
    println!("|---|---|---|---|");
    for mode in [
        "asyncio-semaphore",
        "gpuguard-async",
        "threading-semaphore",
        "gpuguard-thread",
    ] {
        let out = Command::new(&python)
            .args([script, mode, "--seconds"])
            .arg(window.as_secs().to_string())
            .arg("--socket")
            .arg(&d.socket)
            .output()
            .unwrap();
        print!("{}", String::from_utf8_lossy(&out.stdout));
        if !out.status.success() {
            println!(
                "| {mode} | failed: {} |",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
}
