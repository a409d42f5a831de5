//! How a Postgres error is classified: passing (retry), unknown outcome (read back), or final.
//!
//! Reviewed against Postgres's SQLSTATE classes (Appendix A of its manual), class by class:
//!
//! | class | meaning | here |
//! |---|---|---|
//! | 08 | connection exception | passing; the connection is discarded |
//! | 0A, 0B, 0F, 0L, 0P, 0Z, 20, 21, 22, 23, 26, 27, 2B, 2D, 2F, 34, 38, 39, 3B, 3D, 3F, 42, 44, HV, P0 | the statement, the data or the schema is wrong | final: the same call fails the same way |
//! | 25 | invalid transaction state | 25006 (read-only transaction: a standby, or a primary being demoted during a failover), 25P03 (idle-in-transaction timeout) and 25P04 (transaction timeout) are passing, and 25006 discards the connection (it points at a server that cannot write); the rest are final |
//! | 28 | invalid authorization | final (a wrong password does not cure itself) |
//! | 40 | transaction rollback | passing (40001 serialization failure, 40P01 deadlock, 40002 constraint at commit), except 40003 (statement completion unknown), an unknown outcome |
//! | 53 | insufficient resources (disk full, out of memory, too many connections) | passing |
//! | 54 | program limit exceeded | final |
//! | 55 | object not in prerequisite state | 55P03 (lock not available) and 55006 (object in use) are passing; the rest final |
//! | 57 | operator intervention | 57014 (statement timeout, or a cancelled query), 57000, 57P01 (admin shutdown), 57P02 (crash shutdown), 57P03 (cannot connect now), 57P05 (idle session timeout) are passing and discard the connection where it is gone; 57P04 (database dropped) is final |
//! | 58 | system error (I/O) | 58000 and 58030 (I/O error) are passing; 58P01/58P02 (a file missing or duplicated) are final |
//! | 72 | snapshot too old | passing |
//! | F0 | configuration file error | final |
//! | XX | internal error, data or index corrupted | final |
//!
//! A server-reported error means the statement did not apply (Postgres rolls the statement back),
//! so a passing one is [`StoreError::Unavailable`]; 40003 is the one class member that says the
//! opposite. Client-side failures (I/O, protocol, TLS, a crashed worker) after a write leave its
//! outcome unknown. A final error is `StoreError::Backend`.

use dedup_core::StoreError;

/// Whether a server-reported SQLSTATE is a passing condition: the same call may succeed later.
pub fn is_passing(code: &str) -> bool {
    match code.get(..2).unwrap_or_default() {
        "08" | "40" | "53" | "72" => true,
        "25" => matches!(code, "25006" | "25P03" | "25P04"),
        "55" => matches!(code, "55P03" | "55006"),
        "57" => code != "57P04",
        "58" => matches!(code, "58000" | "58030"),
        _ => false,
    }
}

/// Whether a connection that saw this SQLSTATE must be closed rather than reused: it is
/// connected to a server that cannot write (25006: a standby, or a primary demoted in a
/// failover), or the server has ended or is ending the session.
pub(crate) fn discards_connection(code: &str) -> bool {
    code.starts_with("08")
        || matches!(
            code,
            "25006" | "25P03" | "25P04" | "57P01" | "57P02" | "57P03" | "57P05"
        )
}

/// Classifies a sqlx error. `write` says whether the statement may have changed data: a dropped
/// connection after a write leaves its outcome unknown.
pub fn classify(e: sqlx::Error, write: bool) -> StoreError {
    match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            if code == "40003" {
                StoreError::outcome_unknown(e)
            } else if is_passing(&code) {
                StoreError::unavailable(e)
            } else {
                StoreError::backend(e)
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => {
            if write {
                StoreError::outcome_unknown(e)
            } else {
                StoreError::unavailable(e)
            }
        }
        sqlx::Error::PoolTimedOut | sqlx::Error::BeginFailed => StoreError::unavailable(e),
        _ => StoreError::backend(e),
    }
}

/// The SQLSTATE behind a store error, where Postgres reported one.
pub fn sqlstate(e: &StoreError) -> Option<String> {
    let source = match e {
        StoreError::Unavailable { source }
        | StoreError::OutcomeUnknown { source }
        | StoreError::Backend { source } => source,
        _ => return None,
    };
    match source.downcast_ref::<sqlx::Error>()? {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether the connection that produced `e` must be closed rather than returned to the pool.
pub(crate) fn must_discard(e: &StoreError) -> bool {
    sqlstate(e).is_some_and(|c| discards_connection(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passing_and_final_classes() {
        for code in [
            "08006", "08000", "40001", "40P01", "40002", "53100", "53200", "53300", "55P03",
            "55006", "57014", "57000", "57P01", "57P02", "57P03", "57P05", "58030", "72000",
            "25006", "25P03", "25P04",
        ] {
            assert!(is_passing(code), "{code} should be passing");
        }
        for code in [
            "23505", "23503", "22P02", "42P01", "42703", "42501", "28P01", "3D000", "0A000",
            "54000", "55000", "57P04", "58P01", "XX000", "XX001", "P0001", "25P02", "25001",
            "F0000", "",
        ] {
            assert!(!is_passing(code), "{code} should be final");
        }
        assert!(discards_connection("25006"));
        assert!(discards_connection("08006"));
        assert!(
            !discards_connection("57014"),
            "a cancelled statement leaves the session usable"
        );
        assert!(!discards_connection("40001"));
    }
}
