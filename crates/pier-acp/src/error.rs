//! Errors of the protocol core, and helpers that build JSON-RPC error objects.

use agent_client_protocol_schema::v1::Error;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Why an outgoing request produced no result.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The peer answered with a JSON-RPC error. Not retried: the peer decided.
    #[error("the peer answered {}: {}", i32::from(.0.code), .0.message)]
    Remote(Error),
    /// The connection closed (EOF, transport error or an explicit close) before an answer.
    #[error("the connection closed before the peer answered")]
    Closed,
    /// The peer's result did not match the expected type for the method.
    #[error("the peer's answer to `{method}` is malformed: {source}")]
    Malformed { method: String, source: serde_json::Error },
    /// The request could not be serialised; a bug in the caller.
    #[error("could not encode the request: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Decodes `params` as `P`, or builds the -32602 error carrying the serde path of
/// the first mismatch in `data`, so a client sees *where* its params are wrong.
pub fn decode_params<P: DeserializeOwned>(method: &str, params: &Value) -> Result<P, Error> {
    serde_path_to_error::deserialize::<_, P>(params).map_err(|e| invalid_params_error(method, &e))
}

fn invalid_params_error(method: &str, e: &serde_path_to_error::Error<serde_json::Error>) -> Error {
    let path = e.path().to_string();
    Error::invalid_params().data(json!({
        "method": method,
        "path": path,
        "reason": e.inner().to_string(),
    }))
}

/// An -32602 error with a human message in `data.reason`.
pub fn invalid_params(reason: impl Into<String>) -> Error {
    let reason = reason.into();
    Error::new(-32602, format!("Invalid params: {reason}")).data(json!({ "reason": reason }))
}

/// An -32603 error with a message that says what to do.
pub fn internal(reason: impl Into<String>) -> Error {
    let reason = reason.into();
    Error::new(-32603, format!("Internal error: {reason}")).data(json!({ "reason": reason }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct P {
        outer: Inner,
    }
    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        count: u32,
    }

    #[test]
    fn invalid_params_carry_the_serde_path() {
        let err = match decode_params::<P>("x/y", &json!({"outer": {"count": "nope"}})) {
            Ok(p) => panic!("decoded {p:?}"),
            Err(e) => e,
        };
        assert_eq!(i32::from(err.code), -32602);
        assert_eq!(err.data.as_ref().and_then(|d| d.get("path")), Some(&json!("outer.count")));
    }
}
