//! Whose CPU time an HTTP contender cost, from Linux's `/proc`, in ticks of 1/100 s: the
//! server's threads (named [`THREAD`](super::server::THREAD)), the rest of the bench process
//! (the client), Postgres's processes and Redis's. `None` off Linux.

use std::path::Path;

use super::server::THREAD;

/// The counters at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Split {
    server: u64,
    process: u64,
    postgres: u64,
    redis: u64,
}

/// CPU time per 1,000 requests, in ms: the server, the client (the rest of the bench process),
/// Postgres and Redis.
#[derive(Clone, Copy, Debug, Default)]
#[allow(clippy::struct_field_names)]
pub(crate) struct PerRequests {
    pub(crate) server_ms: f64,
    pub(crate) client_ms: f64,
    pub(crate) postgres_ms: f64,
    pub(crate) redis_ms: f64,
}

/// The command name and the CPU fields of a `stat` file: utime, stime, cutime, cstime.
fn stat(path: &Path) -> Option<(String, [u64; 4])> {
    let text = std::fs::read_to_string(path).ok()?;
    let (head, rest) = text.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    // From field 3 on: utime is 14, stime 15, cutime 16, cstime 17.
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|n| n.parse().unwrap_or(0))
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    Some((comm, [at(11), at(12), at(13), at(14)]))
}

/// Reads the counters now.
pub(super) fn now() -> Option<Split> {
    let (_, own) = stat(Path::new("/proc/self/stat"))?;
    let mut split = Split {
        process: own[0] + own[1],
        ..Split::default()
    };
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        if let Some((comm, t)) = stat(&task.path().join("stat"))
            && comm == THREAD
        {
            split.server += t[0] + t[1];
        }
    }
    for proc in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = proc.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Some((comm, t)) = stat(&proc.path().join("stat")) else {
            continue;
        };
        // Children's time too: the backends that ended meanwhile are the postmaster's.
        let all = t.iter().sum::<u64>();
        if comm == "postgres" {
            split.postgres += all;
        } else if comm.starts_with("redis-server") {
            split.redis += all;
        }
    }
    Some(split)
}

impl Split {
    /// What happened between `before` and `self`, per 1,000 of `requests`.
    pub(super) fn per_1k(self, before: Split, requests: u64) -> PerRequests {
        #[allow(clippy::cast_precision_loss)]
        let per =
            |a: u64, b: u64| a.saturating_sub(b) as f64 * 10.0 * 1000.0 / requests.max(1) as f64;
        let server = self.server.saturating_sub(before.server);
        let process = self.process.saturating_sub(before.process);
        PerRequests {
            server_ms: per(server, 0),
            client_ms: per(process.saturating_sub(server), 0),
            postgres_ms: per(self.postgres, before.postgres),
            redis_ms: per(self.redis, before.redis),
        }
    }
}
