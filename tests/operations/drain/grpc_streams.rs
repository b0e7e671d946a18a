//! gRPC client streams that an abort or their caller's going away cuts off never end
//! cleanly at a tonic upstream: a clean end would apply the partial stream.

use crate::support;

use std::time::Duration;

use support::grpc::{EchoClient, Msg};

use super::harness::wait_until;

const GRPC_RACE_CONFIG: &str = r#"
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[marks]
store = "memory"
[[upstream]]
name = "echo"
url = "http://{upstream}"
protocol = "h2c"
[[route]]
name = "echo"
upstream = "echo"
path_prefix = "/test.Echo/"
resource = "echo"
drain_timeout_ms = 20
"#;

/// A tonic `Sum` upstream behind a proxy with a 20 ms drain.
async fn sum_proxy() -> (
    support::grpc::SumUpstream,
    support::Proxy,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let up = support::grpc::sum_upstream().await;
    let text = support::render(GRPC_RACE_CONFIG, up.addr, dir.path());
    let proxy = support::proxy(&text, dir.path()).await;
    (up, proxy, dir)
}

/// What the upstream saw of the `Sum` call whose first message is `label`.
fn call_of(up: &support::grpc::SumUpstream, label: &str) -> Option<support::grpc::SumCall> {
    up.sums
        .calls()
        .into_iter()
        .find(|c| c.label.as_deref() == Some(label))
}

/// A client-streaming `Sum` call on `c` with `token`, one message (`label`) sent and the
/// stream left open; returns once the upstream has the message.
async fn one_message_open(
    up: &support::grpc::SumUpstream,
    mut c: EchoClient,
    token: &str,
    label: &str,
) -> (
    tokio::sync::mpsc::Sender<Msg>,
    tokio::task::JoinHandle<Result<tonic::Response<Msg>, tonic::Status>>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let token = token.to_owned();
    let call = tokio::spawn(async move {
        c.sum(
            tokio_stream::wrappers::ReceiverStream::new(rx),
            Some(&token),
        )
        .await
    });
    tx.send(Msg {
        text: label.to_owned(),
        n: 1,
    })
    .await
    .unwrap();
    wait_until(
        "the message at the upstream",
        Duration::from_secs(5),
        || {
            up.sums
                .calls()
                .iter()
                .any(|c| c.label.as_deref() == Some(label) && c.received == 1)
        },
    )
    .await;
    (tx, call)
}

/// The abort must reset the upstream stream with an error, never with CANCEL: a tonic server
/// reads RST_STREAM(CANCEL) on a client stream as its clean end (`Streaming` yields `None`),
/// so a `Sum` would apply the aborted caller's partial stream. Forty rounds of: an old owner's
/// client stream with one message, open; a new owner's call (20 ms drain); at the upstream,
/// the old stream must fail, not end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_grpc_streams_never_end_cleanly_at_a_tonic_upstream() {
    let (up, proxy, _dir) = sum_proxy().await;
    let call_of = |label: &str| call_of(&up, label);
    let rounds = 40u32;
    for i in 0..rounds {
        let (old, new) = ((2 * i + 1).to_string(), (2 * i + 2).to_string());
        let mut warm = EchoClient::connect(proxy.addr).await;
        let one = |text: &str| {
            tokio_stream::iter(vec![Msg {
                text: text.to_owned(),
                n: 1,
            }])
        };
        warm.sum(one("warm"), Some(&old)).await.unwrap();

        let label = format!("old-{i}");
        let c = EchoClient::connect(proxy.addr).await;
        let (tx, call) = one_message_open(&up, c, &old, &label).await;
        let mut b = EchoClient::connect(proxy.addr).await;
        b.sum(one("new"), Some(&new)).await.unwrap();
        let status = call.await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
        wait_until(
            "the old owner's call to end at the upstream",
            Duration::from_secs(5),
            || call_of(&label).is_some_and(|c| c.ended || c.error.is_some()),
        )
        .await;
        let c = call_of(&label).unwrap();
        assert!(
            !c.ended,
            "round {i}: the upstream saw the clean end of an aborted stream: {c:?}"
        );
        drop(tx);
    }
}

/// A caller that goes away in the middle of a client stream (its connection dies, or it
/// cancels the call) must not end that stream cleanly at a tonic upstream either, which would
/// apply its partial stream. Twenty rounds of each: a client stream with one message, open;
/// then the caller's connection is dropped (even rounds) or its call cancelled (odd rounds);
/// at the upstream, the stream must fail, not end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_caller_gone_mid_stream_never_ends_it_cleanly_at_a_tonic_upstream() {
    let (up, proxy, _dir) = sum_proxy().await;
    let call_of = |label: &str| call_of(&up, label);
    for i in 0..40u32 {
        let label = format!("gone-{i}");
        let c = EchoClient::connect(proxy.addr).await;
        let keep = (i % 2 == 1).then(|| c.clone());
        let (tx, call) = one_message_open(&up, c, "7", &label).await;
        // Dropping the only client (even rounds) closes its connection; with a clone kept
        // (odd rounds) only the call is cancelled, the connection stays.
        call.abort();
        let _ = call.await;
        wait_until(
            "the call to end at the upstream",
            Duration::from_secs(5),
            || call_of(&label).is_some_and(|c| c.ended || c.error.is_some()),
        )
        .await;
        drop(keep);
        let c = call_of(&label).unwrap();
        assert!(
            !c.ended,
            "round {i}: the upstream saw the clean end of a stream whose caller went away: {c:?}"
        );
        drop(tx);
    }
}
