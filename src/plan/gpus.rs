//! The built-in table of common GPUs `gpuguard plan` can plan for by name, with the memory NVML
//! reports as their total (a little under the marketing size: "80GB" H100s report 79.6 GiB).

/// One card in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownGpu {
    /// What `--gpu` accepts (lower case, no spaces).
    pub key: &'static str,
    pub name: &'static str,
    /// NVML's total memory in MiB (`nvidia-smi --query-gpu=memory.total`).
    pub total_mib: u64,
}

impl KnownGpu {
    pub fn total_bytes(&self) -> u64 {
        self.total_mib << 20
    }
}

/// Smallest first. Totals are what NVML reports on these cards with ECC in its default state.
pub const KNOWN_GPUS: &[KnownGpu] = &[
    KnownGpu {
        key: "t4",
        name: "Tesla T4 16GB",
        total_mib: 15_360,
    },
    KnownGpu {
        key: "v100-16",
        name: "Tesla V100 16GB",
        total_mib: 16_384,
    },
    KnownGpu {
        key: "a10g",
        name: "A10G 24GB",
        total_mib: 23_028,
    },
    KnownGpu {
        key: "l4",
        name: "L4 24GB",
        total_mib: 23_034,
    },
    KnownGpu {
        key: "rtx4090",
        name: "GeForce RTX 4090 24GB",
        total_mib: 24_564,
    },
    KnownGpu {
        key: "rtx3090",
        name: "GeForce RTX 3090 24GB",
        total_mib: 24_576,
    },
    KnownGpu {
        key: "v100-32",
        name: "Tesla V100 32GB",
        total_mib: 32_768,
    },
    KnownGpu {
        key: "a100-40",
        name: "A100 40GB",
        total_mib: 40_960,
    },
    KnownGpu {
        key: "l40s",
        name: "L40S 48GB",
        total_mib: 46_068,
    },
    KnownGpu {
        key: "a6000",
        name: "RTX A6000 48GB",
        total_mib: 49_140,
    },
    KnownGpu {
        key: "h100",
        name: "H100 80GB",
        total_mib: 81_559,
    },
    KnownGpu {
        key: "a100-80",
        name: "A100 80GB",
        total_mib: 81_920,
    },
    KnownGpu {
        key: "h100-nvl",
        name: "H100 NVL 94GB",
        total_mib: 95_830,
    },
    KnownGpu {
        key: "h200",
        name: "H200 141GB",
        total_mib: 143_771,
    },
];

/// A card by its key (`h100`, `A100-80`, `a100 80gb`...): case, spaces, `_` and a trailing
/// "gb" do not matter.
pub fn find(name: &str) -> Option<&'static KnownGpu> {
    let wanted: String = name
        .to_ascii_lowercase()
        .chars()
        .filter(|c| !c.is_whitespace())
        .map(|c| if c == '_' { '-' } else { c })
        .collect();
    let wanted = wanted.strip_suffix("gb").unwrap_or(&wanted);
    KNOWN_GPUS.iter().find(|g| g.key == wanted)
}

/// The keys, for error messages and `--help`.
pub fn keys() -> String {
    KNOWN_GPUS
        .iter()
        .map(|g| g.key)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cards_by_loose_names() {
        assert_eq!(find("H100").unwrap().key, "h100");
        assert_eq!(find("a100_80GB").unwrap().total_mib, 81_920);
        assert_eq!(find("A100-40").unwrap().total_mib, 40_960);
        assert!(find("h1000").is_none());
        // Smallest first, so "the first that fits" is the cheapest card.
        assert!(KNOWN_GPUS
            .windows(2)
            .all(|w| w[0].total_mib <= w[1].total_mib));
    }
}
