//! The built-in table of common GPUs `gpuguard plan` can plan for by name, with the memory NVML
//! reports as their total (a little under the marketing size: "80GB" H100s report 79.6 GiB), and
//! the Google Compute Engine machine types that carry each (`plan --cloud gcp`): N1 with T4 or
//! V100 attached, G2 (L4), G4 (RTX PRO 6000), A2 (A100 40 and 80 GB), A3 (H100, H200), A4 (B200),
//! A4X (GB200, on Grace: arm64).

/// One card in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownGpu {
    /// What `--gpu` accepts (lower case, no spaces).
    pub key: &'static str,
    pub name: &'static str,
    /// NVML's total memory in MiB (`nvidia-smi --query-gpu=memory.total`).
    pub total_mib: u64,
    /// GCE machine types with this GPU, fewest GPUs first: (GPUs per VM, machine type).
    pub gcp: &'static [(u32, &'static str)],
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
        gcp: &[(1, "n1 + 1 T4"), (2, "n1 + 2 T4"), (4, "n1 + 4 T4")],
    },
    KnownGpu {
        key: "v100-16",
        name: "Tesla V100 16GB",
        total_mib: 16_384,
        gcp: &[
            (1, "n1 + 1 V100"),
            (2, "n1 + 2 V100"),
            (4, "n1 + 4 V100"),
            (8, "n1 + 8 V100"),
        ],
    },
    KnownGpu {
        key: "a10g",
        name: "A10G 24GB",
        total_mib: 23_028,
        gcp: &[],
    },
    KnownGpu {
        key: "l4",
        name: "L4 24GB",
        total_mib: 23_034,
        gcp: &[
            (1, "g2-standard-4"),
            (2, "g2-standard-24"),
            (4, "g2-standard-48"),
            (8, "g2-standard-96"),
        ],
    },
    KnownGpu {
        key: "rtx4090",
        name: "GeForce RTX 4090 24GB",
        total_mib: 24_564,
        gcp: &[],
    },
    KnownGpu {
        key: "rtx3090",
        name: "GeForce RTX 3090 24GB",
        total_mib: 24_576,
        gcp: &[],
    },
    KnownGpu {
        key: "v100-32",
        name: "Tesla V100 32GB",
        total_mib: 32_768,
        gcp: &[],
    },
    KnownGpu {
        key: "a100-40",
        name: "A100 40GB",
        total_mib: 40_960,
        gcp: &[
            (1, "a2-highgpu-1g"),
            (2, "a2-highgpu-2g"),
            (4, "a2-highgpu-4g"),
            (8, "a2-highgpu-8g"),
            (16, "a2-megagpu-16g"),
        ],
    },
    KnownGpu {
        key: "l40s",
        name: "L40S 48GB",
        total_mib: 46_068,
        gcp: &[],
    },
    KnownGpu {
        key: "a6000",
        name: "RTX A6000 48GB",
        total_mib: 49_140,
        gcp: &[],
    },
    KnownGpu {
        key: "h100",
        name: "H100 80GB",
        total_mib: 81_559,
        gcp: &[
            (1, "a3-highgpu-1g"),
            (2, "a3-highgpu-2g"),
            (4, "a3-highgpu-4g"),
            (8, "a3-highgpu-8g"),
        ],
    },
    KnownGpu {
        key: "a100-80",
        name: "A100 80GB",
        total_mib: 81_920,
        gcp: &[
            (1, "a2-ultragpu-1g"),
            (2, "a2-ultragpu-2g"),
            (4, "a2-ultragpu-4g"),
            (8, "a2-ultragpu-8g"),
        ],
    },
    KnownGpu {
        key: "h100-nvl",
        name: "H100 NVL 94GB",
        total_mib: 95_830,
        gcp: &[],
    },
    KnownGpu {
        key: "rtx-pro-6000",
        name: "RTX PRO 6000 96GB",
        total_mib: 97_887,
        gcp: &[
            (1, "g4-standard-48"),
            (2, "g4-standard-96"),
            (4, "g4-standard-192"),
            (8, "g4-standard-384"),
        ],
    },
    KnownGpu {
        key: "h200",
        name: "H200 141GB",
        total_mib: 143_771,
        gcp: &[(8, "a3-ultragpu-8g")],
    },
    KnownGpu {
        key: "b200",
        name: "B200 180GB",
        total_mib: 183_359,
        gcp: &[(8, "a4-highgpu-8g")],
    },
    KnownGpu {
        key: "gb200",
        name: "GB200 186GB",
        total_mib: 189_471,
        gcp: &[(4, "a4x-highgpu-4g")],
    },
];

/// The GCE machine type for `tp` of this GPU: the one with the fewest GPUs that has as many
/// (its name says how many it has where that is more: `a3-ultragpu-8g`), `None` if none has.
pub fn gcp_machine(machines: &[(u32, &str)], tp: u32) -> Option<String> {
    machines
        .iter()
        .find(|(n, _)| *n >= tp)
        .map(|(_, name)| name.to_string())
}

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
        assert_eq!(find("B200").unwrap().total_mib, 183_359);
        // GCE: the fewest GPUs that carry TP, with the count when the VM has more.
        let h100 = find("h100").unwrap().gcp;
        assert_eq!(gcp_machine(h100, 2).as_deref(), Some("a3-highgpu-2g"));
        assert_eq!(gcp_machine(h100, 3).as_deref(), Some("a3-highgpu-4g"));
        assert_eq!(gcp_machine(h100, 16), None);
        let h200 = find("h200").unwrap().gcp;
        assert_eq!(gcp_machine(h200, 1).as_deref(), Some("a3-ultragpu-8g"));
        assert!(find("a10g").unwrap().gcp.is_empty());
        // Smallest first, so "the first that fits" is the cheapest card.
        assert!(KNOWN_GPUS
            .windows(2)
            .all(|w| w[0].total_mib <= w[1].total_mib));
    }
}
