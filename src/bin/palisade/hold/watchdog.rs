//! The job never outlives its supervisor: a watchdog process that takes the job's process
//! group down when `palisade lock|elect` dies, however it dies.
//!
//! Before CMD starts, palisade starts itself again as `palisade __watchdog` in a new process
//! group, with a pipe on its stdin, and CMD joins that group. The watchdog only reads the
//! pipe. When palisade exits in any way, `kill -9` and the OOM killer included, the kernel
//! closes palisade's end, the watchdog reads end-of-file and sends SIGKILL to the whole group:
//! CMD, its children, and itself. The group's id is the watchdog's pid, so it cannot be handed
//! to another process while palisade still signals it.
//!
//! What this does not cover: a frozen palisade (SIGSTOP, a VM pause) keeps the pipe open, so
//! the job goes on, and so does a process that left the group (`setsid`, or a shell's job
//! control: `set -m` gives every background job a group of its own). Then the lease
//! runs out and the fencing token is what keeps the resource safe; under systemd,
//! `KillMode=mixed` (deploy/systemd/) also ends every process of the unit when palisade goes.
//! A `kill -9` of the watchdog alone leaves the job supervised by palisade (which logs it).

use std::io::{Read, Write};
use std::process::ExitCode;

use rustix::process::{getpgrp, kill_process_group, Signal};

/// The hidden subcommand palisade runs itself as.
pub(crate) const SUBCOMMAND: &str = "__watchdog";

/// What palisade writes to the pipe when it ends the group itself (the watchdog then exits
/// quietly).
pub(super) const DONE: u8 = b'd';
/// What the watchdog writes on its stdout once it survives the signals palisade forwards.
pub(super) const READY: u8 = b'r';

/// `palisade __watchdog`: waits for palisade to go, then kills its own process group.
pub(crate) fn run() -> ExitCode {
    // The signals palisade forwards to the job's group reach the watchdog too; it must
    // survive them (a SIGTERM to the job is not the end of its supervisor). Registering a
    // handler replaces their default action (death); nothing needs to read them.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build();
    let ignored = rt.as_ref().ok().map(|rt| {
        let _entered = rt.enter();
        super::signals::Signals::new()
    });
    if !matches!(ignored, Some(Ok(_))) {
        // palisade sees no READY and does not start the command.
        return ExitCode::FAILURE;
    }
    // Tell palisade the signals are taken care of: only now may it start CMD in this group.
    let _ = std::io::stdout().write_all(&[READY]);
    let _ = std::io::stdout().flush();
    let mut byte = [0u8; 1];
    let read = std::io::stdin().lock().read(&mut byte);
    if matches!(read, Ok(1)) && byte[0] == DONE {
        return ExitCode::SUCCESS;
    }
    // Never `eprintln!`: palisade's stderr may be a pipe whose reader died with it, and a
    // panic here would leave the job running.
    let _ = writeln!(
        std::io::stderr(),
        "palisade: the supervisor of this lock's command is gone; killing the command's \
         process group"
    );
    // Kills this process too.
    let _ = kill_process_group(getpgrp(), Signal::KILL);
    ExitCode::FAILURE
}
