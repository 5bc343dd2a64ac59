//! Whole ticks with GPUs, in process: budgets summed over two GPUs, memory NVML cannot tell, a
//! GPU that is lost, Xid events, NVML unavailable then back, a victim's pid reused by a new holder, the same
//! command loaded twice, spawn-started workers mapping the same weights (and `status`'s rows for
//! them), a process list NVML would not give, floors no GPU or MemTotal here can hold. Moved from
//! the host suite (`gpu_guard`, `faults`, `weights`), which started the real binary against the
//! fake NVML library for each; how NVML's answers become these readings (NA, GPU_IS_LOST, a GPU
//! gone from the list, init errors, implausible counts) is tested against that library in
//! `tests/nvml/sampler.rs`.

use super::*;

use crate::history::Record;

/// A 16 GiB GPU at `index` with `used` bytes in use, listing `holders` as (pid, bytes).
fn card(index: u32, uuid: &str, used: u64, holders: &[(i32, u64)]) -> Gpu {
    Gpu {
        index,
        uuid: uuid.into(),
        name: "Fake A100".into(),
        total_bytes: Some(16 * GIB),
        used_bytes: Some(used),
        free_bytes: Some(16 * GIB - used),
        reserved_bytes: Some(0),
        processes: holders.iter().map(|&(pid, b)| (pid, Some(b))).collect(),
        processes_known: true,
        processes_steady: true,
        ..Gpu::default()
    }
}

/// `gpu` as the NVML source reports it once lost: its name kept, its readings gone.
fn lost(gpu: &Gpu) -> Gpu {
    Gpu {
        index: gpu.index,
        uuid: gpu.uuid.clone(),
        name: gpu.name.clone(),
        total_bytes: gpu.total_bytes,
        error: Some("GPU is lost".into()),
        lost: true,
        ..Gpu::default()
    }
}

/// The events of this kind in the flight recorder, as (severity, message). The tick records
/// its events before it returns: what is not there did not happen.
fn recorded(h: &Harness, kind: &str) -> Vec<(String, String)> {
    h.daemon.reporter.recorder.as_ref().unwrap().flush();
    let dir = h._dir.path().join("state").join(crate::history::DIR);
    crate::history::read(&dir)
        .unwrap()
        .records
        .into_iter()
        .filter_map(|r| match r {
            Record::Event {
                kind: k,
                severity,
                message,
                ..
            } if k == kind => Some((severity.to_string(), message)),
            _ => None,
        })
        .collect()
}

fn event(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap()
}

/// A model of a parent on GPU 0 and its child on GPU 1, 5 GiB each, against an 8 GiB budget:
/// `budget_exceeded` with the sum, both stopped once `grace` has run out (and not before), and
/// both resumed once the child gives its memory back.
#[test]
fn a_model_over_its_gpu_budget_summed_over_two_gpus_is_stopped_after_grace_and_resumed_under() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::from([(200, 5 * GIB)])),
        ..World::default()
    };
    w.spawn(200, "fam", GIB);
    w.spawn(201, "worker", GIB);
    w.procs.get_mut(&201).unwrap().ppid = 200;
    w.more_gpus
        .push(card(1, "GPU-bbbb", 6 * GIB, &[(201, 5 * GIB)]));
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n[gpu]\nenabled = true\n\
         [[model]]\nname = \"fam\"\nmatch = { comm = \"fam\" }\ngpu_memory = \"8GiB\"\n\
         action = \"stop\"\ngrace = \"2s\"\n",
    );
    h.ticks(10, 100 * MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
    let over = event(&logged(&h, "budget_exceeded")[0]);
    assert_eq!(over["subject"]["model"], "fam", "{over}");
    assert_eq!(over["subject"]["usage_bytes"], 10 * GIB, "{over}");
    assert_eq!(over["subject"]["budget_bytes"], 8 * GIB, "{over}");
    assert_eq!(recorded(&h, "budget_exceeded").len(), 1);
    h.ticks(20, 100 * MS);
    let stopped = [(200, Sig::Stop), (201, Sig::Stop)];
    assert_eq!(h.signals(), stopped, "{:?}", h.actions());
    let stop = event(&logged(&h, "process_stopped")[0]);
    assert_eq!(stop["subject"]["model"], "fam", "{stop}");
    assert!(
        stop["action"]["detail"]
            .as_str()
            .is_some_and(|d| d.ends_with("for longer than grace 2s")),
        "{over}\n{stop}"
    );
    // Back under budget (the child released its memory): both resumed.
    h.world().more_gpus[0] = card(1, "GPU-bbbb", GIB, &[]);
    h.ticks(10, 100 * MS);
    assert_eq!(
        h.signals(),
        [
            (200, Sig::Stop),
            (201, Sig::Stop),
            (200, Sig::Cont),
            (201, Sig::Cont)
        ],
        "{:?}",
        h.actions()
    );
    assert_eq!(h.world().procs[&200].state, 'S');
    assert_eq!(h.world().procs[&201].state, 'S');
}

/// GPU 0 is under its floor and its only holder's memory is unavailable (NVML's "NA"): nobody
/// to act on (`no_victim`), no budget exceeded on an unknown, nothing signalled, and `status`
/// shows the model's GPU use as unknown.
#[test]
fn gpu_memory_nvml_cannot_tell_never_leads_to_a_kill_nor_a_budget() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        gpu_unlisted: 79 * GIB,
        ..World::default()
    };
    w.spawn(200, "holder", GIB);
    w.gpu_unknown.push(200);
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n[gpu]\nenabled = true\nmin_free = \"2GiB\"\n\
         [[model]]\nname = \"na\"\nmatch = { comm = \"holder\" }\ngpu_memory = \"1GiB\"\n\
         action = \"kill\"\ngrace = \"0s\"\n",
    );
    h.ticks(20, 100 * MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
    assert_eq!(recorded(&h, "no_victim").len(), 1);
    assert_eq!(
        recorded(&h, "budget_exceeded"),
        [],
        "unknown is not a usage"
    );
    let report = status(&h);
    let model = report.models.iter().find(|m| m.name == "na").unwrap();
    assert!(model.gpu_unknown, "{model:?}");
}

/// GPU 1 is lost while the daemon runs: protection is degraded (status says which GPU), and
/// host RAM is still guarded: a hog under the RAM floor is terminated for it.
#[test]
fn a_gpu_lost_while_running_degrades_protection_and_ram_is_still_guarded() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        ..World::default()
    };
    w.more_gpus.push(card(1, "GPU-bbbb", GIB, &[]));
    w.spawn(200, "hog", 12 * GIB);
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n\
         [ram]\nwarn_available = \"8GiB\"\nmin_available = \"4GiB\"\naction = \"kill\"\n\
         [gpu]\nenabled = true\nmin_free = \"1GiB\"\n\
         [[model]]\nname = \"hog\"\nmatch = { comm = \"hog\" }\n",
    );
    h.ticks(3, 100 * MS);
    assert_eq!(status(&h).gpu_protection.state, "ok");
    let gone = lost(&h.world().more_gpus[0]);
    h.world().more_gpus[0] = gone;
    h.ticks(3, 100 * MS);
    let report = status(&h);
    assert_eq!(report.gpu_protection.state, "degraded", "{report:?}");
    assert!(report.gpus[1].lost, "{:?}", report.gpus);
    h.world().host = host(64 * GIB, 2 * GIB);
    h.ticks(2, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Term)], "{:?}", h.actions());
    let first = event(&logged(&h, "process_killed")[0]);
    assert_eq!(first["action"]["reason"], "ram_floor", "{first}");
    assert_eq!(first["subject"]["pid"], 200, "{first}");
    assert_eq!(first["subject"]["comm"], "hog", "{first}");
    assert_eq!(first["subject"]["floor_bytes"], 4 * GIB, "{first}");
}

/// A victim stopped for GPU 1's floor, then GPU 1 is lost: said once (`gpu_lost`, critical,
/// naming the GPU and its uuid), shown in status and metrics; at max_stop the victim is
/// resumed on the unknown reading, never killed. (NVML says "lost" two ways, GPU_IS_LOST and a
/// GPU gone from its list: both become this reading, `tests/nvml/sampler.rs`.)
#[test]
fn a_victim_stopped_for_a_gpu_floor_is_resumed_at_max_stop_once_its_gpu_is_lost() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        ..World::default()
    };
    w.spawn(200, "m", GIB);
    w.more_gpus
        .push(card(1, "GPU-bbbb", 8 * GIB, &[(200, 6 * GIB)]));
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\nmax_stop = \"3s\"\nsettle = \"60s\"\n\
         [gpu]\nenabled = true\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\naction = \"stop\"\n\
         [[model]]\nname = \"m\"\nmatch = { comm = \"m\" }\n",
    );
    h.ticks(3, 100 * MS);
    assert_eq!(h.signals(), []);
    h.world().more_gpus[0] = card(1, "GPU-bbbb", 31 * GIB / 2, &[(200, 6 * GIB)]);
    h.ticks(3, 100 * MS);
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());

    let gone = lost(&h.world().more_gpus[0]);
    h.world().more_gpus[0] = gone;
    h.ticks(3, 100 * MS);
    let said = recorded(&h, "gpu_lost");
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(said[0].0, "critical");
    // About GPU 1 (GPU-bbbb), and only it.
    let about: Vec<serde_json::Value> = logged(&h, "gpu_lost")
        .iter()
        .map(|l| event(l))
        .filter(|e| e["type"] == "event")
        .collect();
    assert_eq!(about.len(), 1, "{about:?}");
    assert_eq!(about[0]["subject"]["resource"], "GPU 1", "{about:?}");
    assert_eq!(h.daemon.sampler.lost_gpus, [1].into());
    let report = status(&h);
    assert_eq!(report.gpu_protection.state, "degraded");
    assert_eq!(
        (
            report.gpus[1].index,
            report.gpus[1].uuid.as_str(),
            report.gpus[1].lost
        ),
        (1, "GPU-bbbb", true)
    );
    let metrics = crate::metrics::Metrics::new();
    metrics.update(&h.daemon.view(crate::daemon::view::Detail::Full));
    let text = metrics.text();
    assert!(
        text.contains("gpuguard_gpu_lost{gpu=\"1\",uuid=\"GPU-bbbb\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("gpuguard_nvml_state{state=\"degraded\"} 1"),
        "{text}"
    );

    // max_stop passes on an unknown reading: resumed, not killed.
    h.ticks(30, 100 * MS);
    assert_eq!(
        h.signals(),
        [(200, Sig::Stop), (200, Sig::Cont)],
        "{:?}",
        h.actions()
    );
    assert_eq!(h.world().procs[&200].state, 'S');
    let acted: Vec<(String, String)> = h
        .daemon
        .reporter
        .recent_actions
        .iter()
        .map(|a| (a.verb.to_string(), a.reason_kind.to_string()))
        .collect();
    assert_eq!(
        acted,
        [
            ("stop".to_string(), "gpu_floor".to_string()),
            ("resume".to_string(), "max_stop".to_string())
        ]
    );
    assert_eq!(recorded(&h, "gpu_lost").len(), 1, "said once");
}

/// NVML unavailable (no library, no driver, a driver/library mismatch: what NVML said is the
/// reason): said once, status says why, and host RAM is still guarded (a model over its RAM
/// budget is stopped). When NVML answers again (the init retry), the GPUs are guarded, and the
/// unavailability is not said again.
#[test]
fn nvml_unavailable_is_said_once_ram_is_guarded_and_the_gpus_are_picked_up_when_it_answers() {
    let why = "NVML/driver version mismatch (driver upgraded without reboot?)";
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        gpu_status: Some(GpuStatus::Unavailable(why.into())),
        ..World::default()
    };
    w.spawn(200, "hog", 128 * MIB);
    let mut h = Harness::new(
        w,
        "[ram]\nmin_available = \"0%\"\nwarn_available = \"0%\"\n[gpu]\nenabled = true\n\
         [[model]]\nname = \"m\"\nmatch = { comm = \"hog\" }\nram = \"64MiB\"\n\
         action = \"stop\"\ngrace = \"0s\"\n",
    );
    h.ticks(5, 100 * MS);
    let report = status(&h);
    assert_eq!(report.gpu_protection.state, "unavailable");
    assert!(
        report
            .gpu_protection
            .reason
            .as_deref()
            .is_some_and(|r| r.contains(why)),
        "{:?}",
        report.gpu_protection
    );
    assert_eq!(h.signals(), [(200, Sig::Stop)], "{:?}", h.actions());

    h.world().gpu_status = None;
    h.ticks(5, 100 * MS);
    let report = status(&h);
    assert_eq!(report.gpu_protection.state, "ok");
    assert_eq!(report.gpus.len(), 1);
    let unavailable = recorded(&h, "gpu_unavailable");
    assert_eq!(unavailable.len(), 1, "said once: {unavailable:?}");
    assert!(unavailable[0].1.contains(why), "{unavailable:?}");
}

/// Round three (#24): NVML lists pids only. The victim's memory still listed under its pid
/// after it exited is stuck memory, but once the pid is a new process's (another start time),
/// what the driver lists there is the new process's: the floor goes on to it.
#[test]
fn a_pid_reused_by_a_new_gpu_holder_is_acted_on_not_taken_for_stuck_memory() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::from([(100, 14 * GIB)])),
        ..World::default()
    };
    w.spawn(100, "holder", GIB);
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n[gpu]\nenabled = true\nmin_free = \"70GiB\"\nwarn_free = \"72GiB\"\n\
         [[model]]\nname = \"reuse\"\nmatch = { comm = \"holder\" }\n",
    );
    h.ticks(3, 100 * MS);
    assert_eq!(h.signals(), [(100, Sig::Term)], "{:?}", h.actions());
    // It exited; the driver still lists its memory under its pid.
    h.world().procs.remove(&100);
    h.ticks(10, 100 * MS);
    assert_eq!(
        h.signals(),
        [(100, Sig::Term)],
        "stuck memory: {:?}",
        h.actions()
    );
    // A new process of the same model gets the pid.
    {
        let mut w = h.world();
        w.spawn(100, "holder", GIB);
        w.procs.get_mut(&100).unwrap().start_time += 1;
        w.exit_on_term.push(100);
    }
    h.ticks(100, 100 * MS);
    let ids: Vec<(ProcessId, Sig)> = h.world().signals.clone();
    assert_eq!(
        h.signals(),
        [(100, Sig::Term), (100, Sig::Term)],
        "{:?}",
        h.actions()
    );
    assert_ne!(ids[0].0, ids[1].0, "two processes: {ids:?}");
    assert_eq!(
        h.actions(),
        [
            "terminate model 'reuse' pids [100(holder)]: done",
            "terminate model 'reuse' pids [100(holder)]: done"
        ]
    );
}

/// Two unrelated processes with one command line on one GPU: one `duplicate_load` warning,
/// and no more on the ticks after it.
#[test]
fn the_same_command_loaded_twice_on_one_gpu_is_reported_once() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::from([(200, 4 * GIB), (201, 4 * GIB)])),
        ..World::default()
    };
    w.spawn(200, "vllm", GIB);
    w.spawn(201, "vllm", GIB);
    let mut h = Harness::new(w, "[gpu]\nenabled = true\n");
    h.ticks(30, 100 * MS);
    let dup = recorded(&h, "duplicate_load");
    assert_eq!(dup.len(), 1, "reported once: {dup:?}");
    assert_eq!(dup[0].0, "warning");
    assert_eq!(h.signals(), []);
}

/// A GPU whose process list NVML would not give (an implausible count: the list is unknown)
/// is under its floor: nobody to act on, said as `no_victim` naming the GPU and its floor.
/// Once the list reads again, the model's usage shows up again.
#[test]
fn a_gpu_with_an_unreadable_process_list_under_its_floor_has_no_victim() {
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::new()),
        ..World::default()
    };
    w.spawn(200, "m", GIB);
    w.more_gpus.push(Gpu {
        processes: BTreeMap::new(),
        processes_known: false,
        ..card(1, "GPU-bbbb", 31 * GIB / 2, &[])
    });
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\n[gpu]\nenabled = true\nmin_free = \"2GiB\"\n\
         [[model]]\nname = \"m\"\nmatch = { comm = \"m\" }\n",
    );
    h.ticks(20, 100 * MS);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
    assert_eq!(recorded(&h, "no_victim").len(), 1);
    // About GPU 1, 512 MiB free (under its 2 GiB min_free).
    let none: Vec<serde_json::Value> = logged(&h, "no_victim").iter().map(|l| event(l)).collect();
    assert_eq!(none.len(), 1, "{none:?}");
    assert_eq!(none[0]["subject"]["resource"], "GPU 1", "{none:?}");
    assert_eq!(status(&h).gpus[1].free_bytes, Some(512 * MIB));
    h.world().more_gpus[0] = card(1, "GPU-bbbb", 8 * GIB, &[(200, 6 * GIB)]);
    h.ticks(10, 100 * MS);
    let report = status(&h);
    assert_eq!(report.gpu_protection.state, "ok");
    let model = report.models.iter().find(|m| m.name == "m").unwrap();
    assert_eq!(model.gpu_bytes, Some(6 * GIB), "{model:?}");
    assert_eq!(h.signals(), []);
}

/// Floors that cannot be right on this host (check-config cannot know: they depend on MemTotal
/// and each GPU's total) are refused at start (the CLI exits 2 on this error) naming the key,
/// the value and the total; a floor that fits its GPU runs. A reload that puts it on every GPU
/// is refused, said as `config_reload_failed` naming GPU 1's total, and the running floors stay.
/// Moved from the host suite (`faults`); the messages of every refused floor are
/// `config::tests`'s, check-config's exit code `cli`'s.
#[test]
fn floors_that_cannot_be_right_on_this_host_are_refused_at_start_and_on_reload() {
    let world = || {
        let mut w = World {
            host: host(64 * GIB, 40 * GIB),
            gpu: Some(BTreeMap::new()),
            ..World::default()
        };
        w.spawn(200, "m", GIB);
        w.more_gpus.push(card(1, "GPU-bbbb", 0, &[(200, GIB)]));
        w
    };
    let model = "[[model]]\nname = \"m\"\nmatch = { comm = \"m\" }\n";
    let cases = [
        (
            "[ram]\nmin_available = \"65GiB\"\n",
            "ram.min_available: ",
            "is at or above this host's MemTotal",
        ),
        (
            "[ram]\nmin_available = \"1311MiB\"\nwarn_available = \"1%\"\n",
            "ram.warn_available: '1%'",
            "is below ram.min_available",
        ),
        (
            "[[gpu.device]]\ngpu = \"1\"\nmin_free = \"20GiB\"\n",
            "gpu.device[0] '1'.min_free: '20.0 GiB'",
            "is at or above GPU 1's total (16.0 GiB)",
        ),
    ];
    for (floors, key, why) in cases {
        let mut h = Harness::new(
            world(),
            &format!("candidates = \"models\"\n{floors}{model}"),
        );
        let e = h.daemon.preflight().unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(why), "{floors}: {e}");
    }

    // 20 GiB fits GPU 0 (80 GiB): it runs.
    let fits =
        |floors: &str| format!("candidates = \"models\"\n[gpu]\nenabled = true\n{floors}{model}");
    let mut h = Harness::new(
        world(),
        &fits("[[gpu.device]]\ngpu = \"0\"\nmin_free = \"20GiB\"\n"),
    );
    h.daemon.preflight().unwrap();
    h.ticks(5, 100 * MS);
    h.reload(&fits("min_free = \"20GiB\"\n"));
    let failed = recorded(&h, "config_reload_failed");
    // The check's own error, whole (its words are `config::tests`'): gpu.min_free refused.
    let error = Config::load(&h.daemon.config_path)
        .and_then(|c| h.daemon.vet_reload(c))
        .unwrap_err();
    assert_eq!(error.key, "gpu.min_free");
    assert!(
        failed.len() == 1 && failed[0].1.ends_with(&error.to_string()),
        "{failed:?} {error}"
    );
    h.ticks(5, 100 * MS);
    let report = status(&h);
    assert_eq!(report.gpus[0].min_free_bytes, Some(20 * GIB));
    assert_eq!(report.gpus[1].min_free_bytes, None);
    assert_eq!(h.signals(), [], "{:?}", h.actions());
}

/// A server and two workers it started with multiprocessing's `spawn` (command lines of their
/// own, so the command-line rule cannot find them) all map the same weights file. The two on
/// GPU 0 are reported once as the same weights loaded twice; status shows the processes one by
/// one (role, parent, GPU memory per GPU, the file). The third worker moves onto GPU 0 too: the
/// group grows, and is still reported once. Moved from the host suite (`weights`); reading a
/// real process's maps is `sample::weights`'s, the table `cli::status`'s, `status --model` over
/// the socket the host suite's `status`.
#[test]
fn spawned_workers_mapping_the_same_weights_are_reported_once_and_shown_one_by_one() {
    let spawn = "python3 -c from multiprocessing.spawn import spawn_main; \
                 spawn_main(tracker_fd=5, pipe_handle=7) --multiprocessing-fork";
    let path = "/models/server/model.safetensors";
    let mut w = World {
        host: host(64 * GIB, 40 * GIB),
        gpu: Some(BTreeMap::from([(100, GIB), (101, 4 * GIB)])),
        ..World::default()
    };
    w.spawn(100, "python3", GIB);
    w.procs.get_mut(&100).unwrap().cmdline = "python3 server.py model.safetensors".into();
    for pid in [101, 102] {
        w.spawn(pid, "python3", GIB);
        let p = w.procs.get_mut(&pid).unwrap();
        p.cmdline = spawn.into();
        p.ppid = 100;
    }
    let weights = MappedFile {
        path: path.into(),
        device: "fd:01".into(),
        inode: 7,
        mapped_bytes: 4 * MIB,
    };
    for pid in [100, 101, 102] {
        w.maps.insert(pid, vec![weights.clone()]);
    }
    w.more_gpus
        .push(card(1, "GPU-bbbb", 4 * GIB, &[(102, 4 * GIB)]));
    let mut h = Harness::new(
        w,
        "candidates = \"models\"\nscan_interval = \"200ms\"\n[gpu]\nenabled = true\n\
         [[model]]\nname = \"server\"\nmatch = { cmdline = \"server.py\" }\n",
    );
    h.ticks(30, 100 * MS);
    let dup = recorded(&h, "duplicate_load");
    assert_eq!(dup.len(), 1, "{dup:?}");
    assert!(
        dup[0].1.contains(&format!(
            "GPU 0: 2 processes [100, 101] of model 'server' map the same weights ({path}, 4.0 MiB) and hold 5.0 GiB together"
        )),
        "{dup:?}"
    );

    let report = status(&h);
    let m = report.models.iter().find(|m| m.name == "server").unwrap();
    let row = |pid: i32| {
        m.processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap_or_else(|| panic!("{pid} not in {m:#?}"))
    };
    let gpus = |pid: i32| -> Vec<(u32, Option<u64>)> {
        row(pid).gpus.iter().map(|g| (g.gpu, g.bytes)).collect()
    };
    assert_eq!(row(100).role, "matched");
    assert_eq!(row(101).role, "child");
    assert_eq!(row(101).ppid, 100);
    assert_eq!(gpus(101), [(0, Some(4 * GIB))]);
    assert_eq!(gpus(102), [(1, Some(4 * GIB))]);
    assert_eq!(row(102).weights_files, [path]);
    assert!(row(101).ram_bytes > 0);

    // The third worker moves onto GPU 0 too: the group grows, still reported once.
    {
        let mut w = h.world();
        w.more_gpus[0] = card(1, "GPU-bbbb", 0, &[]);
        w.gpu.as_mut().unwrap().insert(102, 4 * GIB);
    }
    h.ticks(30, 100 * MS);
    let report = status(&h);
    let m = report.models.iter().find(|m| m.name == "server").unwrap();
    let moved = m.processes.iter().find(|p| p.pid == 102).unwrap();
    assert_eq!(moved.gpus[0].gpu, 0, "{moved:?}");
    assert_eq!(recorded(&h, "duplicate_load").len(), 1);
}

/// An Xid the driver reports is one event about its GPU: critical for the Xids that mean a GPU
/// lost or broken (79: fallen off the bus), a warning for the rest (13: a graphics engine
/// exception), each written once however many ticks follow. Moved from the host suite
/// (`gpu_guard::injected_xid_shows_up_as_a_critical_event`); NVML's event set delivering an
/// Xid to the listener is `tests/nvml/sampler.rs`'s.
#[test]
fn an_xid_is_one_event_about_its_gpu_critical_where_the_gpu_is_lost() {
    let mut h = Harness::new(
        World {
            host: host(64 * GIB, 40 * GIB),
            gpu: Some(BTreeMap::new()),
            ..World::default()
        },
        "[gpu]\nenabled = true\n",
    );
    h.ticks(2, 100 * MS);
    h.world().xids = vec![
        crate::sample::nvml::XidEvent {
            gpu: Some(1),
            xid: 79,
        },
        crate::sample::nvml::XidEvent {
            gpu: Some(0),
            xid: 13,
        },
    ];
    h.ticks(5, 100 * MS);
    let events: Vec<serde_json::Value> = logged(&h, "xid")
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let summary: Vec<(&str, &str, &str)> = events
        .iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap_or_default(),
                e["severity"].as_str().unwrap_or_default(),
                e["subject"]["resource"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("xid_critical", "critical", "GPU 1"),
            ("xid", "warning", "GPU 0")
        ],
        "{events:#?}"
    );
    assert_eq!(h.signals(), [], "an Xid alone acts on nothing");
}
