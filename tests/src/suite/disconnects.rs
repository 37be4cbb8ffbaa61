//! Clients that hang up mid-handler: the handler runs on (the default) or is cancelled.

use http::StatusCode;
use tokio::{io::AsyncWriteExt, net::TcpStream};
use tower_idempotency::Disconnect;

use super::{Backend, CHARGE, Harness, Reply};

async fn send_and_hang_up(h: &Harness<impl Backend>, key: &str) {
    let mut stream = TcpStream::connect(h.server.addr()).await.expect("connect");
    let request = format!(
        "POST /charges HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acct_a\r\n\
         Idempotency-Key: {key}\r\nX-Test-Gate: 1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    h.probe.started(1).await;
    drop(stream);
}

/// The client hangs up mid-handler: the handler finishes anyway and the retry gets its result.
pub async fn a_disconnected_client_still_gets_its_charge_on_retry<B: Backend>() {
    let h = Harness::<B>::start().await;
    send_and_hang_up(&h, "k-hangup").await;
    // The server has dropped the request before the handler may finish.
    h.probe.abandoned(1).await;
    h.probe.open_gate(1);
    h.store.settled(1).await;
    assert_eq!(h.store.completed(), 1);
    let retry = Reply::of(
        h.post("/charges", Some("k-hangup"))
            .header("content-type", "application/json")
            .body(CHARGE),
    )
    .await;
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], "ch_1");
    assert_eq!(h.probe.executions(), 1);
}

/// `Disconnect::Cancel`: the handler is dropped with the connection and the key released.
pub async fn cancel_on_disconnect_releases_the_key<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_disconnect(Disconnect::Cancel)).await;
    send_and_hang_up(&h, "k-cancel").await;
    h.probe.abandoned(1).await;
    h.store.settled(1).await;
    assert_eq!(h.store.released(), 1);
    let retry = Reply::of(
        h.post("/charges", Some("k-cancel"))
            .header("content-type", "application/json")
            .body(CHARGE),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(h.probe.executions(), 2);
}
