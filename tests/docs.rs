//! The docs name only what exists, and stay short and narrow enough to read.
//!
//! Every repository path the Markdown docs name (`src/...`, `tests/...`, `bench/...`, ...), and
//! every one the comments of `src/` name, must exist; so must every relative link and its
//! anchor. README.md stays under 300 lines, and no line of README.md or docs/ outside a code
//! block is wider than 100 columns. Plain `cargo test` runs it: no features, no root.

use std::fs;
use std::path::{Path, PathBuf};

use regex::Regex;

/// The folders a repository path in the docs starts with.
const TOP: &[&str] = &[
    ".ci",
    "bench",
    "benches",
    "clients",
    "crates",
    "deploy",
    "docs",
    "packaging",
    "scripts",
    "src",
    "systemd",
    "tests",
];

/// What the scripts build and git does not keep: the docs may name it.
const GENERATED: &[&str] = &["bench/build/", "target/"];

const README_MAX_LINES: usize = 300;
const MAX_COLUMNS: usize = 100;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The files under `dir` (relative to the root), depth first, build outputs left out.
fn files_under(dir: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![root().join(dir)];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if name == "target" || name == "__pycache__" || name == ".git" {
                continue;
            }
            if path.is_dir() {
                pending.push(path);
            } else {
                found.push(path.strip_prefix(root()).unwrap().to_path_buf());
            }
        }
    }
    found.sort();
    found
}

/// The Markdown read as docs: the READMEs, BENCHMARKS.md and its results, docs/.
fn markdown_docs() -> Vec<PathBuf> {
    let mut docs = vec![
        PathBuf::from("README.md"),
        PathBuf::from("BENCHMARKS.md"),
        PathBuf::from("clients/python/README.md"),
    ];
    let is_md = |p: &PathBuf| p.extension().is_some_and(|e| e == "md");
    docs.extend(files_under("docs").into_iter().filter(is_md));
    docs.extend(files_under("bench/results").into_iter().filter(is_md));
    docs.extend(
        files_under("tests")
            .into_iter()
            .filter(|p| p.file_name().is_some_and(|n| n == "README.md")),
    );
    docs
}

/// The Rust sources whose comments are read: `src/` (and `crates/`, where there is one).
fn rust_sources() -> Vec<PathBuf> {
    let mut sources = files_under("src");
    sources.extend(files_under("crates"));
    sources.retain(|p| p.extension().is_some_and(|e| e == "rs"));
    sources
}

fn read(path: &Path) -> String {
    fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Maximal runs of the characters a path is written with, their sentence's full stop left off:
/// in "`crates/core/src/status.rs`)." that is `crates/core/src/status.rs`.
fn path_like(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || "_.~/-".contains(c)))
        .map(|word| word.trim_end_matches(['.', '-']))
        .filter(|word| !word.is_empty())
}

/// A path from the repository's root: it starts with one of its top-level folders.
fn is_repo_path(word: &str) -> bool {
    TOP.iter().any(|top| {
        word.strip_prefix(top)
            .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// A Rust file named without its folder: `segment.rs`.
fn is_bare_rust_file(word: &str) -> bool {
    word.strip_suffix(".rs").is_some_and(|stem| {
        stem.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') && !stem.contains('/')
    })
}

fn is_generated(word: &str) -> bool {
    GENERATED.iter().any(|g| word.starts_with(g))
}

/// A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The lines of a Markdown text outside its fenced code blocks, numbered from 1.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut in_code = false;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if !in_code {
            lines.push((i + 1, line));
        }
    }
    lines
}

fn anchors_of(text: &str) -> Vec<String> {
    prose_lines(text)
        .into_iter()
        .filter(|(_, line)| line.starts_with('#'))
        .map(|(_, line)| anchor(line.trim_start_matches('#')))
        .collect()
}

/// What a Markdown doc at `doc` names that is not there: repository paths (from the root, or
/// from the doc's own folder), Rust files named bare (`segment.rs`: some file of that name),
/// relative links and their anchors. `exists` says whether a path from the root exists.
fn missing_in_markdown(
    doc: &Path,
    text: &str,
    exists: &dyn Fn(&Path) -> bool,
    rust_names: &[String],
) -> Vec<String> {
    let here = doc.parent().unwrap_or(Path::new(""));
    let mut missing = Vec::new();
    for word in path_like(text) {
        let repo_path = is_repo_path(word);
        let bare_rust = !repo_path && is_bare_rust_file(word);
        if repo_path && !is_generated(word) && !exists(Path::new(word)) && !exists(&here.join(word))
        {
            missing.push(format!("{}: names {word}", doc.display()));
        }
        if bare_rust && !rust_names.iter().any(|name| name == word) {
            missing.push(format!(
                "{}: names {word}, which no file is called",
                doc.display()
            ));
        }
    }
    let link = Regex::new(r"\]\(([^)\s]+)\)").unwrap();
    for found in link.captures_iter(text) {
        let target = &found[1];
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
        let linked = if file.is_empty() {
            doc.to_path_buf()
        } else {
            normalise(&here.join(file))
        };
        if !exists(&linked) {
            missing.push(format!("{}: links to {target}", doc.display()));
        } else if !fragment.is_empty() && linked.extension().is_some_and(|e| e == "md") {
            let linked_text = if file.is_empty() {
                text.to_string()
            } else {
                read(&linked)
            };
            if !anchors_of(&linked_text).iter().any(|a| a == fragment) {
                missing.push(format!(
                    "{}: links to {target}: no such heading",
                    doc.display()
                ));
            }
        }
    }
    missing
}

/// What the comments of a Rust file at `source` name that is not there: repository paths, and
/// `.rs` files named from the file's own folder or one above it (`daemon/tests.rs` in
/// `src/sample/mod.rs`).
fn missing_in_rust(source: &Path, text: &str, exists: &dyn Fn(&Path) -> bool) -> Vec<String> {
    let comments: String = text
        .lines()
        .map(str::trim_start)
        .filter(|line| line.starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut missing = Vec::new();
    for word in path_like(&comments) {
        let found = if is_repo_path(word) {
            is_generated(word) || exists(Path::new(word))
        } else if word.ends_with(".rs") && !word.starts_with('/') {
            source
                .ancestors()
                .skip(1)
                .any(|folder| exists(&folder.join(word)))
        } else {
            true
        };
        if !found {
            missing.push(format!("{}: a comment names {word}", source.display()));
        }
    }
    missing
}

/// `a/b/../c` as `a/c`: links climb out of their folder.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

fn in_repo(path: &Path) -> bool {
    root().join(path).exists()
}

fn rust_file_names() -> Vec<String> {
    let mut names: Vec<String> = [".", "src", "tests", "benches", "crates"]
        .iter()
        .flat_map(|dir| {
            if *dir == "." {
                fs::read_dir(root())
                    .unwrap()
                    .flatten()
                    .map(|e| PathBuf::from(e.file_name()))
                    .collect()
            } else {
                files_under(dir)
            }
        })
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn every_path_the_docs_and_the_source_comments_name_exists() {
    let rust_names = rust_file_names();
    let mut missing = Vec::new();
    for doc in markdown_docs() {
        missing.extend(missing_in_markdown(
            &doc,
            &read(&doc),
            &in_repo,
            &rust_names,
        ));
    }
    for source in rust_sources() {
        missing.extend(missing_in_rust(&source, &read(&source), &in_repo));
    }
    assert!(missing.is_empty(), "stale paths:\n{}", missing.join("\n"));
}

#[test]
fn the_readme_is_short_and_no_doc_line_is_wider_than_100_columns() {
    let readme = read(Path::new("README.md"));
    let lines = readme.lines().count();
    assert!(lines <= README_MAX_LINES, "README.md has {lines} lines");
    let mut docs = vec![PathBuf::from("README.md")];
    docs.extend(
        files_under("docs")
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md")),
    );
    let mut wide = Vec::new();
    for doc in docs {
        for (number, line) in prose_lines(&read(&doc)) {
            let columns = line.chars().count();
            if columns > MAX_COLUMNS {
                wide.push(format!("{}:{number}: {columns} columns", doc.display()));
            }
        }
    }
    assert!(
        wide.is_empty(),
        "lines wider than {MAX_COLUMNS}:\n{}",
        wide.join("\n")
    );
}

/// The checks themselves: a doc or a comment naming what is not there is reported, and what is
/// there, generated or written otherwise (a placeholder, a path outside the repository), is not.
#[test]
fn a_missing_path_link_or_anchor_is_reported() {
    let exists = |p: &Path| {
        [
            "src",
            "crates/core/src/status.rs",
            "docs/a.md",
            "docs/b.md",
            "src/daemon/tests",
        ]
        .iter()
        .any(|known| p == Path::new(known))
    };
    let names = vec!["status.rs".to_string()];
    let doc = Path::new("docs/a.md");
    let text = "# Title\n\
        `crates/core/src/status.rs`, `src/gone.rs`. `bench/build/hog` is made by a script; /sys/fs/cgroup\n\
        and `src/**/*.rs` are not files of ours. `status.rs` and `nowhere.rs`.\n\
        [b](b.md), [c](c.md), [top](#title), [none](#nothing), [web](https://example.com/x).\n";
    let missing = missing_in_markdown(doc, text, &exists, &names);
    assert_eq!(
        missing,
        [
            "docs/a.md: names src/gone.rs",
            "docs/a.md: names nowhere.rs, which no file is called",
            "docs/a.md: links to c.md",
            "docs/a.md: links to #nothing: no such heading",
        ]
    );
    let source = Path::new("src/sample/mod.rs");
    let text = "//! Driven by fakes (`daemon/tests.rs`), see `crates/core/src/status.rs` and `tests.rs`.\n\
        let s = \"src/not-a-comment.rs\";\n";
    assert_eq!(
        missing_in_rust(source, text, &exists),
        [
            "src/sample/mod.rs: a comment names daemon/tests.rs",
            "src/sample/mod.rs: a comment names tests.rs",
        ]
    );
}

#[test]
fn anchors_are_made_as_github_makes_them() {
    assert_eq!(anchor(" What `status` shows"), "what-status-shows");
    assert_eq!(
        anchor("Resident memory and `--lock-memory`"),
        "resident-memory-and---lock-memory"
    );
    assert_eq!(
        anchor("RSS, PSS and cgroup shares"),
        "rss-pss-and-cgroup-shares"
    );
}
