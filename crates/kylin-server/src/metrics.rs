//! `/metrics`: the engine's gauges and counters and the server's latency histograms in
//! Prometheus' text format, under `kylin:` names modelled on vLLM's (`vllm:num_requests_running`
//! becomes `kylin:num_requests_running`, and so on). The three gauges that load-aware
//! routers read (the Gateway API Inference Extension's endpoint picker, llm-d, vLLM's
//! production stack) are also published under vLLM's own names (`vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`), so those routers work unchanged.
//!
//! Guarantees: observing a latency takes one short lock and allocates nothing; rendering reads
//! a snapshot and never waits for the engine.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kylin_engine::{EngineStats, StopReason};

/// Bucket bounds in seconds (vLLM's time-to-first-token buckets, which also fit the others).
const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const LATENCY_BUCKETS: &[f64] =
    &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), plus one for +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, seconds: f64) {
        let at = self.bounds.partition_point(|&b| b < seconds);
        if let Some(c) = self.counts.get_mut(at) {
            *c += 1;
        }
        self.sum += seconds;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

#[derive(Debug)]
struct Histograms {
    ttft: Histogram,
    itl: Histogram,
    latency: Histogram,
    finished: BTreeMap<&'static str, u64>,
}

/// The server's own measurements; the engine's come with each [`Metrics::render`].
#[derive(Debug)]
pub struct Metrics {
    model_name: String,
    histograms: Mutex<Histograms>,
    rejected_queue_full: AtomicU64,
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        Metrics {
            model_name: model_name.replace(['\\', '"', '\n'], "_"),
            histograms: Mutex::new(Histograms {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                latency: Histogram::new(LATENCY_BUCKETS),
                finished: BTreeMap::new(),
            }),
            rejected_queue_full: AtomicU64::new(0),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Histograms) -> R) -> R {
        match self.histograms.lock() {
            Ok(mut h) => f(&mut h),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }

    pub fn observe_ttft(&self, d: Duration) {
        self.with(|h| h.ttft.observe(d.as_secs_f64()));
    }

    pub fn observe_itl(&self, d: Duration) {
        self.with(|h| h.itl.observe(d.as_secs_f64()));
    }

    pub fn observe_latency(&self, d: Duration) {
        self.with(|h| h.latency.observe(d.as_secs_f64()));
    }

    /// Counts a finished request by its (last choice's) finish reason.
    pub fn count_finished(&self, reason: StopReason) {
        let key = match reason {
            StopReason::Eos | StopReason::StopString => "stop",
            StopReason::Length | StopReason::ContextFull => "length",
            StopReason::Cancelled => "abort",
            StopReason::GrammarFailed => "error",
        };
        self.with(|h| *h.finished.entry(key).or_insert(0) += 1);
    }

    pub fn count_rejected(&self) {
        self.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text page.
    pub fn render(&self, stats: &EngineStats) -> String {
        let labels = format!("model_name=\"{}\"", self.model_name);
        let mut out = String::with_capacity(8192);
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}");
        };
        let router_gauges = [
            ("num_requests_running", "Sequences in the running batch.", stats.running.to_string()),
            (
                "num_requests_waiting",
                "Sequences waiting to be admitted (queued or preempted).",
                stats.waiting.to_string(),
            ),
            (
                "kv_cache_usage_perc",
                "Fraction of KV cache blocks held by live sequences (1 means 100 percent).",
                stats.kv_usage().to_string(),
            ),
        ];
        for prefix in ["kylin", "vllm"] {
            for (name, help, value) in &router_gauges {
                metric(&format!("{prefix}:{name}"), "gauge", help, value.clone());
            }
        }
        metric("kylin:kv_cache_blocks_total", "gauge", "KV cache blocks in all.", stats.kv_blocks_total.to_string());
        metric(
            "kylin:kv_cache_blocks_used",
            "gauge",
            "KV cache blocks held by live sequences.",
            stats.kv_blocks_used.to_string(),
        );
        metric(
            "kylin:kv_cache_blocks_cached",
            "gauge",
            "Free KV cache blocks that still hold a cached prefix.",
            stats.kv_blocks_cached.to_string(),
        );
        metric(
            "kylin:prompt_tokens_total",
            "counter",
            "Prompt tokens admitted (cached ones included).",
            stats.prompt_tokens_total.to_string(),
        );
        metric(
            "kylin:generation_tokens_total",
            "counter",
            "Tokens generated.",
            stats.generation_tokens_total.to_string(),
        );
        metric(
            "kylin:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries.to_string(),
        );
        metric(
            "kylin:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits.to_string(),
        );
        metric("kylin:num_preemptions_total", "counter", "Sequences preempted.", stats.preemptions.to_string());
        metric(
            "kylin:spec_decode_num_draft_tokens_total",
            "counter",
            "Tokens proposed by speculative decoding (--speculative-tokens).",
            stats.speculative_proposed_tokens.to_string(),
        );
        metric(
            "kylin:spec_decode_num_accepted_tokens_total",
            "counter",
            "Proposed tokens accepted by the verification.",
            stats.speculative_accepted_tokens.to_string(),
        );
        metric(
            "kylin:spec_decode_draft_model_computed_tokens_total",
            "counter",
            "Tokens the draft model (--draft-model) computed: catching up on sequences and feeding back its proposals.",
            stats.draft_model_computed_tokens.to_string(),
        );
        metric(
            "kylin:images_encoded_total",
            "counter",
            "Images the vision tower encoded.",
            stats.images_encoded.to_string(),
        );
        metric(
            "kylin:image_encode_seconds_total",
            "counter",
            "Time the vision tower took for them.",
            format!("{:.6}", stats.image_encode_seconds),
        );
        metric(
            "kylin:image_cache_hits_total",
            "counter",
            "Images whose encoding was among the latest ones kept, so not encoded again.",
            stats.image_cache_hits.to_string(),
        );
        metric(
            "kylin:request_rejected_queue_full_total",
            "counter",
            "Requests refused with 429 because the queue was full.",
            self.rejected_queue_full.load(Ordering::Relaxed).to_string(),
        );
        let h = self.with(|h| (h.ttft.clone(), h.itl.clone(), h.latency.clone(), h.finished.clone()));
        let _ = writeln!(
            out,
            "# HELP kylin:request_success_total Requests finished, by finish reason.\n# TYPE kylin:request_success_total counter"
        );
        for reason in ["stop", "length", "abort"] {
            let count = h.3.get(reason).copied().unwrap_or(0);
            let _ = writeln!(out, "kylin:request_success_total{{{labels},finished_reason=\"{reason}\"}} {count}");
        }
        h.0.render(&mut out, "kylin:time_to_first_token_seconds", "Time to first token in seconds.", &labels);
        h.1.render(
            &mut out,
            "kylin:inter_token_latency_seconds",
            "Time between two tokens of a choice in seconds.",
            &labels,
        );
        h.2.render(&mut out, "kylin:e2e_request_latency_seconds", "Request latency in seconds.", &labels);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let m = Metrics::new("m");
        m.observe_ttft(Duration::from_millis(30));
        m.observe_ttft(Duration::from_millis(300));
        let text = m.render(&EngineStats::default());
        assert!(text.contains("kylin:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.04\"} 1"));
        assert!(text.contains("kylin:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.5\"} 2"));
        assert!(text.contains("kylin:time_to_first_token_seconds_count{model_name=\"m\"} 2"));
        assert!(text.contains("kylin:num_requests_running{model_name=\"m\"} 0"));
    }
}
