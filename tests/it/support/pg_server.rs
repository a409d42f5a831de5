//! A Postgres server of a test's own, in its own data directory and process.

/// A Postgres server of a test's own, in a fresh data directory on a free loopback port, for the
/// tests that crash it (`pg_ctl stop -m immediate`) and start it again. Durability on, as always.
pub(crate) struct PgServer {
    bin: std::path::PathBuf,
    dir: std::path::PathBuf,
    port: u16,
}

impl PgServer {
    pub(crate) fn start() -> Self {
        Self::start_configured(|_| String::new())
    }

    /// Starts a server whose `postgresql.conf` also gets what `configure` returns; `configure`
    /// runs after `initdb`, on the new server (its data directory exists, the server is down).
    pub(crate) fn start_configured(configure: impl FnOnce(&Self) -> String) -> Self {
        let bin = std::env::var_os("PG_BINDIR")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                let mut dirs: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
                    .ok()?
                    .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                    .collect();
                dirs.sort();
                dirs.pop()
            })
            .expect("PG_BINDIR is set by scripts/test");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("dedup-test-pg-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let server = Self { bin, dir, port };
        if is_root() {
            run(std::process::Command::new("chown")
                .arg("postgres:postgres")
                .arg(&server.dir));
        }
        run(server.as_owner("initdb").arg("-D").arg(&server.dir).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
        ]));
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             max_connections = 40\nshared_buffers = 32MB\nfsync = on\nsynchronous_commit = on\n",
            server.dir.display()
        );
        let path = server.dir.join("postgresql.conf");
        let mut all = std::fs::read_to_string(&path).unwrap();
        all.push_str(&conf);
        all.push_str(&configure(&server));
        std::fs::write(&path, all).unwrap();
        server.start_again();
        server
    }

    pub(crate) fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Makes files in the data directory the server's own and private (as a key must be).
    pub(crate) fn give_to_owner(&self, names: &[&str]) {
        for name in names {
            let path = self.dir.join(name);
            if is_root() {
                run(std::process::Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(&path));
            }
            run(std::process::Command::new("chmod").arg("600").arg(&path));
        }
    }

    fn as_owner(&self, tool: &str) -> std::process::Command {
        let path = self.bin.join(tool);
        if is_root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            std::process::Command::new(path)
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A pool on it with dedup's migrations applied, whose acquires give up after 2 s (a test
    /// that crashes the server must not wait long for a connection).
    pub(crate) async fn migrated_pool(&self) -> sqlx::PgPool {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(std::time::Duration::from_secs(2))
            .connect(&self.url())
            .await
            .unwrap();
        dedup_pg::migrate(&pool).await.unwrap();
        pool
    }

    /// Kills the server the way a crash would: `pg_ctl stop -m immediate` (no checkpoint; the
    /// next start replays the WAL). Returns once it is down.
    pub(crate) fn crash(&self) {
        run(self.as_owner("pg_ctl").arg("-D").arg(&self.dir).args([
            "-m",
            "immediate",
            "-w",
            "stop",
        ]));
    }

    /// Starts it (again), waiting until it accepts connections.
    pub(crate) fn start_again(&self) {
        run(self
            .as_owner("pg_ctl")
            .arg("-D")
            .arg(&self.dir)
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .args(["-w", "-t", "60", "start"]));
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self
            .as_owner("pg_ctl")
            .arg("-D")
            .arg(&self.dir)
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

pub(crate) fn run(cmd: &mut std::process::Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
