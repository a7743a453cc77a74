//! Permission requests to the client.
//!
//! The automation profile's one-shot machine channel (seed 003): *ask* becomes one
//! `session/request_permission` with the pending tool call and exactly two options,
//! allow once and reject once; the answer is never kept as a standing grant.
//! The editor profile offers the four options of seed 000; the engine remembers an
//! *always* answer for the call's scope. In both, an error answer, a malformed
//! answer or a closed connection count as *unavailable*: denied, and the tool does
//! not run.

use agent_client_protocol_schema::v1::{
    PermissionOption, PermissionOptionKind, RequestPermissionOutcome, RequestPermissionRequest,
    RequestPermissionResponse, ToolCallUpdate,
};
use futures::future::BoxFuture;
use pier_acp::{Outgoing, RequestError};
use pier_engine::{Approver, PermissionAnswer, ToolCallRecord};
use tokio::sync::{mpsc, oneshot};

use crate::wire;

pub const ALLOW_ONCE: &str = "allow-once";
pub const ALLOW_ALWAYS: &str = "allow-always";
pub const REJECT_ONCE: &str = "reject-once";
pub const REJECT_ALWAYS: &str = "reject-always";

/// A permission request for the turn's forwarder to put on the wire. It goes through
/// the forwarder so that it leaves after every update the turn emitted before it
/// (the tool call it is about, first of all).
pub struct Ask {
    pub request: RequestPermissionRequest,
    pub sent: oneshot::Sender<Result<Outgoing, RequestError>>,
}

/// Asks the client over the connection, for one session.
pub struct ClientApprover {
    pub asks: mpsc::Sender<Ask>,
    pub session_id: String,
    /// Whether to offer the *always* options (the editor profile).
    pub always: bool,
}

impl ClientApprover {
    fn options(&self) -> Vec<PermissionOption> {
        let mut options = vec![PermissionOption::new(ALLOW_ONCE, "Allow once", PermissionOptionKind::AllowOnce)];
        if self.always {
            options.push(PermissionOption::new(ALLOW_ALWAYS, "Always allow", PermissionOptionKind::AllowAlways));
        }
        options.push(PermissionOption::new(REJECT_ONCE, "Reject", PermissionOptionKind::RejectOnce));
        if self.always {
            options.push(PermissionOption::new(REJECT_ALWAYS, "Always reject", PermissionOptionKind::RejectAlways));
        }
        options
    }
}

impl Approver for ClientApprover {
    fn ask(&self, call: &ToolCallRecord) -> BoxFuture<'static, PermissionAnswer> {
        let always = self.always;
        let request = RequestPermissionRequest::new(
            self.session_id.clone(),
            ToolCallUpdate::new(call.id.clone(), wire::tool_call_fields(call)),
            self.options(),
        );
        let asks = self.asks.clone();
        Box::pin(async move {
            let answer = ask(&asks, request).await;
            let answer = match answer {
                Ok(response) => match response.outcome {
                    RequestPermissionOutcome::Cancelled => PermissionAnswer::Cancelled,
                    RequestPermissionOutcome::Selected(s) => match s.option_id.0.as_ref() {
                        ALLOW_ONCE => PermissionAnswer::AllowOnce,
                        REJECT_ONCE => PermissionAnswer::RejectOnce,
                        ALLOW_ALWAYS if always => PermissionAnswer::AllowAlways,
                        REJECT_ALWAYS if always => PermissionAnswer::RejectAlways,
                        other => {
                            PermissionAnswer::Unavailable(format!("the client chose `{other}`, which was not offered"))
                        }
                    },
                    _ => PermissionAnswer::Unavailable("the client's outcome is not one this agent knows".into()),
                },
                Err(RequestError::Remote(e)) => PermissionAnswer::Unavailable(format!(
                    "the client answered with error {}: {}",
                    i32::from(e.code),
                    e.message
                )),
                Err(RequestError::Closed) => PermissionAnswer::Unavailable("the connection closed".into()),
                Err(RequestError::Malformed { source, .. }) => {
                    PermissionAnswer::Unavailable(format!("the client's answer was malformed: {source}"))
                }
                Err(e) => PermissionAnswer::Unavailable(e.to_string()),
            };
            tracing::info!(?answer, "permission answered");
            answer
        })
    }
}

async fn ask(
    asks: &mpsc::Sender<Ask>,
    request: RequestPermissionRequest,
) -> Result<RequestPermissionResponse, RequestError> {
    let (sent, outgoing) = oneshot::channel();
    asks.send(Ask { request, sent }).await.map_err(|_| RequestError::Closed)?;
    let outgoing = outgoing.await.map_err(|_| RequestError::Closed)??;
    outgoing.answer("session/request_permission").await
}
