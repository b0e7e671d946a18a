//! A TCP forwarder on loopback that can be cut: the test's stand-in for a network partition
//! between one client and its server.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Cut {
    pub addr: SocketAddr,
    cut: Arc<watch::Sender<bool>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Cut {
    /// Forwards `127.0.0.1:<port>` to `target` (`host:port`).
    pub async fn new(target: &str) -> Cut {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = watch::channel(false);
        let cut = Arc::new(cut);
        let target = target.trim_start_matches("http://").to_owned();
        let c = Arc::clone(&cut);
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                if *c.borrow() {
                    drop(inbound);
                    continue;
                }
                let mut stop = c.subscribe();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    tokio::select! {
                        _ = tokio::io::copy(&mut ri, &mut wo) => {}
                        _ = tokio::io::copy(&mut ro, &mut wi) => {}
                        _ = stop.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Cut {
            addr,
            cut,
            _task: task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Drops every forwarded connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Forwards again.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}
