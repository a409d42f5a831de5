//! A Kafka-compatible broker process of a test's own (nisshi, in memory).

use std::time::Duration;

/// A nisshi broker (a Kafka-compatible broker, in its own process) on a free loopback port,
/// killed on drop. The binary comes from `NISSHI_BIN` (set by `scripts/test`, which installs and
/// caches it).
#[derive(Debug)]
pub(crate) struct NisshiServer {
    port: u16,
    storage: String,
    /// The address clients are sent to (a TLS front, say), `None` for the listener itself.
    advertised: Option<String>,
    extra: Vec<String>,
    child: std::sync::Mutex<Option<std::process::Child>>,
}

impl NisshiServer {
    pub(crate) fn start() -> Self {
        Self::start_with(None, &[])
    }

    /// A broker that advertises `advertised` (`host:port`) to clients instead of its listener,
    /// and gets `extra` arguments (`--authentication`, say).
    pub(crate) fn start_with(advertised: Option<String>, extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let server = Self {
            port,
            storage: nisshi_storage(port),
            advertised,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            child: std::sync::Mutex::new(None),
        };
        server.spawn();
        server
    }

    fn spawn(&self) {
        let bin = std::env::var("NISSHI_BIN").unwrap_or_else(|_| "nisshi".into());
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let advertised = self
            .advertised
            .as_ref()
            .map_or_else(|| url.clone(), |a| format!("tcp://{a}"));
        let log = std::fs::File::create(
            std::env::temp_dir().join(format!("dedup-test-nisshi-{}.log", self.port)),
        )
        .unwrap();
        let child = std::process::Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised,
            ])
            .args(&self.extra)
            .args(["--storage-engine", &self.storage])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin} (scripts/test installs it): {e}"));
        *self.child.lock().unwrap() = Some(child);
        for _ in 0..500 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("nisshi did not listen on {}", self.port);
    }

    /// The listener itself (`127.0.0.1:port`), whatever is advertised.
    pub(crate) fn listener(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub(crate) fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops the broker process (SIGSTOP: every connection hangs, nothing answers) for `d`,
    /// then lets it go on (SIGCONT). nisshi 0.6.0 cannot be killed and started again without
    /// losing its data: its in-memory storage goes with the process, and its Postgres storage
    /// needs a schema the crate does not ship.
    pub(crate) async fn stop_for(&self, d: Duration) {
        let pid = self
            .child
            .lock()
            .unwrap()
            .as_ref()
            .expect("the broker runs")
            .id()
            .to_string();
        let signal = |s: &str| {
            let ok = std::process::Command::new("kill")
                .args([s, &pid])
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill {s} {pid}");
        };
        signal("-STOP");
        tokio::time::sleep(d).await;
        signal("-CONT");
    }

    fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NisshiServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where a test broker keeps its data: in its own memory.
fn nisshi_storage(port: u16) -> String {
    format!("memory://nisshi-{port}/")
}
