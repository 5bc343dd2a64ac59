//! The layering of the crate, checked: every top-level module (a file or a folder of `src/`)
//! imports only from its own layer or below, and no two import each other, directly or around a
//! circle. Read top-down, the layers are the pipeline: the CLI starts the daemon, which samples
//! (`sample`), decides (`policy`, `reserve`), acts (`act`), tells (`alert`, `metrics`),
//! remembers (`history`) and serves (`ipc`).

#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Layers, top first; a module may import from its own layer (without a circle) or any below.
const LAYERS: &[&[&str]] = &[
    &["main", "lib", "layers", "properties"],
    &["cli"],
    &["daemon"],
    &["ipc", "act", "alert", "metrics", "history"],
    &["view"],
    &["policy", "reserve", "plan"],
    &["config", "snapshot", "sample", "protocol", "status"],
    &["units", "kinds", "http", "state_dir", "secrets"],
];

fn layer(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|l| l.contains(&module))
        .unwrap_or_else(|| panic!("module {module} is in no layer: add it to LAYERS"))
}

/// `crate::x` imports of each top-level module's non-test code.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(&src).unwrap();
            let first = relative.components().next().unwrap().as_os_str();
            let module = first.to_string_lossy().trim_end_matches(".rs").to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    edges.entry(module.clone()).or_default().insert(name);
                }
            }
            edges.entry(module).or_default();
        }
    }
    // Only names that are modules (`crate::x` in a doc comment is not an import).
    let modules: BTreeSet<String> = edges.keys().cloned().collect();
    for tos in edges.values_mut() {
        tos.retain(|t| modules.contains(t));
    }
    edges
}

#[test]
fn modules_import_only_downwards_and_never_in_a_circle() {
    let edges = imports();
    for (from, tos) in &edges {
        for to in tos {
            assert!(
                layer(from) <= layer(to),
                "{from} (layer {}) imports {to} (layer {}), a layer above it",
                layer(from),
                layer(to)
            );
        }
    }
    // No circle: every module reaches only modules that do not reach it back.
    for start in edges.keys() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<&String> = edges[start].iter().collect();
        while let Some(m) = stack.pop() {
            assert!(m != start, "{start} imports itself around a circle");
            if seen.insert(m.clone()) {
                stack.extend(edges.get(m).into_iter().flatten());
            }
        }
    }
    assert!(edges.len() >= 20, "{edges:?}");
}
