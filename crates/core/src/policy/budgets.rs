//! Per-model budgets: a model over its RAM or GPU budget for longer than its `grace` gets its
//! action (alert, throttle, stop, kill); once back under budget, a throttle or stop is lifted.
//! A launched model's budget is what its launcher declared: its budget events are that account's
//! doing (`Event::caused_by`), held to its share of the per-uid rate limit by the loop.

use crate::config::{Config, Mode, ModelAction, ModelConfig};
use crate::kinds::{EventKind, ReasonKind};
use std::time::Duration;

use crate::snapshot::Snapshot;

use super::victim::model_target;
use super::{
    action, bytes, event, About, BudgetState, Enforcement, Entry, Launches, ModelUsage, Overage,
    Plan, PolicyState, Severity, Stage, Target, Verb,
};

/// A model over its budget this tick, as the transitions below need it.
struct Over {
    /// "model 'm' over budget: RAM 3 GiB > budget 2 GiB".
    why: String,
    kind: ReasonKind,
    /// GPU figures from a stale sample may alert, never act.
    may_act: bool,
}

pub(super) fn evaluate_budgets(
    config: &Config,
    snapshot: &Snapshot,
    launches: &Launches,
    state: &mut PolicyState,
    plan: &mut Plan,
) {
    if snapshot.processes.scanned_at.is_none() {
        return;
    }
    let now = snapshot.at;
    for budget in state.budgets.values_mut() {
        budget.wants_pss = false;
    }
    let models = launches.models(config);
    for model in models.iter() {
        let Some(index) = state
            .attribution
            .models
            .iter()
            .position(|u| u.name == model.name)
        else {
            continue;
        };
        let usage = &state.attribution.models[index];
        let budgets = model.budget_bytes(
            snapshot.host.total_bytes,
            snapshot.gpus.largest_total_bytes(),
        );
        let ram_budget = budgets.0;
        // Over its RAM budget by RSS: what its members really hold alone (PSS) decides, once
        // a scan has read it (the daemon asks one at once); until then, nothing changes.
        let wants_pss = ram_budget.is_some_and(|b| usage.rss_bytes > b);
        let excess = measure(budgets, usage);
        let budget = state.budgets.entry(model.name.clone()).or_default();
        budget.wants_pss = wants_pss;
        budget.launched_by = model.launched_by;
        if wants_pss && !snapshot.processes.pss_read {
            continue;
        }
        budget.over = excess.as_ref().map(|e| e.overage);
        let Some(Excess { overage, words }) = excess else {
            lift(budget, &model.name, plan);
            continue;
        };
        let over = Over {
            why: format!("model '{}' over budget: {}", model.name, words.join("; ")),
            kind: overage.reason(),
            may_act: !overage.gpu || !snapshot.gpus.stale,
        };
        let over_since = *budget.over_since.get_or_insert_with(|| {
            plan.events.push(
                event(
                    Severity::Warning,
                    EventKind::BudgetExceeded,
                    format!(
                        "{}; action {} after grace {}",
                        over.why,
                        model.action,
                        crate::units::fmt_duration(model.grace)
                    ),
                )
                .about(about_model(&model.name))
                .caused_by(model.launched_by),
            );
            now
        });
        match budget.enforced.clone() {
            None if now.saturating_sub(over_since) >= model.grace => {
                enforce(config, snapshot, state, model, index, &over, plan);
            }
            None => {}
            Some(enforced) => {
                follow_up(config, snapshot, &model.name, budget, enforced, &over, plan)
            }
        }
    }
    // Models that left the config or the host: lift what was enforced on them.
    let present: Vec<String> = models.iter().map(|m| m.name.clone()).collect();
    for (name, budget) in state
        .budgets
        .iter_mut()
        .filter(|(name, _)| !present.contains(name))
    {
        lift(budget, name, plan);
    }
    state
        .budgets
        .retain(|name, b| present.contains(name) || b.over_since.is_some());
}

/// A model over its budget: on what (RAM first when both are), and each excess in words.
struct Excess {
    overage: Overage,
    /// "RAM 3 GiB > budget 2 GiB", then the GPU's.
    words: Vec<String>,
}

/// What the model is over, if anything, against its `(RAM, GPU)` budgets in bytes.
fn measure(
    (ram_budget, gpu_budget): (Option<u64>, Option<u64>),
    usage: &ModelUsage,
) -> Option<Excess> {
    let mut over = Vec::new();
    let mut overage = None;
    if let Some(budget) = ram_budget {
        if usage.ram_bytes > budget {
            overage = Some(Overage {
                gpu: false,
                used_bytes: usage.ram_bytes,
                budget_bytes: budget,
            });
            over.push(format!(
                "RAM {} > budget {}",
                bytes(usage.ram_bytes),
                bytes(budget)
            ));
        }
    }
    if let Some(budget) = gpu_budget {
        let used = usage.gpu_total_bytes();
        if used > budget {
            overage.get_or_insert(Overage {
                gpu: true,
                used_bytes: used,
                budget_bytes: budget,
            });
            let per_gpu: Vec<String> = usage
                .gpu_bytes
                .iter()
                .map(|(i, b)| format!("GPU {i}: {}", bytes(*b)))
                .collect();
            over.push(format!(
                "GPU memory {} > budget {} ({})",
                bytes(used),
                bytes(budget),
                per_gpu.join(", ")
            ));
        }
    }
    overage.map(|overage| Excess {
        overage,
        words: over,
    })
}

/// Over budget past its grace: the model's action (alert, throttle, stop, terminate).
fn enforce(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    model: &ModelConfig,
    index: usize,
    over: &Over,
    plan: &mut Plan,
) {
    let target = model_target(config, snapshot, state, index);
    if target.members.is_empty() {
        return;
    }
    let verb = match model.action {
        ModelAction::Alert => None,
        // Not on a stale GPU reading: wait for a fresh one (budget_exceeded has alerted).
        _ if !over.may_act => return,
        ModelAction::Throttle => Some(Verb::Throttle),
        ModelAction::Stop => Some(Verb::Stop),
        ModelAction::Kill => Some(Verb::Terminate),
    };
    let stage = match (verb, config.daemon.mode) {
        (None, _) | (_, Mode::Observe) => Stage::Alerted,
        (Some(Verb::Throttle), _) => Stage::Throttled,
        (Some(Verb::Stop), _) => Stage::Stopped,
        _ => Stage::Terminated,
    };
    let detail = format!(
        "{} for longer than grace {}",
        over.why,
        crate::units::fmt_duration(model.grace)
    );
    let enforced = Enforcement {
        stage,
        since: snapshot.at,
        target,
    };
    match verb {
        Some(verb) => {
            let act = action(verb, &enforced.target, over.kind, detail, None);
            plan.actions.push(act.entering(Entry::Budget {
                model: model.name.clone(),
                enforced,
            }));
        }
        None => {
            plan.events.push(
                event(
                    Severity::Critical,
                    EventKind::BudgetEnforced,
                    format!("{detail} (alert only)"),
                )
                .about(about_model(&model.name))
                .caused_by(model.launched_by),
            );
            state
                .budgets
                .get_mut(&model.name)
                .expect("entry exists")
                .enforced = Some(enforced);
        }
    }
}

/// Still over budget with an enforcement in force: SIGKILL after `term_grace`, a new round once
/// the enforced processes are gone, the end of a stop at `max_stop`.
fn follow_up(
    config: &Config,
    snapshot: &Snapshot,
    name: &str,
    budget: &mut BudgetState,
    enforced: Enforcement,
    over: &Over,
    plan: &mut Plan,
) {
    let now = snapshot.at;
    let d = &config.daemon;
    let Enforcement {
        stage,
        since,
        target,
    } = enforced;
    let held_for = now.saturating_sub(since);
    match stage {
        Stage::Terminated if held_for >= d.term_grace && target.any_alive(snapshot) => {
            let kill = action(
                Verb::Kill,
                &target,
                over.kind,
                format!("{}; SIGTERM not enough", over.why),
                None,
            );
            plan.actions
                .push(kill.entering(Entry::killed(name, now, target)));
        }
        // The enforced processes are gone but the model is still over budget (restarted by its
        // supervisor): a new round, starting with a new grace.
        Stage::Terminated | Stage::Killed if !target.any_alive(snapshot) => {
            budget.enforced = None;
            budget.over_since = Some(now);
        }
        Stage::Stopped if held_for >= d.max_stop => {
            end_stop(config, name, budget, target, now, over, plan)
        }
        _ => {}
    }
}

/// Stopped for `max_stop`: killed, or resumed when the GPU reading is stale (never killed on it).
fn end_stop(
    config: &Config,
    name: &str,
    budget: &mut BudgetState,
    target: Target,
    now: Duration,
    over: &Over,
    plan: &mut Plan,
) {
    let max_stop = crate::units::fmt_duration(config.daemon.max_stop);
    if !over.may_act {
        plan.actions.push(action(
            Verb::Resume,
            &target,
            ReasonKind::MaxStop,
            format!(
                "{}; stopped for {max_stop} (max_stop) but the GPU reading is stale: resumed, never killed on it",
                over.why,
            ),
            None,
        ));
        budget.enforced = None;
        return;
    }
    let kill = action(
        Verb::Kill,
        &target,
        ReasonKind::MaxStop,
        format!("{}; stopped for {max_stop} (max_stop)", over.why),
        None,
    );
    plan.actions
        .push(kill.entering(Entry::killed(name, now, target)));
}

/// The model is back under budget (or gone): resume or unthrottle it.
fn lift(budget: &mut BudgetState, name: &str, plan: &mut Plan) {
    budget.over = None;
    if budget.over_since.take().is_some() {
        plan.events.push(
            event(
                Severity::Info,
                EventKind::BudgetCleared,
                format!("model '{name}' back under budget"),
            )
            .about(about_model(name))
            .caused_by(budget.launched_by),
        );
    }
    let Some(Enforcement { stage, target, .. }) = budget.enforced.take() else {
        return;
    };
    match stage {
        Stage::Stopped => plan.actions.push(action(
            Verb::Resume,
            &target,
            ReasonKind::Cleared,
            format!("model '{name}' back under budget"),
            None,
        )),
        Stage::Throttled => plan.actions.push(action(
            Verb::Unthrottle,
            &target,
            ReasonKind::Cleared,
            format!("model '{name}' back under budget"),
            None,
        )),
        _ => {}
    }
}

fn about_model(name: &str) -> About {
    About {
        model: Some(name.to_string()),
        ..About::default()
    }
}
