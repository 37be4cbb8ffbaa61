//! A PostgreSQL connection that fails at a chosen moment: a proxy between the store's pool and
//! the test server that reads the server's protocol messages and, when armed, cuts a connection
//! right after the server confirmed a command: the command committed, the client never hears so.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpListener, TcpStream, UnixStream},
    task::JoinHandle,
};

use crate::db::TestDb;

/// The proxy, listening on a loopback port of the kernel's choosing; stopped when dropped.
pub struct CuttingProxy {
    addr: SocketAddr,
    armed: Arc<Armed>,
    task: JoinHandle<()>,
}

/// What the next cut waits for: a `CommandComplete` whose tag starts with this.
struct Armed {
    on: std::sync::Mutex<Option<&'static str>>,
    cut: AtomicBool,
}

impl CuttingProxy {
    /// A proxy to `db`'s server.
    pub async fn start(db: &TestDb) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let armed = Arc::new(Armed {
            on: std::sync::Mutex::new(None),
            cut: AtomicBool::new(false),
        });
        let target = db.options().clone();
        let task = tokio::spawn({
            let armed = Arc::clone(&armed);
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(relay(client, target.clone(), Arc::clone(&armed)));
                }
            }
        });
        Self { addr, armed, task }
    }

    /// Options that reach the test database through the proxy (without TLS, which it could
    /// not read).
    pub fn options(&self, db: &TestDb) -> PgConnectOptions {
        let o = db.options();
        PgConnectOptions::new()
            .ssl_mode(PgSslMode::Disable)
            .host("127.0.0.1")
            .port(self.addr.port())
            .username(o.get_username())
            .database(o.get_database().expect("test databases are named"))
    }

    /// Cuts the next connection whose server confirms a command tagged `tag...` (`"INSERT"`),
    /// instead of passing the confirmation on. Once.
    pub fn cut_after(&self, tag: &'static str) {
        *self.armed.on.lock().expect("not poisoned") = Some(tag);
    }

    /// Whether a connection was cut.
    pub fn has_cut(&self) -> bool {
        self.armed.cut.load(Ordering::SeqCst)
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: TcpStream, target: PgConnectOptions, armed: Arc<Armed>) {
    let (client_read, client_write) = client.into_split();
    if let Some(socket) = target.get_socket() {
        let path = socket.join(format!(".s.PGSQL.{}", target.get_port()));
        let Ok(server) = UnixStream::connect(path).await else {
            return;
        };
        let (server_read, server_write) = server.into_split();
        pipe(client_read, client_write, server_read, server_write, armed).await;
    } else {
        let Ok(server) = TcpStream::connect((target.get_host(), target.get_port())).await else {
            return;
        };
        let (server_read, server_write) = server.into_split();
        pipe(client_read, client_write, server_read, server_write, armed).await;
    }
}

/// Client to server byte for byte; server to client message by message, cut when armed.
async fn pipe(
    mut client_read: impl AsyncRead + Unpin,
    mut client_write: impl AsyncWrite + Unpin + Send,
    mut server_read: impl AsyncRead + Unpin + Send,
    mut server_write: impl AsyncWrite + Unpin,
    armed: Arc<Armed>,
) {
    let upstream = async {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
    };
    let downstream = async {
        let mut first = [0u8; 1];
        if server_read.read_exact(&mut first).await.is_err() {
            return;
        }
        let mut pending = first.to_vec();
        loop {
            // A message: its type (already in `pending`), a length counting itself, the rest.
            let mut length = [0u8; 4];
            if server_read.read_exact(&mut length).await.is_err() {
                return;
            }
            let length = u32::from_be_bytes(length) as usize;
            let mut body = vec![0u8; length.saturating_sub(4)];
            if server_read.read_exact(&mut body).await.is_err() {
                return;
            }
            if pending[0] == b'C' {
                let mut on = armed.on.lock().expect("not poisoned");
                if on.is_some_and(|tag| body.starts_with(tag.as_bytes())) {
                    *on = None;
                    armed.cut.store(true, Ordering::SeqCst);
                    return;
                }
            }
            pending.extend_from_slice(&(length as u32).to_be_bytes());
            pending.extend_from_slice(&body);
            if client_write.write_all(&pending).await.is_err() {
                return;
            }
            pending.clear();
            if server_read.read_exact(&mut first).await.is_err() {
                return;
            }
            pending.push(first[0]);
        }
    };
    // Whichever side ends first ends the connection: dropping both halves closes it.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}
