//! Samples on jumps: besides those the clock keeps (`Pressure`), a sample is kept when a GPU's
//! used memory or a model's RAM or GPU memory has moved by more than `JUMP_BYTES` since the
//! last sample kept, so a model that loads 40 GiB between two quiet samples 10 s apart is in the
//! history as it happened. Bounded as the events clients cause are (`reserve::limit`): at most
//! `PER_WINDOW` such samples in a fixed window of `WINDOW` (so at most twice that over any
//! `WINDOW`), whatever a figure does: a figure that flaps cannot flood the history. A model a
//! user launched with no `[[model]]` is left out, as it is of the recording rate (anyone can keep
//! one flapping); a GPU's used memory is anyone's to move, so that is what the bound is for, and
//! its jumps have a budget of their own: a user who keeps a GPU's memory flapping spends only
//! that one, and a model of the config that loads is still kept when it does.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::kinds::ModelSource;
use crate::view::TickView;

/// A figure that moved by more than this since the last sample kept is a jump.
pub const JUMP_BYTES: u64 = 1 << 30;
/// Samples kept for jumps in one window, at most.
pub const PER_WINDOW: u32 = 6;
pub const WINDOW: Duration = Duration::from_secs(60);

/// The figures a jump is looked for in: each GPU's used memory (as far as read: a reading that
/// goes missing is not a jump), each model of the config's RAM and GPU memory (a model that came
/// or went counts from or to 0: its memory came or went with it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    gpus: BTreeMap<u32, u64>,
    models: BTreeMap<String, (u64, u64)>,
}

impl Figures {
    pub fn of(view: &TickView) -> Figures {
        Figures {
            gpus: view
                .gpus
                .iter()
                .filter_map(|g| Some((g.index, g.used_bytes?)))
                .collect(),
            models: view
                .models
                .iter()
                .filter(|m| m.source == ModelSource::Config)
                .map(|m| (m.name.clone(), (m.ram_bytes, m.gpu_bytes.unwrap_or(0))))
                .collect(),
        }
    }

    /// Which figures moved by more than `JUMP_BYTES` from `before`: a model's, a GPU's.
    fn jumped_from(&self, before: &Figures) -> Option<Budget> {
        let far = |a: u64, b: u64| a.abs_diff(b) > JUMP_BYTES;
        let gpus = self
            .gpus
            .iter()
            .any(|(i, used)| before.gpus.get(i).is_some_and(|b| far(*used, *b)));
        let zero = (0, 0);
        let models = self
            .models
            .iter()
            .map(|(name, now)| (now, before.models.get(name).unwrap_or(&zero)))
            .chain(
                before
                    .models
                    .iter()
                    .filter(|(name, _)| !self.models.contains_key(*name))
                    .map(|(_, then)| (&zero, then)),
            )
            .any(|(now, then)| far(now.0, then.0) || far(now.1, then.1));
        if models {
            Some(Budget::Models)
        } else if gpus {
            Some(Budget::Gpus)
        } else {
            None
        }
    }
}

/// The two budgets of jump samples: the config's models', and the GPUs' (anyone's to move).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Budget {
    Models = 0,
    Gpus = 1,
}

/// The figures of the last sample kept, and the jump samples of this window.
#[derive(Debug, Default)]
pub struct Jumps {
    last: Option<Figures>,
    /// For each budget, when its current window began and the jump samples kept in it.
    windows: [Option<(Instant, u32)>; 2],
}

impl Jumps {
    /// Whether `now`'s figures jumped since the last sample kept and the window has room for
    /// one more jump sample (if so, it is counted).
    pub fn due(&mut self, now: Instant, figures: &Figures) -> bool {
        let Some(last) = &self.last else {
            return false;
        };
        let Some(budget) = figures.jumped_from(last) else {
            return false;
        };
        let (started, kept) = self.windows[budget as usize].get_or_insert((now, 0));
        if now.saturating_duration_since(*started) >= WINDOW {
            (*started, *kept) = (now, 0);
        }
        if *kept >= PER_WINDOW {
            return false;
        }
        *kept += 1;
        true
    }

    /// A sample was kept with these figures: jumps are measured from them on.
    pub fn kept(&mut self, figures: Figures) {
        self.last = Some(figures);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{GpuRow, ModelRow};

    const GIB: u64 = 1 << 30;

    fn view(gpu_used: u64, model_ram: u64) -> TickView {
        TickView {
            gpus: vec![GpuRow {
                index: 0,
                used_bytes: Some(gpu_used),
                ..GpuRow::default()
            }],
            models: vec![ModelRow {
                name: "m".into(),
                ram_bytes: model_ram,
                ..ModelRow::default()
            }],
            ..TickView::default()
        }
    }

    /// A move of more than 1 GiB of a GPU or a model since the last sample kept is a jump; a
    /// smaller one, or many small ones that add up under it, is not.
    #[test]
    fn a_jump_is_a_move_past_the_threshold_since_the_last_sample_kept() {
        let t0 = Instant::now();
        let mut j = Jumps::default();
        assert!(
            !j.due(t0, &Figures::of(&view(GIB, GIB))),
            "nothing kept yet"
        );
        j.kept(Figures::of(&view(GIB, GIB)));
        assert!(
            !j.due(t0, &Figures::of(&view(2 * GIB, GIB))),
            "exactly 1 GiB"
        );
        assert!(
            j.due(t0, &Figures::of(&view(3 * GIB, GIB))),
            "GPU used +2 GiB"
        );
        assert!(
            j.due(t0, &Figures::of(&view(GIB, 3 * GIB))),
            "model RAM +2 GiB"
        );
        // A model that came or went counts from or to 0; a GPU whose reading went missing is no
        // jump of its own.
        j.kept(Figures::of(&view(3 * GIB, 3 * GIB)));
        let mut gone = view(0, 0);
        gone.models.clear();
        gone.gpus[0].used_bytes = None;
        assert!(j.due(t0, &Figures::of(&gone)), "the model's 3 GiB gone");
        j.kept(Figures::of(&view(3 * GIB, 0)));
        gone.models = view(0, 0).models;
        assert!(!j.due(t0, &Figures::of(&gone)), "the GPU's reading gone");
        assert!(!j.due(t0, &Figures::of(&view(3 * GIB, GIB / 2))));
        // A model a user launched (no `[[model]]`) is no jump, however it moves.
        let mut launched = view(3 * GIB, 0);
        launched.models[0].source = ModelSource::Launch;
        launched.models[0].ram_bytes = 40 * GIB;
        assert!(!j.due(t0, &Figures::of(&launched)));
    }

    /// A figure that flaps every tick gets at most `PER_WINDOW` jump samples a window.
    #[test]
    fn a_flapping_figure_is_kept_at_most_per_window_times_a_window() {
        let t0 = Instant::now();
        let mut j = Jumps::default();
        let mut kept = 0;
        // 4 ticks a second for two windows, the GPU's use flapping by 10 GiB each tick.
        for tick in 0..(2 * 4 * WINDOW.as_secs()) {
            let now = t0 + Duration::from_millis(250 * tick);
            let f = Figures::of(&view(if tick % 2 == 0 { 0 } else { 10 * GIB }, 0));
            if tick == 0 || j.due(now, &f) {
                kept += u32::from(tick > 0);
                j.kept(f);
            }
        }
        assert_eq!(kept, 2 * PER_WINDOW);
    }

    /// The hostile review: a user who keeps a GPU's memory flapping spent the one budget in
    /// the first seconds of each window, and a model of the config that loaded 40 GiB then got
    /// no sample until the clock's. The GPUs' jumps have a budget of their own.
    #[test]
    fn a_flapping_gpu_does_not_spend_the_budget_of_the_configs_models() {
        let t0 = Instant::now();
        let mut j = Jumps::default();
        j.kept(Figures::of(&view(0, GIB)));
        let mut gpu_kept = 0;
        for tick in 1..=40 {
            let f = Figures::of(&view(if tick % 2 == 0 { 0 } else { 10 * GIB }, GIB));
            if j.due(t0 + Duration::from_millis(250 * tick), &f) {
                gpu_kept += 1;
                j.kept(f);
            }
        }
        assert_eq!(gpu_kept, PER_WINDOW, "the GPU's jumps are bounded");
        let loaded = Figures::of(&view(0, 41 * GIB));
        assert!(
            j.due(t0 + Duration::from_secs(11), &loaded),
            "the model's load is kept within the same window"
        );
    }
}
