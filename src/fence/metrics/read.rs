//! The families read back, for the admin's status page: what each mark store operation took
//! (count, mean, and quantiles estimated from the histogram's buckets) and what drains did.
//! Reading collects only the families asked for; the request path never reads them.

use std::collections::BTreeMap;

use prometheus::core::Collector;
use prometheus::proto::Metric;

use super::Metrics;

/// One mark store operation so far: `palisade_store_operation_duration_seconds{store,op}` and
/// `palisade_store_errors_total{store,op}`.
#[derive(Debug, Clone, PartialEq)]
pub struct OpLatency {
    /// The `store` label (`file`, `etcd`, `memory`).
    pub store: String,
    /// The `op` label (`load`, `persist`, `confirm`).
    pub op: String,
    /// Operations timed.
    pub count: u64,
    /// Their total time, in seconds.
    pub sum: f64,
    /// `(upper bound in seconds, operations at most that long)`, bounds ascending; the
    /// implicit `+Inf` bucket is [`OpLatency::count`].
    pub buckets: Vec<(f64, u64)>,
    /// Operations that failed.
    pub errors: u64,
}

impl OpLatency {
    /// The mean time in seconds; `None` before the first operation.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    /// The `q` quantile (`0.0..=1.0`) in seconds, estimated as Prometheus'
    /// `histogram_quantile` does: linearly within the bucket it falls in, and the highest
    /// finite bound when it falls beyond it. `None` before the first operation.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(upper, cumulative) in &self.buckets {
            if cumulative as f64 >= rank && cumulative > below {
                let within = (rank - below as f64) / (cumulative - below) as f64;
                return Some(lower + (upper - lower) * within.max(0.0));
            }
            (lower, below) = (upper, cumulative);
        }
        Some(lower)
    }
}

/// What the drains of one resource (or of one template's entities) did so far:
/// `palisade_drain_duration_seconds`, `palisade_drain_timeouts_total` and
/// `palisade_drain_aborted_requests_total`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrainStats {
    /// Advances that drained (waited for older owners' requests, or found none).
    pub drains: u64,
    /// Their total wait, in seconds.
    pub waited: f64,
    /// Drains that ran out of time.
    pub timeouts: u64,
    /// Requests those aborted.
    pub aborted: u64,
}

impl Metrics {
    /// Every store operation timed so far, by store and operation.
    pub fn store_latencies(&self) -> Vec<OpLatency> {
        let errors: BTreeMap<(String, String), u64> = metrics(&self.store_errors)
            .map(|m| {
                let key = (label(&m, "store").to_owned(), label(&m, "op").to_owned());
                (key, m.get_counter().get_value() as u64)
            })
            .collect();
        let mut out: Vec<OpLatency> = metrics(&self.store_duration)
            .map(|m| {
                let (store, op) = (label(&m, "store").to_owned(), label(&m, "op").to_owned());
                let h = m.get_histogram();
                OpLatency {
                    errors: errors
                        .get(&(store.clone(), op.clone()))
                        .copied()
                        .unwrap_or(0),
                    store,
                    op,
                    count: h.get_sample_count(),
                    sum: h.get_sample_sum(),
                    buckets: h
                        .get_bucket()
                        .iter()
                        .map(|b| (b.upper_bound(), b.cumulative_count()))
                        .collect(),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.store, &a.op).cmp(&(&b.store, &b.op)));
        out
    }

    /// What drains did so far, by `resource` label (a resource, or a template's text for
    /// its entities).
    pub fn drain_stats(&self) -> BTreeMap<String, DrainStats> {
        let mut out: BTreeMap<String, DrainStats> = BTreeMap::new();
        for m in metrics(&self.drain_duration) {
            let s = out.entry(label(&m, "resource").to_owned()).or_default();
            s.drains = m.get_histogram().get_sample_count();
            s.waited = m.get_histogram().get_sample_sum();
        }
        for m in metrics(&self.drain_timeouts) {
            let s = out.entry(label(&m, "resource").to_owned()).or_default();
            s.timeouts = m.get_counter().get_value() as u64;
        }
        for m in metrics(&self.drain_aborted) {
            let s = out.entry(label(&m, "resource").to_owned()).or_default();
            s.aborted = m.get_counter().get_value() as u64;
        }
        out
    }
}

/// The series of one family.
fn metrics(family: &impl Collector) -> impl Iterator<Item = Metric> {
    family
        .collect()
        .into_iter()
        .flat_map(|mut f| f.take_metric())
}

fn label<'m>(m: &'m Metric, name: &str) -> &'m str {
    m.get_label()
        .iter()
        .find(|l| l.name() == name)
        .map_or("", |l| l.value())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_latency_is_read_back_with_quantiles_from_the_buckets() {
        let m = Metrics::new(prometheus::Registry::new()).unwrap();
        let confirm = m.store("etcd", "confirm");
        // 90 fast reads (at most 1 ms), 10 slow ones (between 25 and 50 ms).
        for _ in 0..90 {
            confirm.duration.observe(0.0008);
        }
        for _ in 0..10 {
            confirm.duration.observe(0.03);
        }
        confirm.errors.inc();
        let _unused = m.store("etcd", "persist");
        let got = m.store_latencies();
        assert_eq!(
            got.iter().map(|l| l.op.as_str()).collect::<Vec<_>>(),
            ["confirm", "persist"]
        );
        let c = &got[0];
        assert_eq!((c.store.as_str(), c.count, c.errors), ("etcd", 100, 1));
        assert!((c.mean().unwrap() - 0.00372).abs() < 1e-9, "{:?}", c.mean());
        // The 50th of 100 falls in (0.5 ms, 1 ms], the 99th in (25 ms, 50 ms].
        let p50 = c.quantile(0.5).unwrap();
        assert!((0.0005..=0.001).contains(&p50), "{p50}");
        let p99 = c.quantile(0.99).unwrap();
        assert!((0.025..=0.05).contains(&p99), "{p99}");
        assert_eq!(got[1].quantile(0.5), None, "nothing timed yet");

        // Beyond the last bound: the highest finite one.
        m.store("file", "load").duration.observe(3.0);
        let load = m
            .store_latencies()
            .into_iter()
            .find(|l| l.op == "load")
            .unwrap();
        assert_eq!(load.quantile(0.99), Some(1.0));
    }

    #[test]
    fn drain_stats_are_read_back_by_resource() {
        let m = Metrics::new(prometheus::Registry::new()).unwrap();
        let orders = m.mark("orders");
        orders.drain_duration.observe(0.5);
        orders.drain_duration.observe(1.5);
        orders.drain_timeouts.inc();
        orders.drain_aborted.inc_by(3);
        let _ = m.keyed_mark("warehouse/{id}");
        let got = m.drain_stats();
        assert_eq!(
            got["orders"],
            DrainStats {
                drains: 2,
                waited: 2.0,
                timeouts: 1,
                aborted: 3
            }
        );
        assert_eq!(got["warehouse/{id}"], DrainStats::default());
    }
}
