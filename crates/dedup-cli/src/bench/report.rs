//! The bench's table and JSON.

use super::{BenchArgs, Outcome};

pub(super) struct Report<'a> {
    pub(super) args: &'a BenchArgs,
    pub(super) unique: u64,
    pub(super) sync: &'a str,
    pub(super) outcomes: &'a [Outcome],
}

impl Report<'_> {
    fn rate_of(&self, name: &str) -> Option<f64> {
        self.outcomes
            .iter()
            .find(|o| o.name == name)
            .map(|o| o.rate(self.args.events))
    }

    fn ratio(&self, a: &str, b: &str) -> Option<f64> {
        Some(self.rate_of(a)? / self.rate_of(b)?)
    }

    pub(super) fn table(&self) {
        let a = self.args;
        println!(
            "dedup bench: {} events, {} unique keys ({:.0}% duplicates, Zipf s={}), \
             concurrency {} and {} Postgres connections for every contender",
            a.events,
            self.unique,
            a.duplicates * 100.0,
            a.zipf,
            a.concurrency,
            a.pg_connections
        );
        println!(
            "Postgres synchronous_commit={} (durable commits: {}); Redis and Postgres on this host",
            self.sync,
            if self.sync == "off" { "NO" } else { "yes" }
        );
        println!();
        println!(
            "{:<4} {:<42} {:>10} {:>8} {:>8} {:>11} {:>6} {:>6} {:>6} {:>8} {:>7}",
            "",
            "contender",
            "events/s",
            "p50 ms",
            "p99 ms",
            "PG trips/u",
            "L1",
            "L2",
            "PG",
            "effects",
            "durable"
        );
        for o in self.outcomes {
            let (l1, l2, auth) = o.tier_shares();
            println!(
                "{:<4} {:<42} {:>10.0} {:>8.2} {:>8.2} {:>11} {:>5.1}% {:>5.1}% {:>5.1}% {:>8} {:>7}",
                o.name,
                o.label,
                o.rate(a.events),
                o.percentile_ms(0.5),
                o.percentile_ms(0.99),
                o.trips_per_unique(self.unique)
                    .map_or("-".to_owned(), |t| format!("{t:.3}")),
                l1 * 100.0,
                l2 * 100.0,
                auth * 100.0,
                o.effects,
                if o.durable { "yes" } else { "no" },
            );
        }
        println!();
        println!(
            "PG trips/u: Postgres round trips per unique key. L1/L2/PG: the share of claims each \
             tier answered."
        );
        for o in self.outcomes {
            if let Some((calls, claims, ccalls, completions)) = o.batches {
                println!(
                    "{}: {claims} claims in {calls} batch calls, {completions} completions in \
                     {ccalls} batch calls (L1 hits bypass the batches)",
                    o.name
                );
            }
        }
        for (x, y) in [("(d)", "(a)"), ("(d)", "(b)"), ("(c)", "(a)")] {
            if let Some(r) = self.ratio(x, y) {
                println!("{x}/{y} = {r:.2}x");
            }
        }
    }

    pub(super) fn json(&self) -> serde_json::Value {
        let a = self.args;
        let contenders: Vec<serde_json::Value> = self
            .outcomes
            .iter()
            .map(|o| {
                let (l1, l2, auth) = o.tier_shares();
                serde_json::json!({
                    "name": o.name,
                    "label": o.label,
                    "durable": o.durable,
                    "events_per_s": o.rate(a.events),
                    "p50_ms": o.percentile_ms(0.5),
                    "p99_ms": o.percentile_ms(0.99),
                    "pg_round_trips_per_unique_key": o.trips_per_unique(self.unique),
                    "hit_ratio": {"l1": l1, "l2": l2, "postgres": auth},
                    "effects": o.effects,
                    "errors": o.errors,
                    "elapsed_s": o.elapsed.as_secs_f64(),
                    "batches": o.batches.map(|(calls, claims, ccalls, completions)| serde_json::json!({
                        "claim_calls": calls, "claims": claims,
                        "completion_calls": ccalls, "completions": completions,
                    })),
                })
            })
            .collect();
        serde_json::json!({
            "events": a.events,
            "unique_keys": self.unique,
            "duplicates": a.duplicates,
            "zipf": a.zipf,
            "concurrency": a.concurrency,
            "pg_connections": a.pg_connections,
            "synchronous_commit": self.sync,
            "contenders": contenders,
            "ratios": {
                "d_over_a": self.ratio("(d)", "(a)"),
                "d_over_b": self.ratio("(d)", "(b)"),
            },
        })
    }
}
