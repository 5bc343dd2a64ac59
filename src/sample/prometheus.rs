//! The Prometheus text exposition format (0.0.4, and the OpenMetrics lines a scraper sees in
//! practice), read from a model server's `/metrics`: `name{label="value",...} value [timestamp]`.
//! Only the families a caller asks for are kept (vLLM's answer is mostly histogram buckets).
//! The text is untrusted: a malformed line is skipped, never an error for the others.

/// One sample line.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples whose metric name `wanted` accepts, in order.
pub fn parse(text: &str, wanted: impl Fn(&str) -> bool) -> Vec<Sample> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|line| {
            let end = line
                .find(|c: char| c == '{' || c.is_whitespace())
                .unwrap_or(line.len());
            let name = &line[..end];
            if !wanted(name) {
                return None;
            }
            let (labels, rest) = match line[end..].strip_prefix('{') {
                Some(after) => parse_labels(after)?,
                None => (Vec::new(), &line[end..]),
            };
            let value = parse_value(rest.split_whitespace().next()?)?;
            Some(Sample {
                name: name.to_string(),
                labels,
                value,
            })
        })
        .collect()
}

/// `a="x",b="y\"z"}` -> the labels and what follows the closing brace.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (key, rest) = s.split_once('=')?;
        let mut chars = rest.trim_start().strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((key.trim().to_string(), value));
        s = &rest.trim_start()[1 + end + 1..];
    }
}

fn parse_value(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => text.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_names_labels_values_and_skips_the_rest() {
        let text = "# HELP vllm:num_requests_running Number of requests.\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"a \\\"b\\\" c\"} 8.0\n\
                    vllm:num_requests_waiting 24\n\
                    vllm:e2e_request_latency_seconds_bucket{le=\"+Inf\"} 3\n\
                    vllm:num_requests_running{broken=\"x} 1\n\
                    vllm:num_requests_running{a=\"1\"} not-a-number\n\
                    vllm:gpu_cache_usage_perc{a=\"1\"} 1.0 1712345678000\n";
        let samples = parse(text, |n| !n.ends_with("_bucket"));
        assert_eq!(samples.len(), 3, "{samples:?}");
        assert_eq!(samples[0].name, "vllm:num_requests_running");
        assert_eq!(samples[0].label("model_name"), Some("a \"b\" c"));
        assert_eq!(samples[0].label("engine"), Some("0"));
        assert_eq!(samples[0].value, 8.0);
        assert_eq!(samples[1].labels, vec![]);
        assert_eq!(samples[1].value, 24.0);
        assert_eq!(samples[2].value, 1.0, "a timestamp after the value");
    }

    #[test]
    fn hostile_input_never_panics() {
        for text in [
            "{",
            "x{",
            "x{a",
            "x{a=",
            "x{a=\"",
            "x{a=\"\\",
            "x{a=\"v\"",
            "x{a=\"v\"}",
            "x{=\"v\"} 1",
            "x 1e999",
            "\u{0}\u{ffff} 1",
        ] {
            let _ = parse(text, |_| true);
        }
        assert_eq!(parse("x 1e999", |_| true)[0].value, f64::INFINITY);
    }
}
