//! The report's table: the bench's settings, a row per contender (its median run), the server's
//! statements, the CPU, the WAL and the batches of each, the ratios, the ceiling, and the window.

use super::{Report, per_unique};
use crate::bench::{Outcome, Pass, Window};

impl Report<'_> {
    pub(in crate::bench) fn table(&self) {
        let repeated = self.rounds.len() > 1;
        self.print_heading(repeated);
        let (web_runs, median_runs): (Vec<&Outcome>, Vec<&Outcome>) = self
            .names()
            .iter()
            .filter_map(|n| self.median_run(n))
            .partition(|o| o.http.is_some());
        for &o in &median_runs {
            self.print_row(o, repeated);
        }
        println!();
        println!(
            "PG trips/u: Postgres round trips per unique key. L1/L2/PG: the share of claims each \
             tier answered."
        );
        self.print_counts(&median_runs);
        self.print_outbox(&median_runs);
        self.print_web(&web_runs, repeated);
        self.print_ratios(repeated);
        self.print_ceiling(&median_runs);
        if let Some(w) = self.window {
            self.print_window(w);
        }
    }

    /// Prints the window: how it was filled, what it takes on disk, each contender over it beside
    /// itself on an empty window (medians), and what the retention did beside it.
    fn print_window(&self, w: &Window) {
        let f = &w.filled;
        let (per, heap, idx) = w.size.per_record();
        println!();
        println!(
            "The window: {} records in dedup_records after the fill ({} were in the window's \
             scopes, {} of them expired; {} live and {} expired inserted in {:.0} s; VACUUM and \
             CHECKPOINT {:.0} s), {} of them past their retention",
            w.size.records,
            f.found,
            f.found_expired,
            f.inserted_live,
            f.inserted_expired,
            f.fill.as_secs_f64(),
            f.vacuum.as_secs_f64(),
            f.expired
        );
        #[allow(clippy::cast_precision_loss)]
        let mb = |b: u64| b as f64 / 1_048_576.0;
        println!(
            "On disk: {:.0} MB, {per:.0} bytes per record (the heap {heap:.0}, the indexes \
             {idx:.0}: {})",
            mb(w.size.total()),
            w.size
                .indexes
                .iter()
                .map(|(n, b)| format!("{n} {:.0}", per_unique(*b, w.size.records)))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let over = self.pass(Pass::Window);
        let purge = self.pass(Pass::Purge);
        let purging = !purge.rounds.is_empty();
        println!();
        print!(
            "{:<6} {:>12} {:>12} {:>6} {:>10} {:>10} {:>6} {:>9} {:>7}",
            "",
            "empty ev/s",
            "window ev/s",
            "ratio",
            "empty p99",
            "window p99",
            "ratio",
            "WAL B/u",
            "FPI/u"
        );
        if purging {
            print!(
                " {:>12} {:>11} {:>10} {:>9} {:>8} {:>10}",
                "purging ev/s", "purging p99", "p99/window", "drop p99", "/window", "drop evts"
            );
        }
        println!();
        let events = self.args.events;
        let p99 = |r: &Self, n: &str| r.median_run(n).and_then(|o| o.percentile_ms(0.99));
        for name in over.names() {
            let (Some(e), Some(o)) = (self.median_run(name), over.median_run(name)) else {
                continue;
            };
            let (re, ro) = (e.rate(events), o.rate(events));
            let (pe, po) = (p99(self, name), p99(&over, name));
            let ms = |x: Option<f64>| x.map_or("-".to_owned(), |t| format!("{t:.2}"));
            let ratio = |a: Option<f64>, b: Option<f64>| {
                a.zip(b)
                    .map_or("-".to_owned(), |(a, b)| format!("{:.2}", a / b))
            };
            print!(
                "{:<6} {re:>12.0} {ro:>12.0} {:>6.2} {:>10} {:>10} {:>6} {:>9} {:>7}",
                name,
                ro / re,
                ms(pe),
                ms(po),
                ratio(po, pe),
                o.wal.map_or("-".to_owned(), |w| format!(
                    "{:.0}",
                    per_unique(w.0, self.unique)
                )),
                o.wal.and_then(|w| w.1).map_or("-".to_owned(), |f| format!(
                    "{:.3}",
                    per_unique(f, self.unique)
                )),
            );
            if let Some(p) = purge.median_run(name) {
                let pp = p.percentile_ms(0.99);
                let dropping = p.dropping_ms(0.99);
                print!(
                    " {:>12.0} {:>11} {:>10} {:>9} {:>8} {:>10}",
                    p.rate(events),
                    ms(pp),
                    ratio(pp, po),
                    ms(dropping.map(|d| d.0)),
                    ratio(dropping.map(|d| d.0), po),
                    dropping.map_or("-".to_owned(), |d| d.1.to_string()),
                );
            }
            println!();
        }
        println!(
            "ratio: over the window / on an empty one (events/s), and the window's p99 / the empty \
             one's; WAL B/u, FPI/u: over the window, per unique key (pg_stat_wal)"
        );
        if purging {
            println!(
                "purging: the run with the retention beside it (p99/window: its p99 / the window's); \
                 drop p99: the p99 of the events that overlapped the drop of the ranges of days, \
                 from its start until its files were cleared (drop evts of them), / the window's p99"
            );
        }
        for (i, p) in w.purges.iter().enumerate() {
            #[allow(clippy::cast_precision_loss)]
            let rate = p.records as f64 / p.elapsed.as_secs_f64().max(1e-9);
            let ranges = if p.dropped.is_empty() {
                String::new()
            } else {
                format!(
                    "ranges of days dropped whole: {} ({} records moved), in {:.1} s; then ",
                    p.dropped.join(", "),
                    p.moved,
                    p.ranges.as_secs_f64()
                )
            };
            println!(
                "retention {}: {ranges}{} records in {} statements of up to {} ({} ms apart) in \
                 {:.1} s ({rate:.0}/s), other sessions waiting on its locks for {:.2} s; the \
                 VACUUM after it {:.1} s{}",
                i + 1,
                p.records,
                p.statements,
                self.args.purge_batch,
                self.args.purge_pause_ms,
                p.elapsed.as_secs_f64(),
                p.blocked.as_secs_f64(),
                p.vacuum.as_secs_f64(),
                p.error
                    .as_ref()
                    .map_or(String::new(), |e| format!(" (stopped: {e})"))
            );
        }
    }

    /// Prints the bench's settings and the table's column names.
    fn print_heading(&self, repeated: bool) {
        let a = self.args;
        println!(
            "dedup bench: {} events, {} unique {} keys ({:.0}% duplicates, Zipf s={}), \
             concurrency {} and {} Postgres connections for every contender",
            a.events,
            self.unique,
            a.keys.name(),
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
        if repeated {
            println!(
                "{} runs of every contender, interleaved: each row is the contender's median run; \
                 min-max and the slowest run beside the median are over every run",
                self.rounds.len()
            );
        }
        println!();
        print!(
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
        if repeated {
            print!(" {:>17} {:>8}", "min-max events/s", "slowest");
        }
        println!();
    }

    /// Prints the table's row for the median run `o` (with `repeated`, the spread of every run).
    fn print_row(&self, o: &Outcome, repeated: bool) {
        let a = self.args;
        let (l1, l2, auth) = o.tier_shares();
        print!(
            "{:<4} {:<42} {:>10.0} {:>8} {:>8} {:>11} {:>5.1}% {:>5.1}% {:>5.1}% {:>8} {:>7}",
            o.name,
            o.label,
            o.rate(a.events),
            o.percentile_ms(0.5)
                .map_or("-".to_owned(), |t| format!("{t:.2}")),
            o.percentile_ms(0.99)
                .map_or("-".to_owned(), |t| format!("{t:.2}")),
            o.trips_per_unique(self.unique)
                .map_or("-".to_owned(), |t| format!("{t:.3}")),
            l1 * 100.0,
            l2 * 100.0,
            auth * 100.0,
            o.effects,
            if o.durable { "yes" } else { "no" },
        );
        if let Some((min, max)) = self.spread_of(o.name).filter(|_| repeated) {
            let median = o.rate(a.events);
            print!(
                " {:>17} {:>+7.1}%",
                format!("{min:.0}-{max:.0}"),
                (min / median - 1.0) * 100.0
            );
        }
        println!();
    }

    /// Prints the server's statements, the CPU and the batch calls of each median run.
    fn print_counts(&self, median_runs: &[&Outcome]) {
        let a = self.args;
        for &o in median_runs {
            if let Some((engine, handler, complete)) = self.statements_per_unique(o) {
                println!(
                    "{}: {engine:.3} engine and {handler:.3} handler statements per unique key, counted by the server (pg_stat_statements; BEGIN and COMMIT included){}",
                    o.name,
                    if complete {
                        ""
                    } else {
                        "; at least: it evicted entries meanwhile (pg_stat_statements.max)"
                    }
                );
            }
        }
        for &o in median_runs {
            if let Some(c) = o.cpu {
                let (own, others) = c.ms_per_1k(a.events);
                let (busy, iowait, steal) = c.shares();
                println!(
                    "{}: CPU per 1,000 events: {own:.1} ms in the bench, {others:.1} ms elsewhere \
                     (Postgres, Redis); the machine {:.0}% busy, {:.0}% waiting on I/O, {:.0}% stolen",
                    o.name,
                    busy * 100.0,
                    iowait * 100.0,
                    steal * 100.0
                );
            }
        }
        for &o in median_runs {
            let wal = o.wal.map(|(bytes, fpi)| {
                format!(
                    "the server wrote {:.0} bytes of WAL{} per unique key",
                    per_unique(bytes, self.unique),
                    fpi.map_or(String::new(), |f| format!(
                        " and {:.3} full-page images",
                        per_unique(f, self.unique)
                    ))
                )
            });
            let row = o
                .row_bytes
                .map(|b| format!("a record takes {b:.0} bytes in the heap (pg_column_size)"));
            let both: Vec<String> = wal.into_iter().chain(row).collect();
            if !both.is_empty() {
                println!("{}: {}", o.name, both.join("; "));
            }
        }
        for &o in median_runs {
            if let Some(b) = o.batches {
                println!(
                    "{}: {} claims in {} batch calls, {} completions in {} batch calls (L1 hits \
                     bypass the batches)",
                    o.name, b.claims, b.claim_calls, b.completions, b.completion_calls
                );
            }
        }
    }

    /// Prints the HTTP contenders' table: requests/s, latency, the server's statements and
    /// commits per request, how requests were answered, the effects, and whose CPU they cost.
    fn print_web(&self, runs: &[&Outcome], repeated: bool) {
        if runs.is_empty() {
            return;
        }
        let events = self.args.events;
        println!();
        print!(
            "{:<6} {:<42} {:>8} {:>7} {:>7} {:>6} {:>7} {:>7} {:>7} {:>6} {:>8} {:>27}",
            "HTTP",
            "route",
            "req/s",
            "p50 ms",
            "p99 ms",
            "stm/r",
            "commit/r",
            "fresh",
            "replay",
            "409",
            "effects",
            "CPU ms/1k srv,cli,PG,Redis"
        );
        if repeated {
            print!(" {:>15}", "min-max req/s");
        }
        println!();
        for o in runs {
            let Some(h) = &o.http else { continue };
            #[allow(clippy::cast_precision_loss)]
            let per = |n: u64| format!("{:.2}", n as f64 / events.max(1) as f64);
            let ms = |x: Option<f64>| x.map_or("-".to_owned(), |t| format!("{t:.2}"));
            print!(
                "{:<6} {:<42} {:>8.0} {:>7} {:>7} {:>6} {:>7} {:>7} {:>7} {:>6} {:>8} {:>27}",
                o.name,
                o.label,
                o.rate(events),
                ms(o.percentile_ms(0.5)),
                ms(o.percentile_ms(0.99)),
                o.server_statements.map_or("-".to_owned(), |s| per(s.0)),
                h.commits.map_or("-".to_owned(), per),
                h.fresh,
                h.replayed,
                h.conflicts,
                format!("{}/{}", o.effects, h.expected_effects),
                h.cpu.map_or("-".to_owned(), |c| format!(
                    "{:.0},{:.0},{:.0},{:.0}",
                    c.server_ms, c.client_ms, c.postgres_ms, c.redis_ms
                )),
            );
            if let Some((min, max)) = self.spread_of(o.name).filter(|_| repeated) {
                print!(" {:>15}", format!("{min:.0}-{max:.0}"));
            }
            println!();
        }
        for o in runs {
            if let Some(p) = o.http.as_ref().and_then(|h| h.paced.as_ref()) {
                let ms = |x: Option<f64>| x.map_or("-".to_owned(), |t| format!("{t:.2}"));
                println!(
                    "{}: paced at {:.0} requests/s ({:.0} reached, {} errors): p50 {} ms, p99 {} \
                     ms from each request's scheduled start",
                    o.name,
                    p.asked,
                    p.reached,
                    p.errors,
                    ms(p.p50_ms),
                    ms(p.p99_ms)
                );
                if repeated && let Some((median, min, max, n)) = self.paced_p99_of(o.name) {
                    println!(
                        "{}: paced p99 over its {n} runs: median {median:.2} ms, min-max \
                         {min:.2}-{max:.2} ms",
                        o.name
                    );
                }
            }
        }
        if let Some((median, min, max, n)) = self.paced_gap("(h2)", "(h0)") {
            println!(
                "(h2)'s paced p99 - (h0)'s, run by run: median {median:+.2} ms, min-max \
                 {min:+.2} to {max:+.2} ms over {n} run(s)"
            );
        }
        println!(
            "stm/r, commit/r: statements and writing transactions per request, counted by the \
             server (pg_stat_statements; transaction ids assigned); fresh/replay/409: how requests were \
             answered; effects: rows written / due (one per request for h0, per unique key for \
             h0x, h1, h2, h2l; none for h3's retries); CPU: the server's threads, the client (the rest \
             of the bench), Postgres, Redis"
        );
    }

    /// Prints the ratios of medians (with `repeated`, their range run by run).
    /// Prints (g)'s own figures: the relay alone, and the paced write-to-ack lag.
    fn print_outbox(&self, median_runs: &[&Outcome]) {
        for o in median_runs {
            if let Some(g) = &o.outbox {
                println!(
                    "{}: the relay alone published {} prefilled messages at {:.0}/s; paced at {:.0} \
                     events/s, write-to-ack p50 {} ms, p99 {} ms",
                    o.name, g.prefilled, g.relay_rate, g.paced_rate, g.lag_p50_ms, g.lag_p99_ms
                );
            }
        }
    }

    fn print_ratios(&self, repeated: bool) {
        for (_, x, y) in Self::RATIOS {
            if let (Some(r), Some(rx), Some(ry)) =
                (self.ratio(x, y), self.rate_of(x), self.rate_of(y))
            {
                let per_run = self.run_ratios(x, y);
                let spread = match (
                    per_run.iter().copied().reduce(f64::min),
                    per_run.iter().copied().reduce(f64::max),
                ) {
                    (Some(lo), Some(hi)) if repeated => {
                        format!("; run by run {lo:.2}x to {hi:.2}x")
                    }
                    _ => String::new(),
                };
                println!("{x}/{y} = {r:.2}x   ({rx:.0} / {ry:.0} events/s{spread})");
            }
        }
    }

    /// Prints the ceiling, each durable median run's share of it, and the claim statement's rate.
    fn print_ceiling(&self, median_runs: &[&Outcome]) {
        if let Some(c) = self.ceiling() {
            println!();
            println!(
                "ceiling: {c:.0} rows/s (500-row INSERTs into a copy of dedup_records, 2 clients)"
            );
            for &o in median_runs {
                if let Some(share) = self.ceiling_share_of(o, Some(c)) {
                    println!(
                        "{:<5} {:>8.0} unique keys/s = {:.3} of the ceiling",
                        o.name,
                        self.unique_rate(o),
                        share
                    );
                }
            }
        }
        if let Some(c) = self.claims() {
            println!(
                "claims: {c:.0} rows/s (500-key claim statements on new keys, 2 clients){}",
                self.claim_cost().map_or(String::new(), |x| format!(
                    "; the ceiling's rate is {x:.2}x this (a claim's cost beside a plain INSERT)"
                ))
            );
        }
    }
}
