//! The report as JSON: each contender's median run with every run's rate, the ratios of medians,
//! every run of every contender, and the window.

use super::{Report, per_unique};
use crate::bench::{Outcome, Pass};

impl Report<'_> {
    /// The window as JSON, where the bench had one.
    fn window_json(&self) -> serde_json::Value {
        let Some(w) = self.window else {
            return serde_json::Value::Null;
        };
        let f = &w.filled;
        serde_json::json!({
            "prefill": self.args.prefill,
            "expired": self.args.expired,
            "found": f.found,
            "found_expired": f.found_expired,
            "inserted_live": f.inserted_live,
            "inserted_expired": f.inserted_expired,
            "past_retention_after_fill": f.expired,
            "fill_s": f.fill.as_secs_f64(),
            "vacuum_checkpoint_s": f.vacuum.as_secs_f64(),
            "size": w.size.json(),
            "over_window": self.pass(Pass::Window).json(),
            "over_window_purging": self.args.purge_during.then(|| self.pass(Pass::Purge).json()),
            "retention_runs": w.purges.iter().map(crate::bench::window::Purged::json).collect::<Vec<_>>(),
        })
    }

    /// One run of a contender, as JSON (its share of `ceiling`, the ceiling of the same run or
    /// the median one).
    fn outcome_json(&self, o: &Outcome, ceiling: Option<f64>) -> serde_json::Value {
        let (l1, l2, auth) = o.tier_shares();
        serde_json::json!({
            "name": o.name,
            "label": o.label,
            "durable": o.durable,
            "events_per_s": o.rate(self.args.events),
            "p50_ms": o.percentile_ms(0.5),
            "p99_ms": o.percentile_ms(0.99),
            "during_range_drop": o.dropping_ms(0.99).map(|(ms, n)| serde_json::json!({
                "p99_ms": ms,
                "events": n,
            })),
            "pg_round_trips_per_unique_key": o.trips_per_unique(self.unique),
            "server_statements_per_unique_key": self.statements_per_unique(o).map(|(engine, handler, complete)| serde_json::json!({
                "engine": engine, "handler": handler, "complete": complete,
            })),
            "hit_ratio": {"l1": l1, "l2": l2, "postgres": auth},
            "effects": o.effects,
            "errors": o.errors,
            "elapsed_s": o.elapsed.as_secs_f64(),
            "unique_keys_per_s": self.unique_rate(o),
            "ceiling_share": self.ceiling_share_of(o, ceiling),
            "batches": o.batches.map(|b| serde_json::json!({
                "claim_calls": b.claim_calls, "claims": b.claims,
                "completion_calls": b.completion_calls, "completions": b.completions,
            })),
            "cpu": o.cpu.map(|c| c.json(self.args.events)),
            "wal_bytes_per_unique_key": o.wal.map(|w| per_unique(w.0, self.unique)),
            "wal_fpi_per_unique_key": o.wal.and_then(|w| w.1).map(|f| per_unique(f, self.unique)),
            "row_bytes": o.row_bytes,
            "expected_effects": o.expected_effects(self.unique),
            "outbox": o.outbox.as_ref().map(|g| serde_json::json!({
                "relay_alone_per_s": g.relay_rate, "prefilled": g.prefilled,
                "paced_per_s": g.paced_rate, "lag_p50_ms": g.lag_p50_ms,
                "lag_p99_ms": g.lag_p99_ms,
            })),
            "http": o.http.as_ref().map(|h| serde_json::json!({
                "fresh": h.fresh,
                "replayed": h.replayed,
                "conflicts": h.conflicts,
                "statements_per_request": o.server_statements.map(|s| per_unique(s.0, self.args.events)),
                "commits_per_request": h.commits.map(|c| per_unique(c, self.args.events)),
                "paced": h.paced.as_ref().map(|p| serde_json::json!({
                    "asked_per_s": p.asked, "reached_per_s": p.reached,
                    "p50_ms": p.p50_ms, "p99_ms": p.p99_ms, "errors": p.errors,
                })),
                "cpu_ms_per_1k_requests": h.cpu.map(|c| serde_json::json!({
                    "server": c.server_ms, "client": c.client_ms,
                    "postgres": c.postgres_ms, "redis": c.redis_ms,
                })),
            })),
        })
    }

    /// The report as JSON: `contenders` holds each contender's median run (with `runs_events_per_s`,
    /// every run's rate in run order, and their min and max), `ratios` the ratios of medians, and
    /// `runs` every run of every contender.
    pub(in crate::bench) fn json(&self) -> serde_json::Value {
        let a = self.args;
        let ceiling = self.ceiling();
        let contenders: Vec<serde_json::Value> = self
            .names()
            .iter()
            .filter_map(|n| self.median_run(n))
            .map(|o| {
                let mut v = self.outcome_json(o, ceiling);
                let rates: Vec<f64> = self
                    .runs_of(o.name)
                    .iter()
                    .map(|r| r.rate(a.events))
                    .collect();
                let (min, max) = self.spread_of(o.name).unwrap_or_default();
                if let Some(m) = v.as_object_mut() {
                    m.insert("runs_events_per_s".to_owned(), serde_json::json!(rates));
                    m.insert("min_events_per_s".to_owned(), serde_json::json!(min));
                    m.insert("max_events_per_s".to_owned(), serde_json::json!(max));
                }
                v
            })
            .collect();
        let runs: Vec<serde_json::Value> = self
            .rounds
            .iter()
            .enumerate()
            .map(|(i, r)| {
                serde_json::json!({
                    "run": i + 1,
                    "run_id": r.run_id,
                    "contenders": r.outcomes.iter().map(|o| self.outcome_json(o, r.ceiling)).collect::<Vec<_>>(),
                    "ceiling_rows_per_s": r.ceiling,
                    "claim_rows_per_s": r.claims,
                })
            })
            .collect();
        serde_json::json!({
            "events": a.events,
            "unique_keys": self.unique,
            "keys": a.keys.name(),
            "duplicates": a.duplicates,
            "zipf": a.zipf,
            "concurrency": a.concurrency,
            "pg_connections": a.pg_connections,
            "synchronous_commit": self.sync,
            "repeat": self.rounds.len(),
            "contenders": contenders,
            "ceiling_rows_per_s": ceiling,
            "claim_rows_per_s": self.claims(),
            "claim_cost_over_insert": self.claim_cost(),
            "ratios": self.ratios_json(),
            "runs": runs,
            "window": self.window_json(),
        })
    }

    fn ratios_json(&self) -> serde_json::Value {
        let mut ratios = serde_json::Map::new();
        for (key, x, y) in Self::RATIOS {
            ratios.insert(key.to_owned(), serde_json::json!(self.ratio(x, y)));
        }
        ratios.insert(
            "ceiling_share".to_owned(),
            serde_json::json!(self.ceiling_share()),
        );
        // The names of earlier releases.
        ratios.insert(
            "d_over_a".to_owned(),
            serde_json::json!(self.ratio("(d)", "(a)")),
        );
        ratios.insert(
            "d_over_b".to_owned(),
            serde_json::json!(self.ratio("(d)", "(b)")),
        );
        serde_json::Value::Object(ratios)
    }
}
