//! Issue #11's attacks on the policy, with uids as plain data: what the host suite's
//! `security` tests played with throw-away users and moved here, where no real user, socket or
//! /proc is needed. A process's name, command line and executable are what an account chose; its
//! uid is what the kernel says (read by the host suite's kept tests).

use super::*;

/// A `[[model]]` of root's (no `users`: root's and the system accounts'), matched by `token` in
/// the command line.
fn roots_model(name: &str, token: &str, extra: &str) -> String {
    format!("[[model]]\nname = \"{name}\"\nmatch = {{ cmdline = \"{token}\" }}\n{extra}")
}

/// A process of `uid` whose name is `comm` and whose command line carries `token`.
fn of(uid: u32, pid: i32, comm: &str, token: &str, rss: u64) -> Process {
    Process {
        uid,
        cmdline: format!("python3 -c hog {token}"),
        ..proc(pid, comm, rss, 1)
    }
}

/// An account's hog that calls itself `sshd` is chosen under the RAM floor, and root's `sshd`,
/// larger (were it not protected, it would be chosen), is not: for a user (uid 1001) and for a
/// system account (uid 33) whose executable is a system python, not sshd. Moved from the host
/// suite (`security::a_users_hog_that_calls_itself_sshd_is_chosen_and_roots_sshd_is_not`); the
/// system account's, on the real /proc (a name set by `prctl`, `/proc/PID/exe`), stays there.
#[test]
fn an_accounts_hog_that_calls_itself_sshd_is_chosen_and_roots_larger_sshd_is_not() {
    let python = crate::snapshot::Exe {
        name: "python3.12".into(),
        system: true,
    };
    for (uid, exe) in [(1001, None), (33, Some(python))] {
        let c = config(&format!(
            "[daemon]\ncandidates = \"models\"\n{RAM_FLOORS}{}{}",
            roots_model("root", "root-sshd", ""),
            roots_model("attacker", "fake-sshd", &format!("users = [\"{uid}\"]\n"))
        ));
        let roots = of(0, 100, "sshd", "root-sshd", 768 * MIB);
        let hog = Process {
            exe: exe.clone(),
            ..of(uid, 200, "sshd", "fake-sshd", 512 * MIB)
        };
        let plan = once(&c, &snap(0, Some(3 * GIB), vec![roots, hog]));
        assert_eq!(acts(&plan), "terminate attacker[200]", "uid {uid}");
        assert!(
            plan.actions
                .iter()
                .all(|a| a.target.ids().all(|id| id.pid != 100)),
            "uid {uid}: root's sshd acted on"
        );
    }
}

/// A user's process whose command line names root's model (its matcher) and grows past the
/// model's budget does not join it: root's model holds only root's server, stays within its
/// budget, and nothing is done to it. Moved from the host suite
/// (`security::a_user_cannot_steer_the_guard_at_root_s_server`, its forged command line half).
#[test]
fn a_users_process_naming_roots_model_does_not_put_it_over_its_budget() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n{}",
        roots_model(
            "rootmodel",
            "root-server",
            "ram = \"1GiB\"\naction = \"stop\"\ngrace = \"0s\"\n"
        )
    ));
    let server = of(0, 100, "python3", "root-server", 512 * MIB);
    let forged = of(1001, 200, "python3", "root-server", 4 * GIB);
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (
                snap(0, Some(32 * GIB), vec![server.clone(), forged.clone()]),
                "",
                "",
            ),
            (
                snap(1000, Some(32 * GIB), vec![server.clone(), forged.clone()]),
                "",
                "",
            ),
        ],
    );
    let (table, a) = attributed(&c, vec![server, forged]);
    assert_eq!(rows(&a, &table), [Some(0), None]);
}

/// A user's processes outside every model take the GPU: root's model, within its budget, is
/// left alone, and the `outside_shortfall` that says why is critical. Moved from the host suite
/// (`security::a_users_gpu_memory_outside_the_models_does_not_get_roots_model_killed`); the rest
/// of the rule is `memory_outside_the_models_does_not_make_a_model_within_its_budget_the_victim`.
#[test]
fn a_users_gpu_memory_outside_the_models_leaves_roots_model_alone_and_is_critical() {
    let c = config(&format!(
        "[daemon]\ncandidates = \"models\"\n[gpu]\nmin_free = \"2GiB\"\nwarn_free = \"3GiB\"\n{}",
        roots_model(
            "server",
            "outside-server",
            "gpu_memory = \"12GiB\"\naction = \"kill\"\n"
        )
    ));
    let procs = || {
        vec![
            of(0, 100, "python3", "outside-server", GIB),
            of(1001, 300, "python3", "notebook", GIB),
        ]
    };
    // GPU 0 (16 GiB): root's model 5 GiB, the user's process 4 GiB, then 10 GiB.
    let at = |ms, user: u64| {
        gsnap(
            ms,
            procs(),
            vec![gpu(
                0,
                16 * GIB - 5 * GIB - user,
                &[(100, Some(5 * GIB)), (300, Some(user))],
            )],
        )
    };
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (at(0, 4 * GIB), "", ""),
            (at(100, 10 * GIB), "", "floor_act, outside_shortfall"),
            (at(200, 10 * GIB), "", ""),
        ],
    );
    let outside = &plans[1].events[1];
    assert_eq!(outside.severity, Severity::Critical, "{outside:#?}");
}

/// A user's two processes mapping root's model's weights file (any user may read it) are
/// reported together as one load twice; root's server is never in their group. Moved from the
/// host suite (`security::a_user_mapping_roots_weights_is_not_reported_as_roots_model_loaded_
/// twice`); a lone process of the user's is `another_accounts_process_mapping_a_models_weights_
/// is_not_a_duplicate_of_it`.
#[test]
fn a_users_processes_mapping_roots_weights_are_reported_without_roots_model() {
    let c = config(&roots_model("server", "weights-owner", ""));
    // Two command lines of their own (the command rule would group them otherwise).
    let procs = vec![
        of(0, 100, "python3", "weights-owner", GIB),
        of(1001, 200, "python3", "copy0", GIB),
        of(1001, 201, "python3", "copy1", GIB),
    ];
    let mut s = gsnap(
        0,
        procs,
        vec![gpu(
            0,
            8 * GIB,
            &[
                (100, Some(4 * GIB)),
                (200, Some(2 * GIB)),
                (201, Some(2 * GIB)),
            ],
        )],
    );
    s.mapped_weights = [100, 200, 201]
        .into_iter()
        .map(|p| (p, vec![weights_file(7)]))
        .collect();
    let (plan, found) = duplicates_said(&c, &s);
    assert_eq!(events(&plan), "duplicate_load", "{:#?}", plan.events);
    assert_eq!(
        found,
        [waste::Duplicate {
            gpu: 0,
            rule: waste::Rule::SameWeights {
                files: vec![weights_file(7)]
            },
            pids: vec![200, 201],
            held: 4 * GIB,
        }]
    );
    // Root's model is not blamed, nor its server in the group (whose first, lowest pid the
    // event is about).
    assert_eq!(
        (
            plan.events[0].about.model.as_deref(),
            plan.events[0].about.pid
        ),
        (None, Some(200)),
        "root's model blamed: {:#?}",
        plan.events
    );
}
