//! What Kubernetes reads and writes, on whole ticks: the readiness the probes answer from
//! (`metrics::probes`) as the loop records it, and a ConfigMap's symlink swap reloaded by
//! `--watch-config` (`daemon::watch`) as SIGHUP reloads. The HTTP endpoint itself is the host
//! suite's (`tests/integration/metrics.rs`).

use std::path::Path;

use super::*;
use crate::daemon::watch::ConfigWatch;

/// The probes' answers at the harness's clock.
fn probes(
    h: &Harness,
) -> (
    crate::metrics::probes::Answer,
    crate::metrics::probes::Answer,
) {
    let now = h.daemon.started + h.at;
    let p = &h.daemon.reporter.metrics.probes;
    (p.health(now), p.ready(now))
}

/// Host RAM at its act floor: /readyz is 503 and says so, /healthz stays 200 (the loop ticks);
/// with the memory back, ready again. A loop that stops ticking fails both.
#[test]
fn readiness_follows_the_ram_floor_and_health_follows_the_ticks() {
    let w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    let mut h = Harness::new(
        w,
        "[ram]\nmin_available = \"5%\"\nwarn_available = \"10%\"\n[gpu]\nenabled = false\n",
    );
    let (health, ready) = probes(&h);
    assert!(health.ok, "{health:?}");
    assert_eq!(ready.body, "not ready: starting, no tick yet\n");
    h.tick(MS);
    let (health, ready) = probes(&h);
    assert!(health.ok && ready.ok, "{health:?} {ready:?}");
    assert_eq!(ready.body, "ready: guarding (mode enforce) and admitting\n");

    h.world().host.available_bytes = Some(GIB);
    h.ticks(3, 100 * MS);
    let (health, ready) = probes(&h);
    assert!(health.ok, "{health:?}");
    assert!(!ready.ok);
    assert_eq!(
        ready.body,
        "not ready: host RAM is at its act floor (ram.min_available)\n"
    );

    h.world().host.available_bytes = Some(40 * GIB);
    h.ticks(3, 100 * MS);
    assert!(probes(&h).1.ok, "{:?}", probes(&h).1);

    // No tick for 3 x daemon.interval (1 s) + 5 s and more: neither live nor ready.
    h.at += Duration::from_secs(9);
    let (health, ready) = probes(&h);
    assert!(!health.ok && !ready.ok, "{health:?} {ready:?}");
    assert!(
        health.body.starts_with("the loop has not ticked for 9.0s"),
        "{health:?}"
    );
}

/// Lays out `dir` as a ConfigMap volume does, with `text` as the new version of `config.toml`:
/// `config.toml -> ..data/config.toml`, `..data -> ..VERSION`, swapped by a rename.
fn configmap_version(dir: &Path, version: &str, text: &str) {
    let v = dir.join(version);
    std::fs::create_dir(&v).unwrap();
    std::fs::write(v.join("config.toml"), text).unwrap();
    let tmp = dir.join("..data_tmp");
    std::os::unix::fs::symlink(version, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    let link = dir.join("config.toml");
    if !link.is_symlink() {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("..data/config.toml", &link).unwrap();
    }
}

/// A ConfigMap update swaps the `..data` symlink and sends no signal: with `--watch-config`, a
/// version with an error is refused once (`config_reload_failed` names the key) and the old
/// budget keeps its process stopped; the next version, raising the budget, is reloaded as SIGHUP
/// reloads, and the process is resumed.
#[test]
fn a_configmap_swap_is_reloaded_as_sighup_reloads_and_a_bad_one_keeps_the_old_config() {
    let model = |budget: &str| {
        format!(
            "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = false\n\
             [[model]]\nname = \"greedy\"\nmatch = {{ comm = \"hog\" }}\nram = \"{budget}\"\n\
             action = \"stop\"\ngrace = \"0s\"\n"
        )
    };
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        ..World::default()
    };
    w.spawn(200, "hog", 256 * MIB);
    let mut h = Harness::new(w, &model("100MiB"));
    let dir = h._dir.path().to_path_buf();
    configmap_version(&dir, "..v1", &config_text(&h._dir, &model("100MiB")));
    let path = h.daemon.config_path.clone();
    assert!(path.is_symlink());
    h.daemon.watch = Some(ConfigWatch::new(
        &path,
        Duration::from_secs(1),
        h.daemon.started + h.at,
    ));
    h.ticks(5, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());

    configmap_version(&dir, "..v2", &config_text(&h._dir, &model("100 parsecs")));
    h.ticks(30, 100 * MS);
    let failed = logged(&h, "config_reload_failed");
    assert_eq!(failed.len(), 1, "tried once, not at every look: {failed:?}");
    assert!(
        failed[0].contains("model[0] 'greedy'.ram") && failed[0].contains("100 parsecs"),
        "{}",
        failed[0]
    );
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());

    configmap_version(&dir, "..v3", &config_text(&h._dir, &model("4GiB")));
    h.ticks(15, 100 * MS);
    assert_eq!(
        h.signals(),
        [(200, Sig::Stop), (200, Sig::Cont)],
        "{:?}",
        h.actions()
    );
    assert_eq!(logged(&h, "config_reload_failed").len(), 1);
}
