//! The same weights loaded twice (`waste`): spawned workers mapping one file, other accounts,
//! identical commands.

use super::*;

#[test]
fn spawned_workers_mapping_the_same_weights_on_one_gpu_are_reported_once() {
    let c = config(&model("server", ""));
    // A server (matched) and two spawn-started workers: their command lines are the
    // multiprocessing bootstrap, not the server's, and they are its children.
    let spawn = "python3 -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7) --multiprocessing-fork";
    let procs = vec![
        proc(100, "server", GIB, 1),
        Process {
            cmdline: spawn.into(),
            ..proc(101, "python3", GIB, 100)
        },
        Process {
            cmdline: format!("{spawn} x"),
            ..proc(102, "python3", GIB, 100)
        },
    ];
    let mapped = |pids: &[i32]| {
        pids.iter()
            .map(|&p| (p, vec![weights_file(7), weights_file(8)]))
            .collect()
    };
    let step = |at: u64, gpu0: &[(i32, Option<u64>)], gpu1: &[(i32, Option<u64>)]| {
        let mut s = gsnap(
            at,
            procs.clone(),
            vec![gpu(0, 4 * GIB, gpu0), gpu(1, 8 * GIB, gpu1)],
        );
        s.mapped_weights = mapped(&[100, 101, 102]);
        s
    };
    let mut state = PolicyState::default();
    let plans = play(
        &c,
        &mut state,
        vec![
            // 100 and 101 on GPU 0 both map model-7 and model-8: one report, not one per file.
            (
                step(
                    0,
                    &[(100, Some(4 * GIB)), (101, Some(4 * GIB))],
                    &[(102, Some(4 * GIB))],
                ),
                "",
                "duplicate_load",
            ),
            // Still there: not reported again.
            (
                step(
                    100,
                    &[(100, Some(4 * GIB)), (101, Some(4 * GIB))],
                    &[(102, Some(4 * GIB))],
                ),
                "",
                "",
            ),
            // Tensor-parallel-like: one process per GPU mapping the same files is not waste.
            (
                step(200, &[(101, Some(4 * GIB))], &[(102, Some(4 * GIB))]),
                "",
                "",
            ),
            // A process that maps the weights but holds no GPU memory on GPU 0 is not counted.
            (
                step(300, &[(101, Some(4 * GIB)), (100, Some(0))], &[]),
                "",
                "",
            ),
        ],
    );
    // What the first tick reported: the two on GPU 0, by both files, holding 8 GiB together.
    let first = step(
        0,
        &[(100, Some(4 * GIB)), (101, Some(4 * GIB))],
        &[(102, Some(4 * GIB))],
    );
    let (plan, found) = duplicates_said(&c, &first);
    assert_eq!(plan.events, plans[0].events);
    assert_eq!(
        found,
        [waste::Duplicate {
            gpu: 0,
            rule: waste::Rule::SameWeights {
                files: vec![weights_file(7), weights_file(8)]
            },
            pids: vec![100, 101],
            held: 8 * GIB,
        }]
    );
    assert_eq!(plans[0].events[0].about.model.as_deref(), Some("server"));
}

/// Round three: another account's process that maps a model's weights file (any user may read
/// it) on the same GPU made the duplicate warning blame the model, anew each time the attacker
/// restarted. Only processes of one uid are one load twice.
#[test]
fn another_accounts_process_mapping_a_models_weights_is_not_a_duplicate_of_it() {
    let c = config(&model("server", ""));
    let attacker = Process {
        uid: 1001,
        ..proc(200, "python3", GIB, 1)
    };
    let mut s = gsnap(
        0,
        vec![proc(100, "server", GIB, 1), attacker],
        vec![gpu(0, 4 * GIB, &[(100, Some(4 * GIB)), (200, Some(GIB))])],
    );
    s.mapped_weights = [100, 200]
        .into_iter()
        .map(|p| (p, vec![weights_file(7)]))
        .collect();
    let plan = once(&c, &s);
    assert_eq!(events(&plan), "", "{:#?}", plan.events);
}

#[test]
fn identical_commands_already_reported_by_their_weights_are_not_reported_twice() {
    let c = config("");
    // Two unrelated processes with one command line, both mapping the same file.
    let procs = vec![proc(200, "vllm", GIB, 1), proc(201, "vllm", GIB, 1)];
    let mut s = gsnap(
        0,
        procs,
        vec![gpu(
            0,
            4 * GIB,
            &[(200, Some(4 * GIB)), (201, Some(4 * GIB))],
        )],
    );
    let (plan, found) = duplicates_said(&c, &s);
    assert_eq!(events(&plan), "duplicate_load");
    assert_eq!(
        found,
        [waste::Duplicate {
            gpu: 0,
            rule: waste::Rule::SameCommand {
                cmdline: "/usr/bin/vllm".into()
            },
            pids: vec![200, 201],
            held: 8 * GIB,
        }]
    );
    s.mapped_weights = [(200, vec![weights_file(9)]), (201, vec![weights_file(9)])].into();
    let (plan, found) = duplicates_said(&c, &s);
    assert_eq!(events(&plan), "duplicate_load", "{:#?}", plan.events);
    assert_eq!(
        found,
        [waste::Duplicate {
            gpu: 0,
            rule: waste::Rule::SameWeights {
                files: vec![weights_file(9)]
            },
            pids: vec![200, 201],
            held: 8 * GIB,
        }]
    );
}
