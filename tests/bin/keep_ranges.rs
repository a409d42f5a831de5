//! Keeps the ranges of days of the partitioned table (`dedup_pg::maintain_ranges`) as the days
//! go by, one call a day, one-day ranges made a day ahead and dropped as soon as they end: the
//! SIGKILL test kills it anywhere in that. Usage: `dedup-keep-ranges <database-url> <t0-ms>
//! <days>`: calls for `t0 + d` days, d from 0 to `days`, printing `day d` after each.

use std::time::{Duration, SystemTime};

use dedup_pg::RangePolicy;
use sqlx::Connection;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, t0_ms, days] = args.as_slice() else {
        return Err("usage: dedup-keep-ranges <database-url> <t0-ms> <days>".into());
    };
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_millis(t0_ms.parse()?);
    let policy = RangePolicy::default()
        .with_days(1)
        .with_ahead(Duration::from_secs(86_400))
        .with_keep(Duration::ZERO);
    let mut conn = sqlx::PgConnection::connect(url).await?;
    for d in 0..=days.parse::<u64>()? {
        let at = t0 + Duration::from_secs(d * 86_400);
        dedup_pg::maintain_ranges(&mut conn, &policy, at).await?;
        #[allow(clippy::print_stdout)]
        {
            println!("day {d}");
        }
    }
    Ok(())
}
