//! The calendar of the ranges of days: days since the Unix epoch, the boundaries ranges end on
//! (every `days` days from Monday 1970-01-05), and the ranges' names after their first day.

/// Milliseconds in a day.
pub(super) const DAY_MS: i64 = 86_400_000;

/// Days from the Unix epoch to Monday 1970-01-05, where ranges count their boundaries from.
const MONDAY: i32 = 4;

/// The day (since the Unix epoch) of a time in milliseconds.
pub(super) fn day_of(ms: i64) -> i32 {
    i32::try_from(ms.div_euclid(DAY_MS)).unwrap_or(i32::MAX)
}

/// The first boundary after `day`, boundaries being every `days` days from Monday 1970-01-05.
pub(super) fn next_boundary(day: i32, days: i32) -> i32 {
    day + days - (day - MONDAY).rem_euclid(days)
}

/// The range's table name: `dedup_records_` and its first day, `YYYYMMDD`.
pub(super) fn range_name(day: i32) -> String {
    let (y, m, d) = civil(day);
    format!("dedup_records_{y:04}{m:02}{d:02}")
}

/// The proleptic Gregorian date of a day since the Unix epoch (H. Hinnant's `civil_from_days`).
pub(super) fn civil(day: i32) -> (i32, u32, u32) {
    let z = day + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i32::from(m <= 2);
    (
        y,
        u32::try_from(m).unwrap_or(1),
        u32::try_from(d).unwrap_or(1),
    )
}

#[cfg(test)]
mod tests {
    use super::{civil, next_boundary, range_name};

    #[test]
    fn ranges_are_named_after_their_first_day() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(-1), (1969, 12, 31));
        assert_eq!(civil(20_419), (2025, 11, 27));
        assert_eq!(civil(11_016), (2000, 2, 29));
        assert_eq!(range_name(20_784), "dedup_records_20261127");
    }

    #[test]
    fn weeks_end_on_mondays() {
        // 2026-11-27 is a Friday; the next Monday is 2026-11-30, day 20,787.
        assert_eq!(next_boundary(20_784, 7), 20_787);
        assert_eq!(next_boundary(20_787, 7), 20_794);
        assert_eq!(next_boundary(20_784, 1), 20_785);
        assert_eq!(next_boundary(4, 7), 11);
        assert_eq!(next_boundary(3, 7), 4);
    }
}
