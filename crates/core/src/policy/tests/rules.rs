//! Issue 40, "rules that cannot swallow the host": what no model takes in whatever its `match`
//! (`rules::NeverMembers`, through `attribute` and through a budget's action), and the survey
//! `check-config` and the daemon's start print (`rules::survey`). Process trees as plain data.

use super::*;
use crate::policy::rules::{survey, LeftOut, RuleWarning, Seen, Why};

/// A process of `uid` named `comm`, child of `ppid`, with `cmdline`.
fn p(pid: i32, ppid: i32, uid: u32, comm: &str, cmdline: &str) -> Process {
    Process {
        uid,
        cmdline: cmdline.to_string(),
        ..proc(pid, comm, 64 * MIB, ppid)
    }
}

fn table(processes: Vec<Process>) -> ProcessTable {
    ProcessTable {
        pss_read: true,
        scanned_at: Some(Duration::ZERO),
        processes,
    }
}

/// Each process's model by name, in the table's order, as (pid, model).
fn membership(
    c: &Config,
    t: &ProcessTable,
    registered: &HashMap<ProcessId, String>,
    launched: &BTreeMap<String, crate::config::ModelConfig>,
    cache: &mut MatchCache,
) -> Vec<(i32, Option<String>)> {
    let a = attribute(
        c,
        t,
        &GpuSnapshot::default(),
        registered,
        launched,
        SELF_PID,
        cache,
    );
    t.processes
        .iter()
        .map(|p| (p.pid, a.model_of(p.id()).map(|m| a.models[m].name.clone())))
        .collect()
}

/// A root host: init, a kernel thread, sshd with root logged in (root's login shell and an
/// editor in it), gpuguard started from a tmux window through sudo, a build in another pane
/// of that shell, cron.
fn roots_host() -> Vec<Process> {
    vec![
        p(1, 0, 0, "systemd", "/sbin/init"),
        Process {
            kernel_thread: true,
            ..p(3, 2, 0, "kworker/0:1", "")
        },
        p(500, 1, 0, "tmux: server", "tmux"),
        p(501, 500, 0, "bash", "-bash"),
        p(502, 501, 0, "sudo", "sudo gpuguard daemon"),
        p(503, 501, 0, "cargo", "cargo test"),
        p(600, 1, 0, "cron", "/usr/sbin/cron -f"),
        // A kernel thread whose parent, as the table has it, is cron: it does not inherit.
        Process {
            kernel_thread: true,
            ..p(601, 600, 0, "kworker/u8:1", "")
        },
        p(700, 1, 0, "sshd", "sshd: /usr/sbin/sshd -D [listener]"),
        p(800, 700, 0, "sshd-session", "sshd-session: root [priv]"),
        p(801, 800, 0, "sshd-session", "sshd-session: root@pts/0"),
        p(802, 801, 0, "bash", "-bash"),
        p(803, 802, 0, "vim", "vim config.toml"),
        p(SELF_PID, 502, 0, "agent", "gpuguard daemon"),
    ]
}

/// Alice's ssh sessions (uid 1000): her login shell and what runs in it, a command ssh ran
/// without a shell, and her own processes that call themselves sshd (under her shell, and
/// under her own half of the session).
fn alices_host() -> Vec<Process> {
    vec![
        p(700, 1, 0, "sshd", "sshd: /usr/sbin/sshd -D [listener]"),
        p(800, 700, 0, "sshd", "sshd: alice [priv]"),
        p(801, 800, 1000, "sshd", "sshd: alice@pts/0"),
        p(802, 801, 1000, "bash", "-bash"),
        p(803, 802, 1000, "python3", "python3 train.py"),
        p(820, 801, 1000, "python3", "python3 serve.py"),
        p(830, 801, 1000, "-bash", "-bash"),
        p(900, 802, 1000, "sshd", "sshd: fake"),
        p(901, 900, 1000, "bash", "bash"),
        p(910, 801, 1000, "sshd", "sshd: fake too"),
        p(911, 910, 1000, "zsh", "zsh"),
    ]
}

/// A case: what it shows, the config, the processes, and each one's model.
type Case = (
    &'static str,
    String,
    Vec<Process>,
    Vec<(i32, Option<&'static str>)>,
);

fn names(pids: &[(i32, Option<&str>)]) -> Vec<(i32, Option<String>)> {
    pids.iter()
        .map(|&(pid, m)| (pid, m.map(String::from)))
        .collect()
}

#[test]
fn no_model_takes_in_what_it_must_never_take_in() {
    let everything_root = "[[model]]\nname = \"root\"\nmatch = { user = \"0\" }\n";
    let cases: Vec<Case> = vec![
        (
            // pid 1, the kernel thread, the guard, its ancestors (tmux, the shell, sudo), sshd
            // (protected) and root's login shell are in no model; what runs in them is.
            "a model of everything root runs",
            everything_root.to_string(),
            roots_host(),
            vec![
                (1, None),
                (3, None),
                (500, None),
                (501, None),
                (502, None),
                (503, Some("root")),
                (600, Some("root")),
                (601, None),
                (700, None),
                (800, None),
                (801, None),
                (802, None),
                (803, Some("root")),
                (SELF_PID, None),
            ],
        ),
        (
            // Without the built-in protect list, sshd and its sessions are left out by what
            // they are.
            "the same without [protect] defaults",
            format!("[protect]\ndefaults = false\n{everything_root}"),
            roots_host(),
            vec![
                (1, None),
                (3, None),
                (500, None),
                (501, None),
                (502, None),
                (503, Some("root")),
                (600, Some("root")),
                (601, None),
                (700, None),
                (800, None),
                (801, None),
                (802, None),
                (803, Some("root")),
                (SELF_PID, None),
            ],
        ),
        (
            // Alice's session (her sshd, her login shells) is in no model; what she runs in
            // it, a command ssh ran without a shell, and her processes that call themselves
            // sshd (and their shells) are hers.
            "a model of everything alice runs",
            "[[model]]\nname = \"alice\"\nmatch = { user = \"1000\" }\n".to_string(),
            alices_host(),
            vec![
                (700, None),
                (800, None),
                (801, None),
                (802, None),
                (803, Some("alice")),
                (820, Some("alice")),
                (830, None),
                (900, Some("alice")),
                (901, Some("alice")),
                (910, Some("alice")),
                (911, Some("alice")),
            ],
        ),
        (
            // The tmux server matches, but started gpuguard: its other window does not inherit
            // the model through it; a process below that matches itself does, with its child.
            "descendants do not inherit through the guard's ancestor",
            "[[model]]\nname = \"tmux\"\nmatch = { cmdline = \"^tmux\" }\n".to_string(),
            vec![
                p(500, 1, 0, "tmux: server", "tmux"),
                p(501, 500, 0, "bash", "-bash"),
                p(SELF_PID, 501, 0, "agent", "gpuguard daemon"),
                p(510, 500, 0, "bash", "-bash"),
                p(511, 510, 0, "python3", "python3 job.py"),
                p(520, 510, 0, "tmux: client", "tmux attach"),
                p(521, 520, 0, "less", "less log"),
            ],
            vec![
                (500, None),
                (501, None),
                (SELF_PID, None),
                (510, None),
                (511, None),
                (520, Some("tmux")),
                (521, Some("tmux")),
            ],
        ),
        (
            // Nor through a protected process, nor through pid 1 or a login shell.
            "descendants do not inherit through a protected process",
            "[protect]\ncomm = [\"supervisord\"]\n\
             [[model]]\nname = \"super\"\nmatch = { comm = \"supervisord\" }\n\
             [[model]]\nname = \"vllm\"\nmatch = { comm = \"vllm\" }\n\
             [[model]]\nname = \"init\"\nmatch = { comm = \"systemd\" }\n\
             [[model]]\nname = \"shell\"\nmatch = { cmdline = \"^-bash\" }\n"
                .to_string(),
            vec![
                p(1, 0, 0, "systemd", "/sbin/init"),
                p(600, 1, 0, "supervisord", "supervisord"),
                p(601, 600, 0, "python3", "python3 app.py"),
                p(602, 601, 0, "vllm", "vllm serve"),
                p(603, 602, 0, "python3", "worker"),
                p(700, 1, 0, "sshd", "sshd"),
                p(801, 700, 0, "sshd", "sshd: root@pts/0"),
                p(802, 801, 0, "bash", "-bash"),
                p(803, 802, 0, "make", "make"),
            ],
            vec![
                (1, None),
                (600, None),
                (601, None),
                (602, Some("vllm")),
                (603, Some("vllm")),
                (700, None),
                (801, None),
                (802, None),
                (803, None),
            ],
        ),
        (
            // Whatever ppid 0 is (kthreadd, a process entered from outside a container's
            // namespace), nothing is taken in through it.
            "no parent",
            everything_root.to_string(),
            vec![
                p(2, 0, 0, "kthreadd", ""),
                p(40, 0, 0, "python3", "python3 entered.py"),
                p(41, 40, 0, "python3", "worker"),
            ],
            vec![(2, None), (40, None), (41, Some("root"))],
        ),
    ];
    for (name, text, procs, want) in cases {
        let c = config(&text);
        let got = membership(
            &c,
            &table(procs),
            &HashMap::new(),
            &BTreeMap::new(),
            &mut MatchCache::default(),
        );
        assert_eq!(got, names(&want), "{name}");
    }
}

/// A launched process is its model's even as a login session's shell (its owner named it over
/// the socket), and its children with it; the guard itself never is, launched or not.
#[test]
fn a_launched_login_shell_is_its_models_and_the_guard_never() {
    let c = config("");
    let procs = vec![
        p(700, 1, 0, "sshd", "sshd"),
        p(800, 700, 0, "sshd", "sshd: alice [priv]"),
        p(801, 800, 1000, "sshd", "sshd: alice@notty"),
        p(802, 801, 1000, "bash", "bash -c vllm serve; echo done"),
        p(803, 802, 1000, "vllm", "vllm serve"),
        p(SELF_PID, 1, 1000, "agent", "gpuguard"),
    ];
    let t = table(procs);
    let registered = HashMap::from([
        (t.processes[3].id(), "launched".to_string()),
        (t.processes[5].id(), "launched".to_string()),
    ]);
    let launched = BTreeMap::from([(
        "launched".to_string(),
        crate::config::ModelConfig::launched("launched", 1000, GIB, 0),
    )]);
    let got = membership(&c, &t, &registered, &launched, &mut MatchCache::default());
    assert_eq!(
        got,
        names(&[
            (700, None),
            (800, None),
            (801, None),
            (802, Some("launched")),
            (803, Some("launched")),
            (SELF_PID, None),
        ])
    );
}

/// The match cache keeps a process's own match only: a shell left out as a login session's
/// joins its model once its session's sshd is gone (the shell is then pid 1's), with the same
/// cache; and leaves it again when it is a session's again (a new table, the same processes).
#[test]
fn what_is_left_out_is_worked_out_again_at_every_attribution() {
    let c = config("[[model]]\nname = \"alice\"\nmatch = { user = \"1000\" }\n");
    let mut cache = MatchCache::default();
    let in_session = table(vec![
        p(700, 1, 0, "sshd", "sshd"),
        p(800, 700, 0, "sshd", "sshd: alice [priv]"),
        p(801, 800, 1000, "sshd", "sshd: alice@pts/0"),
        p(802, 801, 1000, "bash", "-bash"),
    ]);
    let orphaned = table(vec![
        p(700, 1, 0, "sshd", "sshd"),
        p(802, 1, 1000, "bash", "-bash"),
    ]);
    let none = &HashMap::new();
    let launched = &BTreeMap::new();
    let shell = |rows: Vec<(i32, Option<String>)>| rows.into_iter().find(|r| r.0 == 802);
    for (t, want) in [
        (&in_session, None),
        (&orphaned, Some("alice".to_string())),
        (&in_session, None),
    ] {
        assert_eq!(
            shell(membership(&c, t, none, launched, &mut cache)),
            Some((802, want))
        );
    }
}

/// The report: a `[[model]]` of everything root runs, a tiny budget and `kill`: the
/// budget's action names what the model takes in, never pid 1, sshd, a login shell, the guard
/// or what started it.
#[test]
fn a_budget_action_of_a_loose_model_names_none_of_the_never_members() {
    let c = config(
        "[daemon]\nmode = \"observe\"\n\
         [[model]]\nname = \"root\"\nmatch = { user = \"0\" }\n\
         ram = \"1MiB\"\naction = \"kill\"\ngrace = \"0s\"\n",
    );
    let s = snap(0, Some(32 * GIB), roots_host());
    let plan = once(&c, &s);
    assert_eq!(acts(&plan), "terminate root[503,600,803]");
}

#[test]
fn the_survey_says_what_each_rule_catches_and_warns() {
    let roots_model = "[[model]]\nname = \"root\"\nmatch = { user = \"0\" }\n";
    let left = |pid: i32, comm: &str, why: LeftOut| {
        (
            Seen {
                pid,
                comm: comm.into(),
                uid: 0,
            },
            why,
        )
    };
    // A model of everything root runs, with the guard running.
    let c = config(roots_model);
    let s = survey(&c, &table(roots_host()), SELF_PID);
    let model = &s.rules[0];
    assert_eq!(model.rule, "model[0] 'root'");
    let pids = |seen: &[Seen]| seen.iter().map(|p| p.pid).collect::<Vec<_>>();
    assert_eq!(pids(&model.caught), [503, 600, 803]);
    let never = vec![
        left(1, "systemd", LeftOut::Init),
        left(500, "tmux: server", LeftOut::GuardAncestor),
        left(501, "bash", LeftOut::GuardAncestor),
        left(502, "sudo", LeftOut::GuardAncestor),
        left(700, "sshd", LeftOut::Protected),
        left(800, "sshd-session", LeftOut::LoginSession),
        left(801, "sshd-session", LeftOut::LoginSession),
        left(802, "bash", LeftOut::LoginSession),
        left(SELF_PID, "agent", LeftOut::Guard),
    ];
    let as_why: Vec<(Seen, Why)> = never
        .iter()
        .map(|(p, w)| (p.clone(), Why::Never(*w)))
        .collect();
    assert_eq!(model.left_out, as_why);
    assert_eq!(
        s.warnings,
        [RuleWarning::CatchesNeverMembers {
            rule: "model[0] 'root'".into(),
            left_out: never,
        }]
    );
    // `[protect]`: root's sshd; nothing else here is named like a protected process.
    assert_eq!(s.rules[1].rule, "[protect]");
    assert_eq!(pids(&s.rules[1].caught), [1, 700]);

    // Without a guard (`check-config`), its ancestors are ordinary root processes.
    let s = survey(&c, &table(roots_host()), 0);
    assert_eq!(
        pids(&s.rules[0].caught),
        [500, 501, 502, 503, 600, 803, SELF_PID]
    );

    // Too many: more than warn_model_processes, not as many.
    for (limit, warned) in [(2, true), (3, false)] {
        let c = config(&format!(
            "[daemon]\nwarn_model_processes = {limit}\n{roots_model}"
        ));
        let s = survey(&c, &table(roots_host()), SELF_PID);
        let too_many = RuleWarning::TooMany {
            rule: "model[0] 'root'".into(),
            count: 3,
            limit,
        };
        assert_eq!(
            s.warnings.contains(&too_many),
            warned,
            "{limit}: {:?}",
            s.warnings
        );
        assert_eq!(
            s.warnings.len(),
            1 + usize::from(warned),
            "{:?}",
            s.warnings
        );
    }

    // Two models catching one process: it is the first's; the second's match left it out.
    // Alice's processes, and her own "sshd", are not root's model's: not its users, and
    // `[protect]` does not trust her "sshd" with its name.
    let c = config(
        "[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm\" }\n\
         [[model]]\nname = \"servers\"\nmatch = { cmdline = \"serve\" }\n",
    );
    let procs = vec![
        p(100, 1, 0, "python3", "vllm serve qwen"),
        p(101, 100, 0, "python3", "worker"),
        p(200, 1, 0, "python3", "triton serve"),
        p(300, 1, 1000, "python3", "vllm serve mine"),
        p(301, 1, 1000, "sshd", "sshd: not really"),
    ];
    let s = survey(&c, &table(procs), SELF_PID);
    assert_eq!(pids(&s.rules[0].caught), [100, 101]);
    assert_eq!(pids(&s.rules[1].caught), [200]);
    let seen = |pid: i32, uid: u32| Seen {
        pid,
        comm: "python3".into(),
        uid,
    };
    assert_eq!(s.rules[0].left_out, [(seen(300, 1000), Why::NotItsUser)]);
    assert_eq!(
        s.rules[1].left_out,
        [
            (seen(100, 0), Why::Earlier("model[0] 'vllm'".into())),
            (seen(300, 1000), Why::NotItsUser),
        ]
    );
    assert_eq!(
        s.warnings,
        [RuleWarning::Overlap {
            rule: "model[1] 'servers'".into(),
            first: "model[0] 'vllm'".into(),
            caught: vec![seen(100, 0)],
        }]
    );
    let fake = Seen {
        pid: 301,
        comm: "sshd".into(),
        uid: 1000,
    };
    assert_eq!(s.rules[2].caught, []);
    assert_eq!(s.rules[2].left_out, [(fake, Why::Untrusted)]);

    // A tight rule: no warning.
    let c = config("[[model]]\nname = \"vllm\"\nmatch = { cmdline = \"vllm serve qwen\" }\n");
    let s = survey(&c, &table(roots_host()), SELF_PID);
    assert_eq!(s.warnings, []);
}

/// The warnings say which rule, how many, which processes and why, on one line each.
#[test]
fn warnings_name_the_rule_the_processes_and_why() {
    let c = config(
        "[daemon]\nwarn_model_processes = 1\n\
         [[model]]\nname = \"root\"\nmatch = { user = \"0\" }\n\
         [[model]]\nname = \"cargo\"\nmatch = { comm = \"cargo\" }\n",
    );
    let s = survey(&c, &table(roots_host()), SELF_PID);
    let text: Vec<String> = s.warnings.iter().map(|w| w.to_string()).collect();
    assert_eq!(text.len(), 3, "{text:#?}");
    assert!(
        text[0].starts_with(
            "model[0] 'root' takes in 3 processes, more than daemon.warn_model_processes (1)"
        ),
        "{}",
        text[0]
    );
    assert!(
        text[1].starts_with(
            "model[0] 'root': its match catches 9 process(es) that no model takes in, left out: \
             pid 1 (systemd): pid 1, pid 500 (tmux: server): started gpuguard, "
        ) && text[1].ends_with("and 4 more"),
        "{}",
        text[1]
    );
    assert!(
        text[2].starts_with(
            "model[1] 'cargo': its match catches 1 process(es) that model[0] 'root' caught first"
        ) && text[2].ends_with(": pid 503 (cargo)"),
        "{}",
        text[2]
    );
    assert!(text.iter().all(|t| !t.contains('\n')));
}

/// What `[protect]` says of a process is remembered with its match, and worked out again when
/// what it is changes (an exec): the same cache, the same process before and after.
#[test]
fn what_protect_says_is_remembered_until_the_process_changes() {
    let c = config(
        "[protect]\ncmdline = [\"^agent\"]\n[[model]]\nname = \"root\"\nmatch = { comm = \"python3\" }\n",
    );
    let mut cache = MatchCache::default();
    let as_run = |cmdline: &str| {
        table(vec![
            p(100, 1, 0, "python3", cmdline),
            p(101, 100, 0, "worker", "worker"),
        ])
    };
    let (none, launched) = (&HashMap::new(), &BTreeMap::new());
    for (cmdline, want) in [
        ("agent --serve", None),
        ("agent --serve", None),
        ("python3 serve.py", Some("root")),
        ("agent --serve", None),
    ] {
        assert_eq!(
            membership(&c, &as_run(cmdline), none, launched, &mut cache),
            names(&[(100, want), (101, want)]),
            "{cmdline}"
        );
    }
}

/// Round five (a hostile review of issue 40): a process that calls itself `bash` under its
/// session's sshd was left out of its user's model by its name alone: 200 MiB and 70 GiB of GPU
/// memory under no budget, while the floor took another user's model. A session's shell is
/// left out only while it is small and holds no GPU memory; more, and it is in its model.
#[test]
fn a_shell_that_holds_memory_is_in_its_users_model_whatever_its_name() {
    let c = config("[[model]]\nname = \"alice\"\nmatch = { user = \"1000\" }\n");
    let host = |shell_rss: u64| {
        vec![
            p(700, 1, 0, "sshd", "sshd"),
            p(800, 700, 0, "sshd", "sshd: alice [priv]"),
            p(801, 800, 1000, "sshd", "sshd: alice@pts/0"),
            Process {
                rss_bytes: shell_rss,
                ..p(802, 801, 1000, "bash", "bash")
            },
        ]
    };
    let model_of = |procs: Vec<Process>, gpus: &GpuSnapshot| {
        let t = table(procs);
        let a = attribute(
            &c,
            &t,
            gpus,
            &HashMap::new(),
            &BTreeMap::new(),
            SELF_PID,
            &mut MatchCache::default(),
        );
        a.model_of(t.processes[3].id())
            .map(|m| a.models[m].name.clone())
    };
    let no_gpu = GpuSnapshot::default();
    assert_eq!(
        model_of(host(8 * MIB), &no_gpu),
        None,
        "a login shell is no model's"
    );
    assert_eq!(
        model_of(host(200 * MIB), &no_gpu).as_deref(),
        Some("alice"),
        "200 MiB is not a shell's"
    );
    let on_gpu = GpuSnapshot {
        devices: vec![gpu(0, 8 * GIB, &[(802, Some(GIB))])],
        ..GpuSnapshot::default()
    };
    assert_eq!(
        model_of(host(8 * MIB), &on_gpu).as_deref(),
        Some("alice"),
        "GPU memory is not a shell's"
    );
}
