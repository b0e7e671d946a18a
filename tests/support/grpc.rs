//! A tiny gRPC service written against tonic's runtime API (no protoc needed): `test.Echo` with
//! a unary `Say` and a server-streaming `Count`, served over h2c and logging the fencing token
//! of every call that reaches it.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use http::uri::PathAndQuery;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::server::{Grpc, ServerStreamingService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use super::{Log, Seen};

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {
    #[prost(string, tag = "1")]
    pub text: String,
    #[prost(uint32, tag = "2")]
    pub n: u32,
}

pub const SAY: &str = "/test.Echo/Say";
pub const COUNT: &str = "/test.Echo/Count";

fn record(log: &Log, path: &str, req: &Request<Msg>) {
    log.push(Seen {
        method: http::Method::POST,
        path: path.to_owned(),
        authority: None,
        version: http::Version::HTTP_2,
        token: req
            .metadata()
            .get("x-fencing-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        headers: req.metadata().clone().into_headers(),
    });
}

struct Say(Log);

impl UnaryService<Msg> for Say {
    type Response = Msg;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Msg>, Status>> + Send>>;

    fn call(&mut self, req: Request<Msg>) -> Self::Future {
        record(&self.0, SAY, &req);
        let m = req.into_inner();
        Box::pin(async move {
            Ok(Response::new(Msg {
                text: format!("echo {}", m.text),
                n: m.n,
            }))
        })
    }
}

struct Count(Log);

type MsgStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<Msg, Status>> + Send>>;

impl ServerStreamingService<Msg> for Count {
    type Response = Msg;
    type ResponseStream = MsgStream;
    type Future = Pin<Box<dyn Future<Output = Result<Response<MsgStream>, Status>> + Send>>;

    fn call(&mut self, req: Request<Msg>) -> Self::Future {
        record(&self.0, COUNT, &req);
        let n = req.into_inner().n;
        let items = (1..=n).map(|i| {
            Ok(Msg {
                text: format!("item {i}"),
                n: i,
            })
        });
        let stream: MsgStream = Box::pin(tokio_stream::iter(items.collect::<Vec<_>>()));
        Box::pin(async move {
            let mut resp = Response::new(stream);
            resp.metadata_mut()
                .insert("x-server", "echo".parse().unwrap());
            Ok(resp)
        })
    }
}

pub struct GrpcUpstream {
    pub addr: std::net::SocketAddr,
    pub log: Log,
    _stop: oneshot::Sender<()>,
}

/// Serves `test.Echo` over h2c on a fresh loopback port.
pub async fn upstream() -> GrpcUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Log::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let l = log.clone();
    tokio::spawn(palisade::server::serve(
        listener,
        move |req: http::Request<Incoming>, _peer| {
            let log = l.clone();
            async move {
                let req = req.map(tonic::body::Body::new);
                let mut grpc = Grpc::new(ProstCodec::<Msg, Msg>::default());
                match req.uri().path() {
                    SAY => grpc.unary(Say(log), req).await,
                    COUNT => grpc.server_streaming(Count(log), req).await,
                    _ => Status::unimplemented("no such method").into_http(),
                }
            }
        },
        async move {
            let _ = stopped.await;
        },
        Duration::from_secs(1),
    ));
    GrpcUpstream {
        addr,
        log,
        _stop: stop,
    }
}

/// A tonic client for `test.Echo` at `addr` (plain h2c).
pub struct EchoClient(tonic::client::Grpc<tonic::transport::Channel>);

impl EchoClient {
    pub async fn connect(addr: std::net::SocketAddr) -> Self {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Self(tonic::client::Grpc::new(channel))
    }

    fn request(text: &str, n: u32, token: Option<&str>) -> Request<Msg> {
        let mut req = Request::new(Msg {
            text: text.to_owned(),
            n,
        });
        if let Some(t) = token {
            req.metadata_mut()
                .insert("x-fencing-token", t.parse().unwrap());
        }
        req
    }

    pub async fn say(&mut self, text: &str, token: Option<&str>) -> Result<Response<Msg>, Status> {
        self.0.ready().await.unwrap();
        self.0
            .unary(
                Self::request(text, 0, token),
                PathAndQuery::from_static(SAY),
                ProstCodec::default(),
            )
            .await
    }

    pub async fn count(
        &mut self,
        n: u32,
        token: Option<&str>,
    ) -> Result<Response<tonic::Streaming<Msg>>, Status> {
        self.0.ready().await.unwrap();
        self.0
            .server_streaming(
                Self::request("", n, token),
                PathAndQuery::from_static(COUNT),
                ProstCodec::default(),
            )
            .await
    }
}
