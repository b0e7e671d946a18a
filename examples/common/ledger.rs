//! What a resource in the examples holds and saw: its current value and every request that
//! reached it with the token that request carried. The resources check nothing themselves
//! (the fence in front of them does), so the ledger shows whether a stale write got through.

// Each example uses its own part of this shared code.
#![allow(dead_code)]

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

/// One request that reached the resource.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub(crate) owner: String,
    pub(crate) write: bool,
    pub(crate) token: Option<u64>,
    pub(crate) value: String,
}

#[derive(Default)]
struct State {
    value: String,
    seen: Vec<Seen>,
}

/// Shared by the resource's handlers and the example's verdict.
#[derive(Clone, Default)]
pub(crate) struct Ledger(Arc<Mutex<State>>);

impl Ledger {
    /// Applies a write (sets the value) and logs it.
    pub(crate) fn write(&self, owner: String, token: Option<u64>, value: String) {
        let mut s = self.0.lock().unwrap();
        s.value.clone_from(&value);
        s.seen.push(Seen {
            owner,
            write: true,
            token,
            value,
        });
    }

    /// Logs a read and returns the value.
    pub(crate) fn read(&self, owner: String, token: Option<u64>) -> String {
        let mut s = self.0.lock().unwrap();
        let value = s.value.clone();
        s.seen.push(Seen {
            owner,
            write: false,
            token,
            value: value.clone(),
        });
        value
    }

    /// The value now.
    pub(crate) fn value(&self) -> String {
        self.0.lock().unwrap().value.clone()
    }

    /// Every request that reached the resource, in order.
    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.0.lock().unwrap().seen.clone()
    }

    /// Writes that reached the resource with a token below one it had already seen: the
    /// zombie writes a fence exists to stop.
    pub(crate) fn stale_writes(&self) -> Vec<Seen> {
        let mut highest = 0;
        let mut stale = Vec::new();
        for seen in self.seen() {
            let token = seen.token.unwrap_or(0);
            if seen.write && token < highest {
                stale.push(seen);
            }
            highest = highest.max(token);
        }
        stale
    }

    /// Prints the log, then the verdict: success only if no stale write reached the resource
    /// and it holds `expected` (the last rightful owner's value).
    pub(crate) fn verdict(&self, expected: &str) -> ExitCode {
        println!("\n  what reached the resource:");
        for s in self.seen() {
            let token = s.token.map_or("-".to_owned(), |t| t.to_string());
            let what = if s.write { "wrote" } else { "read " };
            println!(
                "    {:<3} {what} {:<22} token {token}",
                s.owner,
                format!("{:?}", s.value)
            );
        }
        let stale = self.stale_writes();
        let value = self.value();
        if stale.is_empty() && value == expected {
            println!("OK: the zombie was refused; the resource holds {value:?}");
            ExitCode::SUCCESS
        } else {
            for s in &stale {
                println!(
                    "FAIL: a stale write got through: {} wrote {:?} with token {:?}",
                    s.owner, s.value, s.token
                );
            }
            if value != expected {
                println!("FAIL: the resource holds {value:?}, expected {expected:?}");
            }
            ExitCode::FAILURE
        }
    }
}
