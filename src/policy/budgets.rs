//! Per-model budgets: a model over its RAM or GPU budget for longer than its `grace` gets its
//! action (alert, throttle, stop, kill); once back under budget, a throttle or stop is lifted.

use crate::config::{Config, Mode, ModelAction, ModelConfig};
use crate::kinds::{EventKind, ReasonKind};
use crate::snapshot::Snapshot;

use super::victim::model_target;
use super::{
    action, bytes, event, About, BudgetState, Overage, Plan, PolicyState, Severity, Stage, Verb,
};

pub(super) fn evaluate_budgets(
    config: &Config,
    snapshot: &Snapshot,
    state: &mut PolicyState,
    plan: &mut Plan,
) {
    if snapshot.processes.scanned_at.is_none() {
        return;
    }
    let now = snapshot.at;
    let models: Vec<ModelConfig> = state.models(config).iter().cloned().collect();
    for model in &models {
        let Some(index) = state
            .attribution
            .models
            .iter()
            .position(|u| u.name == model.name)
        else {
            continue;
        };
        let usage = &state.attribution.models[index];
        let (ram_budget, gpu_budget) = model.budget_bytes(
            snapshot.host.total_bytes,
            snapshot.gpus.largest_total_bytes(),
        );
        let mut over = Vec::new();
        let mut overage = None;
        if let Some(budget) = ram_budget {
            if usage.rss_bytes > budget {
                overage = Some(Overage {
                    gpu: false,
                    used_bytes: usage.rss_bytes,
                    budget_bytes: budget,
                });
                over.push(format!(
                    "RAM {} > budget {}",
                    bytes(usage.rss_bytes),
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
        let budget = state.budgets.entry(model.name.clone()).or_default();
        budget.over = overage;
        let Some(overage) = overage else {
            lift(budget, &model.name, plan);
            continue;
        };
        // GPU figures from a stale sample may alert, never act.
        let may_act = !overage.gpu || !snapshot.gpus.stale;
        let why = format!("model '{}' over budget: {}", model.name, over.join("; "));
        let kind = overage.reason();
        let over_since = *budget.over_since.get_or_insert_with(|| {
            plan.events.push(
                event(
                    Severity::Warning,
                    EventKind::BudgetExceeded,
                    format!(
                        "{why}; action {} after grace {}",
                        model.action,
                        humantime::format_duration(model.grace)
                    ),
                )
                .about(about_model(&model.name)),
            );
            now
        });
        let d = &config.daemon;
        match budget.enforced.clone() {
            None if now.saturating_sub(over_since) >= model.grace => {
                let target = model_target(config, snapshot, state, index);
                if target.members.is_empty() {
                    continue;
                }
                let verb = match model.action {
                    ModelAction::Alert => None,
                    // Not on a stale GPU reading: wait for a fresh one (budget_exceeded has alerted).
                    _ if !may_act => continue,
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
                    "{why} for longer than grace {}",
                    humantime::format_duration(model.grace)
                );
                match verb {
                    Some(verb) => plan.actions.push(action(verb, &target, kind, detail, None)),
                    None => plan.events.push(
                        event(
                            Severity::Critical,
                            EventKind::BudgetEnforced,
                            format!("{detail} (alert only)"),
                        )
                        .about(about_model(&model.name)),
                    ),
                }
                state
                    .budgets
                    .get_mut(&model.name)
                    .expect("entry exists")
                    .enforced = Some((stage, now, target));
            }
            Some((Stage::Terminated, since, target))
                if now.saturating_sub(since) >= d.term_grace && target.any_alive(snapshot) =>
            {
                plan.actions.push(action(
                    Verb::Kill,
                    &target,
                    kind,
                    format!("{why}; SIGTERM not enough"),
                    None,
                ));
                budget.enforced = Some((Stage::Killed, now, target));
            }
            // The enforced processes are gone but the model is still over budget (restarted by
            // its supervisor): a new round, starting with a new grace.
            Some((Stage::Terminated | Stage::Killed, _, target)) if !target.any_alive(snapshot) => {
                budget.enforced = None;
                budget.over_since = Some(now);
            }
            // At max_stop on a stale GPU reading: resumed, never killed on it.
            Some((Stage::Stopped, since, target))
                if now.saturating_sub(since) >= d.max_stop && !may_act =>
            {
                plan.actions.push(action(
                    Verb::Resume,
                    &target,
                    ReasonKind::MaxStop,
                    format!(
                        "{why}; stopped for {} (max_stop) but the GPU reading is stale: resumed, never killed on it",
                        humantime::format_duration(d.max_stop)
                    ),
                    None,
                ));
                budget.enforced = None;
            }
            Some((Stage::Stopped, since, target)) if now.saturating_sub(since) >= d.max_stop => {
                plan.actions.push(action(
                    Verb::Kill,
                    &target,
                    ReasonKind::MaxStop,
                    format!(
                        "{why}; stopped for {} (max_stop)",
                        humantime::format_duration(d.max_stop)
                    ),
                    None,
                ));
                budget.enforced = Some((Stage::Killed, now, target));
            }
            _ => {}
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
            .about(about_model(name)),
        );
    }
    match budget.enforced.take() {
        Some((Stage::Stopped, _, target)) => plan.actions.push(action(
            Verb::Resume,
            &target,
            ReasonKind::Cleared,
            format!("model '{name}' back under budget"),
            None,
        )),
        Some((Stage::Throttled, _, target)) => plan.actions.push(action(
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
