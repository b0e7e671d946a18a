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
        ..Seen::default()
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
    upstream_with(None).await
}

/// Serves `test.Echo` over TLS (HTTP/2 by ALPN) with `tls`.
pub async fn upstream_tls(tls: std::sync::Arc<tokio_rustls::rustls::ServerConfig>) -> GrpcUpstream {
    upstream_with(Some(tls)).await
}

async fn upstream_with(
    tls: Option<std::sync::Arc<tokio_rustls::rustls::ServerConfig>>,
) -> GrpcUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Log::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let l = log.clone();
    let limits = palisade::proxy::server::Limits {
        tls: tls.map(|t| std::sync::Arc::new(arc_swap::ArcSwap::new(t))),
        grace: Duration::from_secs(1),
        ..palisade::proxy::server::Limits::default()
    };
    tokio::spawn(palisade::proxy::server::serve_with(
        listener,
        move |req: http::Request<Incoming>, _peer, _: &std::sync::Arc<()>| {
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
        limits,
        None,
    ));
    GrpcUpstream {
        addr,
        log,
        _stop: stop,
    }
}

/// A tonic client for `test.Echo` at `addr` (plain h2c).
#[derive(Clone)]
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

    /// The same over TLS, with `tls` (its ALPN should offer `h2`), to `addr`.
    pub async fn connect_tls(
        addr: std::net::SocketAddr,
        tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    ) -> Result<Self, tonic::transport::Error> {
        let connector = tower::service_fn(move |_: http::Uri| {
            let tls = std::sync::Arc::clone(&tls);
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
                let s = tokio_rustls::TlsConnector::from(tls)
                    .connect(name, tcp)
                    .await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        });
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(connector)
            .await?;
        Ok(Self(tonic::client::Grpc::new(channel)))
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

// ---- Client streaming: `Sum`, which records whether each call's whole stream arrived. ----

use std::sync::{Arc, Mutex};
use tonic::server::ClientStreamingService;

pub const SUM: &str = "/test.Echo/Sum";

/// What the upstream's `Sum` saw of one call.
#[derive(Debug, Clone)]
pub struct SumCall {
    /// `x-fencing-token` of the call, as the upstream received it.
    pub token: Option<String>,
    /// The `text` of the first message (the caller's label).
    pub label: Option<String>,
    /// Messages received so far.
    pub received: u32,
    /// The stream ended with END_STREAM: the whole request arrived (the write is "applied").
    pub ended: bool,
    /// The stream failed (reset, connection lost) before its end.
    pub error: Option<String>,
    /// When the call reached the upstream / when its stream ended, in a sequence shared by
    /// every call of one upstream.
    pub started_seq: u64,
    pub ended_seq: Option<u64>,
}

/// Every `Sum` call one upstream saw, in arrival order.
#[derive(Debug, Clone, Default)]
pub struct SumLog(Arc<Mutex<(u64, Vec<SumCall>)>>);

impl SumLog {
    pub fn calls(&self) -> Vec<SumCall> {
        self.0.lock().unwrap().1.clone()
    }

    fn start(&self, token: Option<String>) -> usize {
        let mut g = self.0.lock().unwrap();
        g.0 += 1;
        let seq = g.0;
        g.1.push(SumCall {
            token,
            label: None,
            received: 0,
            ended: false,
            error: None,
            started_seq: seq,
            ended_seq: None,
        });
        g.1.len() - 1
    }

    fn update(&self, i: usize, f: impl FnOnce(&mut SumCall, u64)) {
        let mut g = self.0.lock().unwrap();
        g.0 += 1;
        let seq = g.0;
        f(&mut g.1[i], seq);
    }
}

struct Sum(Log, SumLog);

/// Notes a call that was dropped (its connection went away) before its stream ended.
struct SumGone(SumLog, usize, bool);

impl Drop for SumGone {
    fn drop(&mut self) {
        if !self.2 {
            self.0.update(self.1, |c, _| {
                if !c.ended && c.error.is_none() {
                    c.error = Some("call dropped before the end of its stream".to_owned());
                }
            });
        }
    }
}

impl ClientStreamingService<Msg> for Sum {
    type Response = Msg;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Msg>, Status>> + Send>>;

    fn call(&mut self, req: Request<tonic::Streaming<Msg>>) -> Self::Future {
        let token = req
            .metadata()
            .get("x-fencing-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        self.0.push(Seen {
            method: http::Method::POST,
            path: SUM.to_owned(),
            authority: None,
            version: http::Version::HTTP_2,
            token: token.clone(),
            headers: req.metadata().clone().into_headers(),
            ..Seen::default()
        });
        let sums = self.1.clone();
        let i = sums.start(token);
        let mut stream = req.into_inner();
        Box::pin(async move {
            let mut gone = SumGone(sums.clone(), i, false);
            let mut total = 0u32;
            loop {
                match stream.message().await {
                    Ok(Some(m)) => {
                        total += m.n;
                        sums.update(i, |c, _| {
                            c.received += 1;
                            c.label.get_or_insert(m.text.clone());
                        });
                    }
                    Ok(None) => {
                        sums.update(i, |c, seq| {
                            c.ended = true;
                            c.ended_seq = Some(seq);
                        });
                        gone.2 = true;
                        return Ok(Response::new(Msg {
                            text: "sum".to_owned(),
                            n: total,
                        }));
                    }
                    Err(status) => {
                        sums.update(i, |c, _| c.error = Some(status.to_string()));
                        gone.2 = true;
                        return Err(status);
                    }
                }
            }
        })
    }
}

/// A `test.Echo` upstream that also serves the client-streaming `Sum`.
pub struct SumUpstream {
    pub addr: std::net::SocketAddr,
    pub log: Log,
    pub sums: SumLog,
    _stop: oneshot::Sender<()>,
}

/// Serves `test.Echo` (`Say`, `Count`, `Sum`) over h2c on a fresh loopback port.
pub async fn sum_upstream() -> SumUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Log::default();
    let sums = SumLog::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let (l, s) = (log.clone(), sums.clone());
    tokio::spawn(palisade::proxy::server::serve(
        listener,
        move |req: http::Request<Incoming>, _peer| {
            let (log, sums) = (l.clone(), s.clone());
            async move {
                let req = req.map(tonic::body::Body::new);
                let mut grpc = Grpc::new(ProstCodec::<Msg, Msg>::default());
                match req.uri().path() {
                    SAY => grpc.unary(Say(log), req).await,
                    COUNT => grpc.server_streaming(Count(log), req).await,
                    SUM => grpc.client_streaming(Sum(log, sums), req).await,
                    _ => Status::unimplemented("no such method").into_http(),
                }
            }
        },
        async move {
            let _ = stopped.await;
        },
        Duration::from_secs(1),
    ));
    SumUpstream {
        addr,
        log,
        sums,
        _stop: stop,
    }
}

impl EchoClient {
    /// A client-streaming `Sum` call sending `messages` (a stream the caller feeds).
    pub async fn sum<S>(
        &mut self,
        messages: S,
        token: Option<&str>,
    ) -> Result<Response<Msg>, Status>
    where
        S: tokio_stream::Stream<Item = Msg> + Send + 'static,
    {
        let mut req = Request::new(messages);
        if let Some(t) = token {
            req.metadata_mut()
                .insert("x-fencing-token", t.parse().unwrap());
        }
        self.0.ready().await.unwrap();
        self.0
            .client_streaming(req, PathAndQuery::from_static(SUM), ProstCodec::default())
            .await
    }
}
