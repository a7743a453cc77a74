//! The one-shot machine permission channel of the automation profile (seed 003).
//!
//! *Ask* becomes one `session/request_permission` with the pending tool call and
//! exactly two options, allow once and reject once. The answer is never kept as
//! a standing grant. An error answer, a malformed answer or a closed connection
//! all count as *unavailable*: denied, and the tool does not run.

use agent_client_protocol_schema::v1::{
    PermissionOption, PermissionOptionKind, RequestPermissionOutcome, RequestPermissionRequest,
    RequestPermissionResponse, ToolCallUpdate,
};
use futures::future::BoxFuture;
use pier_acp::{Connection, RequestError};
use pier_engine::{Approver, PermissionAnswer, ToolCallRecord};

use crate::wire;

pub const ALLOW_ONCE: &str = "allow-once";
pub const REJECT_ONCE: &str = "reject-once";

/// Asks the client over the connection, for one session.
pub struct ClientApprover {
    pub conn: Connection,
    pub session_id: String,
}

impl Approver for ClientApprover {
    fn ask(&self, call: &ToolCallRecord) -> BoxFuture<'static, PermissionAnswer> {
        let request = RequestPermissionRequest::new(
            self.session_id.clone(),
            ToolCallUpdate::new(call.id.clone(), wire::tool_call_fields(call)),
            vec![
                PermissionOption::new(ALLOW_ONCE, "Allow once", PermissionOptionKind::AllowOnce),
                PermissionOption::new(REJECT_ONCE, "Reject", PermissionOptionKind::RejectOnce),
            ],
        );
        let conn = self.conn.clone();
        Box::pin(async move {
            let answer = conn.request::<_, RequestPermissionResponse>("session/request_permission", &request).await;
            let answer = match answer {
                Ok(response) => match response.outcome {
                    RequestPermissionOutcome::Cancelled => PermissionAnswer::Cancelled,
                    RequestPermissionOutcome::Selected(s) => match s.option_id.0.as_ref() {
                        ALLOW_ONCE => PermissionAnswer::AllowOnce,
                        REJECT_ONCE => PermissionAnswer::RejectOnce,
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
