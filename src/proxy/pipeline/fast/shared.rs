//! The fast path's one door to the pipeline it is part of: the rules and parts it shares with
//! hyper's path (admission, header rewriting, the access log's note, the upstream side). Every
//! use of the parent pipeline from `fast/` goes through here, so this list is what the two
//! engines share.

pub(super) use super::super::decision::{Logged, Note};
pub(super) use super::super::fields::{same_name, Fields, FieldsMut, NewValue};
pub(super) use super::super::forward::ABORT_HOLD;
pub(super) use super::super::request::RequestView;
#[cfg(test)]
pub(super) use super::super::request::{has_body, is_bodiless_method, request_host};
pub(super) use super::super::rewrite;
pub(super) use super::super::upstream::raw::{self as upstream, UpSock};
pub(super) use super::super::upstream::{socket, Upstream};
pub(super) use super::super::{Passed, Proxy, Routed};
pub(super) use crate::proxy::error_chain::error_chain;
