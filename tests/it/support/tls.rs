//! Certificates made at test time (with the `openssl` tool), and a TLS front for a plaintext
//! server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};

use super::pg_server::run;

/// A certificate authority, a server certificate it signed for `localhost` only (not for
/// `127.0.0.1`), and a second, unrelated authority, in a directory of their own.
#[derive(Debug)]
pub(crate) struct Certs {
    dir: PathBuf,
}

impl Certs {
    pub(crate) fn make() -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("dedup-test-certs-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let openssl = |args: &[&str]| {
            run(std::process::Command::new("openssl")
                .current_dir(&dir)
                .args(args));
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let key = format!("{ca}.key");
            let pem = format!("{ca}.pem");
            let subject = format!("/CN=dedup test {ca}");
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            args.extend([
                "-keyout",
                &key,
                "-out",
                &pem,
                "-days",
                "2",
                "-subj",
                &subject,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
            openssl(&args);
        }
        let mut args = vec!["req"];
        args.extend(ec);
        args.extend([
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        openssl(&args);
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=DNS:localhost\nbasicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ]);
        Self { dir }
    }

    pub(crate) fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    pub(crate) fn other_ca(&self) -> PathBuf {
        self.dir.join("other-ca.pem")
    }

    pub(crate) fn server_cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    pub(crate) fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// Copies the server's certificate and key into `to` as `server.crt` and `server.key`.
    pub(crate) fn install_server(&self, to: &Path) {
        std::fs::copy(self.server_cert(), to.join("server.crt")).unwrap();
        std::fs::copy(self.server_key(), to.join("server.key")).unwrap();
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TLS listener on a free loopback port that hands each connection, decrypted, to a backend:
/// the certificate of [`Certs`] in front of a server that speaks plaintext. Bound first (so that
/// the backend can be told the front's address), serving once [`TlsFront::serve`] names the
/// backend.
pub(crate) struct TlsFront {
    port: u16,
    listener: Option<TcpListener>,
    acceptor: tokio_rustls::TlsAcceptor,
    handshakes: Arc<AtomicU32>,
    running: Option<(
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<()>,
    )>,
}

impl TlsFront {
    pub(crate) async fn bind(certs: &Certs) -> Self {
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(certs.server_cert())
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
        let key = PrivateKeyDer::from_pem_file(certs.server_key()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self {
            port: listener.local_addr().unwrap().port(),
            listener: Some(listener),
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            handshakes: Arc::default(),
            running: None,
        }
    }

    /// Serves on a thread and runtime of its own, as a server process would: a test runtime
    /// blocked in a Kafka client's close must not stop the front that close is talking to.
    pub(crate) fn serve(&mut self, backend: SocketAddr) {
        let listener = self.listener.take().expect("served once");
        let listener = listener.into_std().unwrap();
        let (acceptor, handshakes) = (self.acceptor.clone(), self.handshakes.clone());
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).unwrap();
                loop {
                    let socket = tokio::select! {
                        _ = &mut stop_rx => return,
                        accepted = listener.accept() => match accepted {
                            Ok((socket, _)) => socket,
                            Err(_) => return,
                        },
                    };
                    let (acceptor, handshakes) = (acceptor.clone(), handshakes.clone());
                    tokio::spawn(async move {
                        // A client that fails the handshake (it does not trust the certificate)
                        // is dropped, as a server would.
                        let Ok(mut tls) = acceptor.accept(socket).await else {
                            return;
                        };
                        handshakes.fetch_add(1, Ordering::Relaxed);
                        let Ok(mut plain) = TcpStream::connect(backend).await else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                    });
                }
            });
        });
        self.running = Some((stop_tx, thread));
    }

    /// `localhost:port`: the name the certificate carries.
    pub(crate) fn address(&self) -> String {
        format!("localhost:{}", self.port)
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// How many clients completed a TLS handshake.
    pub(crate) fn handshakes(&self) -> u32 {
        self.handshakes.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for TlsFront {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFront")
            .field("port", &self.port)
            .finish()
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.running.take() {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }
}
