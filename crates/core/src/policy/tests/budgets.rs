//! Per-model budgets: actions after grace, grace restarting, a stopped model killed after
//! `max_stop`, a model restarted after a budget kill.

use super::*;

#[test]
fn budget_grace_restarts_when_back_under() {
    let c = config(&model(
        "vllm",
        "ram = \"2GiB\"\naction = \"stop\"\ngrace = \"5s\"\n",
    ));
    let use_ = |rss| vec![proc(100, "vllm", rss, 1)];
    let ok = Some(32 * GIB);
    play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, ok, use_(3 * GIB)), "", "budget_exceeded"),
            (snap(3000, ok, use_(GIB)), "", "budget_cleared"),
            (snap(6000, ok, use_(3 * GIB)), "", "budget_exceeded"),
            (snap(10_999, ok, use_(3 * GIB)), "", ""),
            (snap(11_000, ok, use_(3 * GIB)), "stop vllm[100]", ""),
        ],
    );
}

#[test]
fn budget_stopped_model_is_killed_after_max_stop() {
    let c = config(&format!(
        "[daemon]\nmax_stop = \"30s\"\n{}",
        model(
            "vllm",
            "ram = \"2GiB\"\naction = \"stop\"\ngrace = \"0s\"\n"
        )
    ));
    let a = || vec![proc(100, "vllm", 3 * GIB, 1), proc(101, "worker", GIB, 100)];
    let ok = Some(32 * GIB);
    let plans = play(
        &c,
        &mut PolicyState::default(),
        vec![
            (snap(0, ok, a()), "stop vllm[100,101]", "budget_exceeded"),
            (snap(29_999, ok, a()), "", ""),
            (snap(30_000, ok, a()), "kill vllm[100,101]", ""),
            (snap(31_000, ok, a()), "", ""),
            (snap(32_000, ok, vec![]), "", "budget_cleared"),
        ],
    );
    assert_eq!(plans[2].actions[0].reason.kind, "max_stop");
}

#[test]
fn gpu_floor_picks_the_largest_holder_on_that_gpu() {
    let c = config("[gpu]\nmin_free = \"2GiB\"\n");
    // pid 300 is the biggest everywhere, but only on GPU 1.
    let procs = || {
        vec![
            proc(100, "vllm", GIB, 1),
            proc(200, "notebook", GIB, 1),
            proc(300, "trainer", 20 * GIB, 1),
        ]
    };
    let low = 3 * GIB / 2;
    let ok = 3 * GIB;
    let cases = [
        (low, ok, "terminate [100]", "floor_act"),
        (ok, low, "terminate [300]", "floor_act"),
        (
            low,
            low,
            "terminate [100]; terminate [300]",
            "floor_act, floor_act",
        ),
        (ok, ok, "", ""),
    ];
    for (free0, free1, want_acts, want_events) in cases {
        let s = |at| {
            gsnap(
                at,
                procs(),
                vec![
                    gpu(0, free0, &[(100, Some(8 * GIB)), (200, Some(4 * GIB))]),
                    gpu(1, free1, &[(300, Some(12 * GIB))]),
                ],
            )
        };
        let killed = want_acts.replace("terminate", "kill");
        let plans = play(
            &c,
            &mut PolicyState::default(),
            vec![
                (s(0), want_acts, want_events),
                (s(500), "", ""),
                (s(1000), killed.as_str(), ""),
            ],
        );
        for a in &plans[0].actions {
            assert_eq!(a.reason.kind, "gpu_floor");
            assert_eq!(a.recheck, None);
        }
    }
}
