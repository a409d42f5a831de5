//! The bench's table and JSON: events/s, p50/p99, Postgres round trips per unique key, tier
//! shares, effects checked against the unique keys, the ratios with their absolute rates, and
//! each durable contender's share of the ceiling. With `--repeat N` every figure of the table is
//! a contender's median run's (the run whose rate is the median: the middle one of N, the upper
//! middle of an even N), its rate shown with the min-max of every run; ratios are ratios of
//! medians. The JSON carries every run as well.
//!
//! Here the report's runs and the figures derived from them (medians, spreads, ratios, shares of
//! the ceiling); `table.rs` prints the table, `json.rs` builds the JSON.

use super::{BenchArgs, Outcome, Pass, Round, Window};

mod json;
mod table;

pub(super) struct Report<'a> {
    args: &'a BenchArgs,
    unique: u64,
    sync: &'a str,
    /// The runs of one pass (the runs on an empty window, in the report a bench prints).
    rounds: Vec<&'a Round>,
    /// Every run of every pass.
    all: &'a [Round],
    window: Option<&'a Window>,
}

/// `n` per unique key.
fn per_unique(n: u64, unique: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let per = n as f64 / unique.max(1) as f64;
    per
}

/// The median of `xs` (the upper middle of an even count); `None` when empty.
fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied()
}

/// The median, min, max and count of `xs`; `None` when empty.
fn spread(xs: Vec<f64>) -> Option<(f64, f64, f64, usize)> {
    let min = xs.iter().copied().reduce(f64::min)?;
    let max = xs.iter().copied().reduce(f64::max)?;
    let n = xs.len();
    Some((median(xs)?, min, max, n))
}

impl<'a> Report<'a> {
    /// The report of a bench: its runs on an empty window, and the window's if it had one.
    pub(super) fn new(
        args: &'a BenchArgs,
        unique: u64,
        sync: &'a str,
        all: &'a [Round],
        window: Option<&'a Window>,
    ) -> Self {
        let mut report = Self {
            args,
            unique,
            sync,
            rounds: Vec::new(),
            all,
            window,
        };
        report.rounds = report.pass(Pass::Empty).rounds;
        report
    }

    /// The same bench's runs of `pass` alone.
    fn pass(&self, pass: Pass) -> Self {
        Self {
            rounds: self.all.iter().filter(|r| r.pass == pass).collect(),
            window: None,
            ..*self
        }
    }

    /// The contenders that ran, in the order they ran.
    fn names(&self) -> Vec<&'static str> {
        self.rounds
            .first()
            .map(|r| r.outcomes.iter().map(|o| o.name).collect())
            .unwrap_or_default()
    }

    /// Every run of contender `name`, in run order.
    fn runs_of(&self, name: &str) -> Vec<&Outcome> {
        self.rounds
            .iter()
            .filter_map(|r| r.outcomes.iter().find(|o| o.name == name))
            .collect()
    }

    /// The run of `name` whose rate is the median.
    fn median_run(&self, name: &str) -> Option<&Outcome> {
        let mut runs = self.runs_of(name);
        let events = self.args.events;
        runs.sort_by(|x, y| x.rate(events).total_cmp(&y.rate(events)));
        runs.get(runs.len() / 2).copied()
    }

    /// The slowest and the fastest run's rate of `name`.
    fn spread_of(&self, name: &str) -> Option<(f64, f64)> {
        let rates: Vec<f64> = self
            .runs_of(name)
            .iter()
            .map(|o| o.rate(self.args.events))
            .collect();
        let min = rates.iter().copied().reduce(f64::min)?;
        let max = rates.iter().copied().reduce(f64::max)?;
        Some((min, max))
    }

    /// The median rate of `name`.
    fn rate_of(&self, name: &str) -> Option<f64> {
        self.median_run(name).map(|o| o.rate(self.args.events))
    }

    /// The ratio of the medians of `a` and `b`.
    fn ratio(&self, a: &str, b: &str) -> Option<f64> {
        Some(self.rate_of(a)? / self.rate_of(b)?)
    }

    /// The ratio of `a`'s and `b`'s rates in each run where both ran.
    fn run_ratios(&self, a: &str, b: &str) -> Vec<f64> {
        let events = self.args.events;
        self.rounds
            .iter()
            .filter_map(|r| {
                let x = r.outcomes.iter().find(|o| o.name == a)?.rate(events);
                let y = r.outcomes.iter().find(|o| o.name == b)?.rate(events);
                Some(x / y)
            })
            .collect()
    }

    /// The paced p99 of every run of `name` that has one: its median, min, max and count.
    fn paced_p99_of(&self, name: &str) -> Option<(f64, f64, f64, usize)> {
        let p99s: Vec<f64> = self
            .runs_of(name)
            .iter()
            .filter_map(|o| o.http.as_ref()?.paced.as_ref()?.p99_ms)
            .collect();
        spread(p99s)
    }

    /// `a`'s paced p99 less `b`'s, in each run where both were paced: the median of those
    /// differences, their min, max and count.
    fn paced_gap(&self, a: &str, b: &str) -> Option<(f64, f64, f64, usize)> {
        let p99 = |r: &Round, name: &str| {
            let o = r.outcomes.iter().find(|o| o.name == name)?;
            o.http.as_ref()?.paced.as_ref()?.p99_ms
        };
        let gaps: Vec<f64> = self
            .rounds
            .iter()
            .filter_map(|r| Some(p99(r, a)? - p99(r, b)?))
            .collect();
        spread(gaps)
    }

    /// The median of the ceiling's runs.
    fn ceiling(&self) -> Option<f64> {
        median(self.rounds.iter().filter_map(|r| r.ceiling).collect())
    }

    /// The median of the claim statement's runs.
    fn claims(&self) -> Option<f64> {
        median(self.rounds.iter().filter_map(|r| r.claims).collect())
    }

    /// The unique keys per second a contender recorded.
    fn unique_rate(&self, o: &Outcome) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let n = self.unique as f64;
        n / o.elapsed.as_secs_f64().max(1e-9)
    }

    /// A durable contender's unique keys per second over the ceiling's rows per second.
    fn ceiling_share_of(&self, o: &Outcome, ceiling: Option<f64>) -> Option<f64> {
        (o.durable && o.effects == self.unique)
            .then(|| ceiling.map(|c| self.unique_rate(o) / c))
            .flatten()
    }

    /// The best durable contender's share of the ceiling, by medians.
    fn ceiling_share(&self) -> Option<f64> {
        self.names()
            .iter()
            .filter_map(|n| self.median_run(n))
            .filter_map(|o| self.ceiling_share_of(o, self.ceiling()))
            .reduce(f64::max)
    }

    /// The ratios the speed targets are stated in, with the contenders' absolute rates.
    const RATIOS: [(&'static str, &'static str, &'static str); 17] = [
        ("d/a", "(d)", "(a)"),
        ("d/b", "(d)", "(b)"),
        ("f/a", "(f)", "(a)"),
        ("f/b", "(f)", "(b)"),
        ("c/a", "(c)", "(a)"),
        ("e/a", "(e)", "(a)"),
        ("e'/a'", "(e')", "(a')"),
        ("e'/b'", "(e')", "(b')"),
        ("ek/e", "(ek)", "(e)"),
        ("g/e", "(g)", "(e)"),
        ("fk/f", "(fk)", "(f)"),
        ("h2/h0", "(h2)", "(h0)"),
        ("h2/h0x", "(h2)", "(h0x)"),
        ("h2/h2l", "(h2)", "(h2l)"),
        ("h1/h0", "(h1)", "(h0)"),
        ("h3/h0", "(h3)", "(h0)"),
        ("h3r/h0", "(h3r)", "(h0)"),
    ];

    /// Statements the server ran per unique key while `o` ran: the engine's (everything but the
    /// handler's ledger writes), and the handler's.
    fn statements_per_unique(&self, o: &Outcome) -> Option<(f64, f64, bool)> {
        let (all, handler, complete) = o.server_statements?;
        #[allow(clippy::cast_precision_loss)]
        let per = |n: u64| n as f64 / self.unique.max(1) as f64;
        Some((per(all.saturating_sub(handler)), per(handler), complete))
    }

    /// What a claim costs beside a plain INSERT of the same rows: the ceiling's rate over the
    /// claim statement's.
    fn claim_cost(&self) -> Option<f64> {
        Some(self.ceiling()? / self.claims()?)
    }
}
