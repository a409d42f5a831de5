//! The bench's table and JSON.

use super::{BenchArgs, Outcome};

pub(super) struct Report<'a> {
    pub(super) args: &'a BenchArgs,
    pub(super) unique: u64,
    pub(super) sync: &'a str,
    pub(super) outcomes: &'a [Outcome],
    /// The ceiling's rows per second, when it was measured.
    pub(super) ceiling: Option<f64>,
    /// The claim statement's claims per second on new keys, when it was measured.
    pub(super) claims: Option<f64>,
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

    /// The unique keys per second a contender recorded.
    fn unique_rate(&self, o: &Outcome) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let n = self.unique as f64;
        n / o.elapsed.as_secs_f64().max(1e-9)
    }

    /// A durable contender's unique keys per second over the ceiling's rows per second.
    fn ceiling_share_of(&self, o: &Outcome) -> Option<f64> {
        (o.durable && o.effects == self.unique)
            .then(|| self.ceiling.map(|c| self.unique_rate(o) / c))
            .flatten()
    }

    /// The best durable contender's share of the ceiling.
    fn ceiling_share(&self) -> Option<f64> {
        self.outcomes
            .iter()
            .filter_map(|o| self.ceiling_share_of(o))
            .reduce(f64::max)
    }

    /// The ratios the targets are stated in, with the contenders' absolute rates.
    const RATIOS: [(&'static str, &'static str, &'static str); 8] = [
        ("d/a", "(d)", "(a)"),
        ("d/b", "(d)", "(b)"),
        ("f/a", "(f)", "(a)"),
        ("f/b", "(f)", "(b)"),
        ("c/a", "(c)", "(a)"),
        ("e/a", "(e)", "(a)"),
        ("e'/a'", "(e')", "(a')"),
        ("e'/b'", "(e')", "(b')"),
    ];

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
            if let Some((engine, handler)) = self.statements_per_unique(o) {
                println!(
                    "{}: {engine:.3} engine and {handler:.3} handler statements per unique key, counted by the server (pg_stat_statements; BEGIN and COMMIT included)",
                    o.name
                );
            }
        }
        for o in self.outcomes {
            if let Some((calls, claims, ccalls, completions)) = o.batches {
                println!(
                    "{}: {claims} claims in {calls} batch calls, {completions} completions in \
                     {ccalls} batch calls (L1 hits bypass the batches)",
                    o.name
                );
            }
        }
        for (_, x, y) in Self::RATIOS {
            if let (Some(r), Some(rx), Some(ry)) =
                (self.ratio(x, y), self.rate_of(x), self.rate_of(y))
            {
                println!("{x}/{y} = {r:.2}x   ({rx:.0} / {ry:.0} events/s)");
            }
        }
        if let Some(c) = self.ceiling {
            println!();
            println!(
                "ceiling: {c:.0} rows/s (500-row INSERTs into a copy of dedup_records, 2 clients)"
            );
            for o in self.outcomes {
                if let Some(share) = self.ceiling_share_of(o) {
                    println!(
                        "{:<5} {:>8.0} unique keys/s = {:.3} of the ceiling",
                        o.name,
                        self.unique_rate(o),
                        share
                    );
                }
            }
        }
        if let Some(c) = self.claims {
            println!(
                "claims: {c:.0} rows/s (500-key claim statements on new keys, 2 clients){}",
                self.claim_cost().map_or(String::new(), |x| format!(
                    "; the ceiling's rate is {x:.2}x this (a claim's cost beside a plain INSERT)"
                ))
            );
        }
    }

    /// Statements the server ran per unique key while `o` ran: the engine's (everything but the
    /// handler's ledger writes), and the handler's.
    fn statements_per_unique(&self, o: &Outcome) -> Option<(f64, f64)> {
        let (all, handler) = o.server_statements?;
        #[allow(clippy::cast_precision_loss)]
        let per = |n: u64| n as f64 / self.unique.max(1) as f64;
        Some((per(all.saturating_sub(handler)), per(handler)))
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
                    "server_statements_per_unique_key": self.statements_per_unique(o).map(|(engine, handler)| serde_json::json!({
                        "engine": engine, "handler": handler,
                    })),
                    "hit_ratio": {"l1": l1, "l2": l2, "postgres": auth},
                    "effects": o.effects,
                    "errors": o.errors,
                    "elapsed_s": o.elapsed.as_secs_f64(),
                    "unique_keys_per_s": self.unique_rate(o),
                    "ceiling_share": self.ceiling_share_of(o),
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
            "ceiling_rows_per_s": self.ceiling,
            "claim_rows_per_s": self.claims,
            "claim_cost_over_insert": self.claim_cost(),
            "ratios": self.ratios_json(),
        })
    }

    /// What a claim costs beside a plain INSERT of the same rows: the ceiling's rate over the
    /// claim statement's.
    fn claim_cost(&self) -> Option<f64> {
        Some(self.ceiling? / self.claims?)
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
