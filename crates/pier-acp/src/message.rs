//! JSON-RPC 2.0 envelopes: classifying an incoming line and encoding outgoing ones.
//!
//! Classification is by shape of the envelope only (`method`, `id`, `result`,
//! `error`); params stay a [`serde_json::Value`] until a handler picks the typed
//! payload by method name.

use agent_client_protocol_schema::v1::{Error, RequestId};
use serde::Serialize;
use serde_json::{Map, Value};

/// A well-formed incoming JSON-RPC 2.0 message.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Request { id: RequestId, method: String, params: Value },
    Notification { method: String, params: Value },
    Response { id: RequestId, result: Result<Value, Error> },
}

/// Why a line is not a usable JSON-RPC 2.0 message, with the error to answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    /// The id to answer with: the message's own when it could be read, else null.
    pub id: RequestId,
    pub error: Error,
    /// False when the offending message was a notification, which never gets a reply.
    pub reply: bool,
}

/// Parses one frame into a [`Message`].
pub fn parse(line: &[u8]) -> Result<Message, Rejection> {
    let value: Value = serde_json::from_slice(line).map_err(|e| Rejection {
        id: RequestId::Null,
        error: Error::parse_error().data(Value::String(e.to_string())),
        reply: true,
    })?;
    classify(value)
}

fn invalid(id: RequestId, why: &str) -> Rejection {
    Rejection { id, error: Error::invalid_request().data(Value::String(why.to_owned())), reply: true }
}

fn classify(value: Value) -> Result<Message, Rejection> {
    let mut obj = match value {
        Value::Object(obj) => obj,
        Value::Array(_) => {
            return Err(invalid(RequestId::Null, "batch requests are not supported by ACP v1"));
        }
        _ => return Err(invalid(RequestId::Null, "a JSON-RPC message must be an object")),
    };
    let id = match obj.remove("id") {
        None => None,
        Some(raw) => {
            Some(parse_id(raw).ok_or_else(|| invalid(RequestId::Null, "`id` must be a string, an integer or null"))?)
        }
    };
    let answer_id = id.clone().unwrap_or(RequestId::Null);
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(invalid(answer_id, "`jsonrpc` must be \"2.0\""));
    }
    let params = obj.remove("params").unwrap_or(Value::Null);
    if !matches!(params, Value::Null | Value::Object(_) | Value::Array(_)) {
        return Err(Rejection { reply: id.is_some(), ..invalid(answer_id, "`params` must be an object or an array") });
    }
    match (obj.remove("method"), id) {
        (Some(Value::String(method)), Some(id)) => Ok(Message::Request { id, method, params }),
        (Some(Value::String(method)), None) => Ok(Message::Notification { method, params }),
        (Some(_), id) => Err(Rejection {
            reply: id.is_some(),
            ..invalid(id.unwrap_or(RequestId::Null), "`method` must be a string")
        }),
        (None, Some(id)) => classify_response(id, obj),
        (None, None) => Err(invalid(RequestId::Null, "a message needs `method` or `id`")),
    }
}

fn classify_response(id: RequestId, mut obj: Map<String, Value>) -> Result<Message, Rejection> {
    match (obj.remove("result"), obj.remove("error")) {
        (Some(result), None) => Ok(Message::Response { id, result: Ok(result) }),
        (None, Some(error)) => match serde_json::from_value::<Error>(error) {
            Ok(error) => Ok(Message::Response { id, result: Err(error) }),
            Err(_) => Err(invalid(id, "`error` must be an object with `code` and `message`")),
        },
        _ => Err(invalid(id, "a response needs exactly one of `result` and `error`")),
    }
}

fn parse_id(raw: Value) -> Option<RequestId> {
    match raw {
        Value::Null => Some(RequestId::Null),
        Value::String(s) => Some(RequestId::Str(s)),
        Value::Number(n) => n.as_i64().map(RequestId::Number),
        _ => None,
    }
}

#[derive(Serialize)]
struct RequestOut<'a, P> {
    jsonrpc: &'static str,
    id: &'a RequestId,
    method: &'a str,
    params: &'a P,
}

#[derive(Serialize)]
struct NotificationOut<'a, P> {
    jsonrpc: &'static str,
    method: &'a str,
    params: &'a P,
}

#[derive(Serialize)]
struct ResultOut<'a> {
    jsonrpc: &'static str,
    id: &'a RequestId,
    result: &'a Value,
}

#[derive(Serialize)]
struct ErrorOut<'a> {
    jsonrpc: &'static str,
    id: &'a RequestId,
    error: &'a Error,
}

pub fn encode_request<P: Serialize>(id: &RequestId, method: &str, params: &P) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&RequestOut { jsonrpc: "2.0", id, method, params })
}

pub fn encode_notification<P: Serialize>(method: &str, params: &P) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&NotificationOut { jsonrpc: "2.0", method, params })
}

pub fn encode_response(id: &RequestId, result: &Result<Value, Error>) -> serde_json::Result<Vec<u8>> {
    match result {
        Ok(result) => serde_json::to_vec(&ResultOut { jsonrpc: "2.0", id, result }),
        Err(error) => serde_json::to_vec(&ErrorOut { jsonrpc: "2.0", id, error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn code(r: Result<Message, Rejection>) -> i32 {
        match r {
            Ok(m) => panic!("expected a rejection, got {m:?}"),
            Err(r) => i32::from(r.error.code),
        }
    }

    #[test]
    fn classifies_the_three_shapes() {
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":1}}"#),
            Ok(Message::Request { id: RequestId::Number(1), method: "m".into(), params: json!({"a":1}) })
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","method":"n"}"#),
            Ok(Message::Notification { method: "n".into(), params: Value::Null })
        );
        assert_eq!(
            parse(br#"{"jsonrpc":"2.0","id":"x","result":null}"#),
            Ok(Message::Response { id: RequestId::Str("x".into()), result: Ok(Value::Null) })
        );
        let err = parse(br#"{"jsonrpc":"2.0","id":2,"error":{"code":-32601,"message":"no"}}"#);
        assert!(matches!(err, Ok(Message::Response { result: Err(_), .. })));
    }

    #[test]
    fn rejects_with_the_right_codes() {
        assert_eq!(code(parse(b"{not json")), -32700);
        assert_eq!(code(parse(b"[]")), -32600);
        assert_eq!(code(parse(b"42")), -32600);
        assert_eq!(code(parse(br#"{"id":1,"method":"m"}"#)), -32600);
        assert_eq!(code(parse(br#"{"jsonrpc":"1.0","id":1,"method":"m"}"#)), -32600);
        assert_eq!(code(parse(br#"{"jsonrpc":"2.0","id":1.5,"method":"m"}"#)), -32600);
        assert_eq!(code(parse(br#"{"jsonrpc":"2.0","id":1,"method":7}"#)), -32600);
        assert_eq!(code(parse(br#"{"jsonrpc":"2.0","id":1,"method":"m","params":3}"#)), -32600);
        assert_eq!(code(parse(br#"{"jsonrpc":"2.0","id":1}"#)), -32600);
        assert_eq!(code(parse(br#"{"jsonrpc":"2.0","id":1,"result":1,"error":{}}"#)), -32600);
    }

    #[test]
    fn a_rejection_keeps_the_id_when_it_was_readable() {
        let r = parse(br#"{"jsonrpc":"1.0","id":"abc","method":"m"}"#);
        assert!(matches!(r, Err(Rejection { id: RequestId::Str(ref s), .. }) if s == "abc"));
    }

    #[test]
    fn a_bad_notification_gets_no_reply() {
        let r = parse(br#"{"jsonrpc":"2.0","method":"m","params":"x"}"#);
        assert!(matches!(r, Err(Rejection { reply: false, .. })));
    }

    #[test]
    fn encodes_compact_frames() -> serde_json::Result<()> {
        let out = encode_notification("session/update", &json!({"text": "a\nb"}))?;
        assert_eq!(out, br#"{"jsonrpc":"2.0","method":"session/update","params":{"text":"a\nb"}}"#);
        let out = encode_response(&RequestId::Number(3), &Err(Error::method_not_found()))?;
        assert_eq!(out, br#"{"jsonrpc":"2.0","id":3,"error":{"code":-32601,"message":"Method not found"}}"#);
        Ok(())
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|f| json!(f)),
            ".{0,8}".prop_map(Value::String),
            Just(json!("2.0")),
            Just(json!("session/prompt")),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("jsonrpc".to_owned()),
                        Just("id".to_owned()),
                        Just("method".to_owned()),
                        Just("params".to_owned()),
                        Just("result".to_owned()),
                        Just("error".to_owned()),
                        "[a-z]{1,4}",
                    ],
                    inner,
                    0..6,
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn arbitrary_json_is_classified_or_rejected(value in arb_json()) {
            let bytes = serde_json::to_vec(&value).unwrap_or_default();
            match parse(&bytes) {
                Ok(_) => {}
                Err(r) => {
                    let c = i32::from(r.error.code);
                    prop_assert!(c == -32600 || c == -32700);
                }
            }
        }
    }
}
