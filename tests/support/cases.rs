//! The admission cases every fence must pass, the proxy and the in-process layer alike: one
//! table, used by `tests/proxy/requests.rs` and `tests/layer/main.rs`.
//!
//! Each case runs against a resource whose mark is 51 when it starts.

/// One admission case.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub name: &'static str,
    /// The `x-fencing-token` header, if any.
    pub token: Option<&'static str>,
    /// Make the mark store fail before the request (advances must then be refused).
    pub store_down: bool,
    /// The HTTP status a plain request gets.
    pub http: u16,
    /// The `grpc-status` a gRPC request gets (0: the call goes through).
    pub grpc: u8,
    /// Whether the service behind the fence runs.
    pub reaches: bool,
    /// The mark after the case.
    pub mark_after: u64,
}

pub const MARK: u64 = 51;

pub const CASES: &[Case] = &[
    Case {
        name: "equal token is admitted",
        token: Some("51"),
        store_down: false,
        http: 200,
        grpc: 0,
        reaches: true,
        mark_after: 51,
    },
    Case {
        name: "stale token is refused",
        token: Some("34"),
        store_down: false,
        http: 409,
        grpc: 10,
        reaches: false,
        mark_after: 51,
    },
    Case {
        name: "malformed token is refused",
        token: Some("0051"),
        store_down: false,
        http: 400,
        grpc: 3,
        reaches: false,
        mark_after: 51,
    },
    Case {
        name: "missing token is refused",
        token: None,
        store_down: false,
        http: 428,
        grpc: 3,
        reaches: false,
        mark_after: 51,
    },
    Case {
        name: "higher token advances, durable before the service runs",
        token: Some("60"),
        store_down: false,
        http: 200,
        grpc: 0,
        reaches: true,
        mark_after: 60,
    },
    Case {
        name: "store down refuses an advance",
        token: Some("61"),
        store_down: true,
        http: 503,
        grpc: 14,
        reaches: false,
        mark_after: 51,
    },
    Case {
        name: "store down still admits the equal token",
        token: Some("51"),
        store_down: true,
        http: 200,
        grpc: 0,
        reaches: true,
        mark_after: 51,
    },
];

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What the service behind a fence saw: the token it was sent, and the mark the marks file
/// held when it ran (to prove persist-before-forward).
pub type Seen = Arc<Mutex<Vec<(Option<u64>, u64)>>>;

/// The mark of `orders` in a palisade marks file (0 when unreadable).
pub fn stored(marks: &Path) -> u64 {
    palisade::fence::marks::file::read(marks)
        .ok()
        .flatten()
        .and_then(|m| m.get("orders").copied())
        .unwrap_or(0)
}

/// Writes a marks file holding `orders = MARK`, in the JSON format of palisade 0.1 (migrated
/// when the proxy or the layer opens it).
pub fn seed(marks: &Path) {
    std::fs::create_dir_all(marks.parent().unwrap()).unwrap();
    std::fs::write(
        marks,
        format!("{{\"format\":\"palisade-marks/1\",\"marks\":{{\"orders\":{MARK}}}}}"),
    )
    .unwrap();
}

/// An upstream for the table through the proxy: plain HTTP answers 200, gRPC calls to
/// `test.Echo/Say` answer OK; both record what they saw in `seen`.
pub async fn recording_upstream(marks: PathBuf, seen: Seen) -> std::net::SocketAddr {
    use super::grpc::Msg;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(palisade::proxy::server::serve(
        listener,
        move |req: http::Request<hyper::body::Incoming>, _| {
            let (seen, marks) = (seen.clone(), marks.clone());
            async move {
                let token = req
                    .headers()
                    .get("x-fencing-token")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                seen.lock().unwrap().push((token, stored(&marks)));
                if palisade::fence::grpc::grpc_content_type(req.headers()).is_some() {
                    let req = req.map(tonic::body::Body::new);
                    let mut grpc =
                        tonic::server::Grpc::new(tonic_prost::ProstCodec::<Msg, Msg>::default());
                    grpc.unary(Echo, req).await
                } else {
                    http::Response::new(tonic::body::Body::new(http_body_util::Full::new(
                        bytes::Bytes::from_static(b"written"),
                    )))
                }
            }
        },
        std::future::pending::<()>(),
        std::time::Duration::from_secs(1),
    ));
    addr
}

struct Echo;

impl tonic::server::UnaryService<super::grpc::Msg> for Echo {
    type Response = super::grpc::Msg;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<tonic::Response<super::grpc::Msg>, tonic::Status>,
                > + Send,
        >,
    >;

    fn call(&mut self, req: tonic::Request<super::grpc::Msg>) -> Self::Future {
        let m = req.into_inner();
        Box::pin(async move { Ok(tonic::Response::new(m)) })
    }
}
