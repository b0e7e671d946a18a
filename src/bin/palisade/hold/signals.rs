//! The signals palisade forwards, and sending them to a process group (through rustix: the
//! crate forbids `unsafe`, and a `kill` binary is not in every image, the distroless one
//! included).

pub(super) use rustix::process::Signal;
use rustix::process::{kill_process_group, Pid};
use tokio::signal::unix::{signal, SignalKind};

/// What palisade forwards to CMD.
const FORWARDED: [Signal; 5] = [
    Signal::INT,
    Signal::TERM,
    Signal::HUP,
    Signal::USR1,
    Signal::USR2,
];

/// Streams of the forwarded signals. Listening replaces their default action (death), so
/// palisade outlives them and decides.
pub(super) struct Signals(Vec<(Signal, tokio::signal::unix::Signal)>);

impl Signals {
    pub(super) fn new() -> std::io::Result<Self> {
        FORWARDED
            .iter()
            .map(|s| Ok((*s, signal(SignalKind::from_raw(s.as_raw()))?)))
            .collect::<std::io::Result<Vec<_>>>()
            .map(Signals)
    }

    /// The next signal received.
    pub(super) async fn recv(&mut self) -> Signal {
        std::future::poll_fn(|cx| {
            for (sig, stream) in &mut self.0 {
                if stream.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*sig);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

impl Signals {
    /// The next signal that ends a wait with no CMD running: any of them, or with
    /// `only_stop` only SIGINT and SIGTERM (the others have no CMD to go to, and a
    /// `--recampaign` standby outlives them).
    pub(super) async fn stop(&mut self, only_stop: bool) -> Signal {
        loop {
            let sig = self.recv().await;
            if !only_stop || sig == Signal::INT || sig == Signal::TERM {
                return sig;
            }
            tracing::debug!(?sig, "no command running: signal ignored");
        }
    }
}

/// `kill(-group, sig)`.
pub(super) fn kill_group(group: i32, sig: Signal) -> std::io::Result<()> {
    let pid = Pid::from_raw(group)
        .ok_or_else(|| std::io::Error::other(format!("bad process group {group}")))?;
    kill_process_group(pid, sig).map_err(std::io::Error::from)
}

/// The shells' exit code for a death by `sig`.
pub(super) fn exit_code(sig: Signal) -> u8 {
    (128 + sig.as_raw()) as u8
}
