//! Renders scripted steps in each provider's streaming wire format.
//!
//! One script, four dialects: OpenAI Chat Completions (pier, llama.cpp, vLLM…),
//! OpenAI Responses (codex), Anthropic Messages (Claude Code), and Gemini
//! `streamGenerateContent` (gemini-cli). Encoders are incremental so a stream can
//! hang, wait at a gate or be cut between any two steps.

use serde_json::{Value, json};

use crate::Step;

/// The wire format of a request, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Responses,
    AnthropicMessages,
    GeminiStream,
    /// A non-streaming `:generateContent` call (gemini-cli's model router and checks).
    GeminiGenerate,
}

impl Api {
    pub fn from_path(path: &str) -> Option<Api> {
        let path = path.split('?').next().unwrap_or(path);
        if path.ends_with("/chat/completions") {
            Some(Api::ChatCompletions)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else if path.ends_with("/messages") {
            Some(Api::AnthropicMessages)
        } else if path.contains(":streamGenerateContent") {
            Some(Api::GeminiStream)
        } else if path.contains(":generateContent") {
            Some(Api::GeminiGenerate)
        } else {
            None
        }
    }
}

#[derive(Default)]
struct Call {
    id: String,
    name: String,
    args: String,
}

/// Incremental encoder state for one response.
pub struct Encoder {
    api: Api,
    text: String,
    calls: Vec<Call>,
    finish: Option<String>,
    usage: (u64, u64),
    /// Anthropic: the open content block index and whether it is text.
    block: Option<(usize, bool)>,
    next_block: usize,
    /// Responses: whether the message item was announced ([`Encoder::open_message`]).
    message_open: bool,
    /// The usage the bytes written so far reported: `(input, output)`.
    pub reported: Option<(u64, u64)>,
}

fn sse(event: Option<&str>, data: &Value) -> String {
    match event {
        Some(e) => format!("event: {e}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

impl Encoder {
    pub fn new(api: Api) -> Encoder {
        Encoder {
            api,
            text: String::new(),
            calls: Vec::new(),
            finish: None,
            usage: (10, 5),
            block: None,
            next_block: 0,
            message_open: false,
            reported: None,
        }
    }

    /// The usage the answer reports (before [`Encoder::begin`]: Anthropic's opening carries input).
    pub fn set_usage(&mut self, prompt: u64, completion: u64) {
        self.usage = (prompt, completion);
    }

    /// What opens the stream.
    pub fn begin(&mut self) -> String {
        match self.api {
            Api::Responses => sse(
                Some("response.created"),
                &json!({"type": "response.created", "response": {"id": "resp_fake", "status": "in_progress", "output": []}}),
            ),
            Api::AnthropicMessages => sse(
                Some("message_start"),
                &json!({"type": "message_start", "message": {
                    "id": "msg_fake", "type": "message", "role": "assistant", "model": "fake-model", "content": [],
                    "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": self.usage.0, "output_tokens": 1}}}),
            ),
            _ => String::new(),
        }
    }

    /// The bytes for one step.
    pub fn step(&mut self, step: &Step) -> String {
        match step {
            Step::Comment(c) => format!(": {c}\n\n"),
            Step::Data(v) => sse(None, v),
            Step::Usage { prompt, completion } => {
                self.usage = (*prompt, *completion);
                match self.api {
                    Api::ChatCompletions => {
                        self.reported = Some(self.usage);
                        sse(None, &chat_usage(*prompt, *completion))
                    }
                    _ => String::new(),
                }
            }
            Step::Text(t) => {
                self.text.push_str(t);
                match self.api {
                    Api::ChatCompletions => sse(None, &chat(json!({"role": "assistant", "content": t}), Value::Null)),
                    Api::Responses => sse(
                        Some("response.output_text.delta"),
                        &json!({"type": "response.output_text.delta", "item_id": "msg_fake", "output_index": 0, "content_index": 0, "delta": t}),
                    ),
                    Api::AnthropicMessages => {
                        let mut out = self.open_block(true, &json!({"type": "text", "text": ""}));
                        let (index, _) = self.block.unwrap_or((0, true));
                        out.push_str(&sse(
                            Some("content_block_delta"),
                            &json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}}),
                        ));
                        out
                    }
                    Api::GeminiStream | Api::GeminiGenerate => sse(None, &gemini(json!([{"text": t}]), None, None)),
                }
            }
            Step::Reasoning(t) => match self.api {
                Api::ChatCompletions => sse(None, &chat(json!({"reasoning_content": t}), Value::Null)),
                _ => String::new(),
            },
            Step::Refusal(t) => match self.api {
                Api::ChatCompletions => sse(None, &chat(json!({"refusal": t}), Value::Null)),
                _ => {
                    self.text.push_str(t);
                    self.finish = Some("content_filter".into());
                    String::new()
                }
            },
            Step::ToolCallStart { index, id, name } => {
                self.calls.push(Call { id: id.clone(), name: name.clone(), args: String::new() });
                match self.api {
                    Api::ChatCompletions => sse(
                        None,
                        &chat(
                            json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                            Value::Null,
                        ),
                    ),
                    Api::AnthropicMessages => {
                        self.open_block(false, &json!({"type": "tool_use", "id": id, "name": name, "input": {}}))
                    }
                    _ => String::new(),
                }
            }
            Step::ToolCallArgs { index, fragment } => {
                if let Some(call) = self.calls.get_mut(*index as usize) {
                    call.args.push_str(fragment);
                }
                match self.api {
                    Api::ChatCompletions => sse(
                        None,
                        &chat(
                            json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}),
                            Value::Null,
                        ),
                    ),
                    Api::AnthropicMessages => {
                        let (block, _) = self.block.unwrap_or((0, false));
                        sse(
                            Some("content_block_delta"),
                            &json!({"type": "content_block_delta", "index": block, "delta": {"type": "input_json_delta", "partial_json": fragment}}),
                        )
                    }
                    _ => String::new(),
                }
            }
            Step::Finish(reason) => {
                self.finish = Some(reason.clone());
                match self.api {
                    Api::ChatCompletions => sse(None, &chat(json!({}), json!(reason))),
                    _ => String::new(),
                }
            }
            Step::Done => self.done(),
            Step::Tokens { text, count } => {
                let mut out = self.open_message();
                for _ in 0..*count {
                    out.push_str(&self.step(&Step::Text(text.clone())));
                }
                out
            }
            Step::Hang | Step::Cut | Step::Pause(_) | Step::Gate(_) => String::new(),
        }
    }

    /// What announces the message a run of [`Step::Tokens`] streams into, once: OpenAI
    /// Responses' `response.output_item.added` and `response.content_part.added` (codex drops
    /// text deltas without them). Empty for the other dialects and after the first time.
    pub(crate) fn open_message(&mut self) -> String {
        if self.api != Api::Responses || self.message_open {
            return String::new();
        }
        self.message_open = true;
        let mut out = sse(
            Some("response.output_item.added"),
            &json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": "msg_fake",
                "role": "assistant", "status": "in_progress", "content": []}}),
        );
        out.push_str(&sse(
            Some("response.content_part.added"),
            &json!({"type": "response.content_part.added", "item_id": "msg_fake", "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
        ));
        out
    }

    /// Counts `t` as streamed text without encoding it (for a delta whose bytes are reused).
    pub(crate) fn note_text(&mut self, t: &str) {
        self.text.push_str(t);
    }

    fn open_block(&mut self, text: bool, start: &Value) -> String {
        if let Some((_, is_text)) = self.block
            && is_text == text
            && text
        {
            return String::new();
        }
        let mut out = self.close_block();
        let index = self.next_block;
        self.next_block += 1;
        self.block = Some((index, text));
        out.push_str(&sse(
            Some("content_block_start"),
            &json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        out
    }

    fn close_block(&mut self) -> String {
        match self.block.take() {
            Some((index, _)) => sse(Some("content_block_stop"), &json!({"type": "content_block_stop", "index": index})),
            None => String::new(),
        }
    }

    fn done(&mut self) -> String {
        let (input, output) = self.usage;
        if self.api != Api::ChatCompletions {
            self.reported = Some(self.usage);
        }
        match self.api {
            Api::ChatCompletions => "data: [DONE]\n\n".to_owned(),
            Api::Responses => {
                let mut out = String::new();
                let mut items = Vec::new();
                if !self.text.is_empty() {
                    items.push(json!({"type": "message", "id": "msg_fake", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": self.text, "annotations": []}]}));
                }
                for c in &self.calls {
                    let mut item = json!({"type": "function_call", "id": format!("fc_{}", c.id), "call_id": c.id,
                        "name": c.name, "arguments": c.args, "status": "completed"});
                    // `NAMESPACE/TOOL`: a tool of a Responses `namespace` (codex offers each MCP
                    // server's tools as one), called by its own name within it.
                    if let Some((namespace, name)) = c.name.split_once('/') {
                        item["namespace"] = json!(namespace);
                        item["name"] = json!(name);
                    }
                    items.push(item);
                }
                for (i, item) in items.iter().enumerate() {
                    out.push_str(&sse(
                        Some("response.output_item.done"),
                        &json!({"type": "response.output_item.done", "output_index": i, "item": item}),
                    ));
                }
                out.push_str(&sse(
                    Some("response.completed"),
                    &json!({"type": "response.completed", "response": {"id": "resp_fake", "status": "completed", "output": items,
                        "usage": {"input_tokens": input, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input + output}}}),
                ));
                out
            }
            Api::AnthropicMessages => {
                let mut out = self.close_block();
                let stop = match self.finish.as_deref() {
                    Some("tool_calls") => "tool_use",
                    Some("length") => "max_tokens",
                    Some("content_filter") => "refusal",
                    _ if !self.calls.is_empty() => "tool_use",
                    _ => "end_turn",
                };
                out.push_str(&sse(
                    Some("message_delta"),
                    &json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": output}}),
                ));
                out.push_str(&sse(Some("message_stop"), &json!({"type": "message_stop"})));
                out
            }
            Api::GeminiStream | Api::GeminiGenerate => {
                let parts: Vec<Value> = self
                    .calls
                    .iter()
                    .map(|c| json!({"functionCall": {"name": c.name, "args": serde_json::from_str::<Value>(&c.args).unwrap_or(json!({}))}}))
                    .collect();
                let finish = match self.finish.as_deref() {
                    Some("length") => "MAX_TOKENS",
                    Some("content_filter") => "SAFETY",
                    _ => "STOP",
                };
                let parts = if parts.is_empty() { json!([{"text": ""}]) } else { Value::Array(parts) };
                sse(None, &gemini(parts, Some(finish), Some((input, output))))
            }
        }
    }
}

fn chat(delta: Value, finish: Value) -> Value {
    json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
        "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
    })
}

fn chat_usage(prompt: u64, completion: u64) -> Value {
    json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "choices": [],
        "usage": { "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion },
    })
}

fn gemini(parts: Value, finish: Option<&str>, usage: Option<(u64, u64)>) -> Value {
    let mut candidate = json!({"content": {"role": "model", "parts": parts}, "index": 0});
    if let Some(f) = finish {
        candidate["finishReason"] = json!(f);
    }
    let mut v = json!({"candidates": [candidate], "modelVersion": "fake-model"});
    if let Some((p, c)) = usage {
        v["usageMetadata"] = json!({"promptTokenCount": p, "candidatesTokenCount": c, "totalTokenCount": p + c});
    }
    v
}

/// An answer to a request that is not part of the conversation being scripted
/// (title generation, model routing): text in the API's non-streaming or streaming form.
pub fn auxiliary(api: Api, streaming: bool) -> (String, String, Option<(u64, u64)>) {
    match api {
        Api::GeminiGenerate => (
            "application/json".into(),
            gemini(
                json!([{"text": "{\"reasoning\": \"a simple request\", \"model_choice\": \"flash\"}"}]),
                Some("STOP"),
                Some((10, 5)),
            )
            .to_string(),
            Some((10, 5)),
        ),
        Api::AnthropicMessages if !streaming => (
            "application/json".into(),
            json!({"id": "msg_aux", "type": "message", "role": "assistant", "model": "fake-model",
                "content": [{"type": "text", "text": "Fake session"}], "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": 10, "output_tokens": 2}})
            .to_string(),
            Some((10, 2)),
        ),
        _ => {
            let mut e = Encoder::new(api);
            let mut body = e.begin();
            for s in [Step::Text("Fake session".into()), Step::Finish("stop".into()), Step::Done] {
                body.push_str(&e.step(&s));
            }
            ("text/event-stream".into(), body, e.reported)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(api: Api, steps: &[Step]) -> Vec<Value> {
        let mut e = Encoder::new(api);
        let mut out = e.begin();
        for s in steps {
            out.push_str(&e.step(s));
        }
        out.split("\n\n")
            .filter_map(|frame| frame.lines().find_map(|l| l.strip_prefix("data: ")))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
            .collect()
    }

    fn tool_script() -> Vec<Step> {
        vec![
            Step::Text("Let me run it.".into()),
            Step::ToolCallStart { index: 0, id: "call_1".into(), name: "Bash".into() },
            Step::ToolCallArgs { index: 0, fragment: "{\"command\":".into() },
            Step::ToolCallArgs { index: 0, fragment: "\"ls\"}".into() },
            Step::Finish("tool_calls".into()),
            Step::Done,
        ]
    }

    #[test]
    fn tokens_render_as_that_many_text_steps() {
        for api in [Api::ChatCompletions, Api::Responses, Api::AnthropicMessages, Api::GeminiStream] {
            let many: Vec<Step> = std::iter::repeat_n(Step::Text("tok ".into()), 3).chain([Step::Done]).collect();
            let tokens = [Step::Tokens { text: "tok ".into(), count: 3 }, Step::Done];
            let mut want = events(api, &many);
            let got = events(api, &tokens);
            if api == Api::Responses {
                // Tokens announce their message item first, as OpenAI does.
                let types: Vec<&str> = got[1..3].iter().map(|e| e["type"].as_str().unwrap_or("")).collect();
                assert_eq!(types, ["response.output_item.added", "response.content_part.added"]);
                want.splice(1..1, got[1..3].iter().cloned());
            }
            assert_eq!(got, want, "{api:?}");
        }
    }

    #[test]
    fn routes_by_path() {
        assert_eq!(Api::from_path("/v1/chat/completions"), Some(Api::ChatCompletions));
        assert_eq!(Api::from_path("/v1/responses"), Some(Api::Responses));
        assert_eq!(Api::from_path("/v1/messages?beta=true"), Some(Api::AnthropicMessages));
        assert_eq!(Api::from_path("/v1beta/models/m:streamGenerateContent?alt=sse"), Some(Api::GeminiStream));
        assert_eq!(Api::from_path("/v1beta/models/m:generateContent"), Some(Api::GeminiGenerate));
        assert_eq!(Api::from_path("/v1/models"), None);
    }

    #[test]
    fn anthropic_streams_blocks_and_a_tool_use_stop() {
        let types: Vec<String> = events(Api::AnthropicMessages, &tool_script())
            .iter()
            .map(|e| {
                let t = e["type"].as_str().unwrap_or("").to_owned();
                match e["delta"]["type"].as_str().or(e["content_block"]["type"].as_str()) {
                    Some(sub) => format!("{t}:{sub}"),
                    None => t,
                }
            })
            .collect();
        assert_eq!(
            types,
            [
                "message_start",
                "content_block_start:text",
                "content_block_delta:text_delta",
                "content_block_stop",
                "content_block_start:tool_use",
                "content_block_delta:input_json_delta",
                "content_block_delta:input_json_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        let all = events(Api::AnthropicMessages, &tool_script());
        assert_eq!(all[8]["delta"]["stop_reason"], "tool_use");
    }

    #[test]
    fn responses_end_with_items_and_completed() {
        let all = events(Api::Responses, &tool_script());
        assert_eq!(all[0]["type"], "response.created");
        assert_eq!(all[1]["type"], "response.output_text.delta");
        let done: Vec<&Value> = all.iter().filter(|e| e["type"] == "response.output_item.done").collect();
        assert_eq!(done[0]["item"]["content"][0]["text"], "Let me run it.");
        assert_eq!(done[1]["item"]["type"], "function_call");
        assert_eq!(done[1]["item"]["arguments"], "{\"command\":\"ls\"}");
        assert_eq!(done[1]["item"]["call_id"], "call_1");
        assert_eq!(all.last().map(|e| e["type"].clone()), Some(json!("response.completed")));
        let mut namespaced = tool_script();
        namespaced[1] = Step::ToolCallStart { index: 0, id: "call_1".into(), name: "mcp__notes/echo".into() };
        let all = events(Api::Responses, &namespaced);
        let done = all.iter().rfind(|e| e["type"] == "response.output_item.done").cloned().unwrap_or_default();
        assert_eq!((&done["item"]["namespace"], &done["item"]["name"]), (&json!("mcp__notes"), &json!("echo")));
    }

    #[test]
    fn gemini_sends_text_then_a_parsed_function_call() {
        let all = events(Api::GeminiStream, &tool_script());
        assert_eq!(all[0]["candidates"][0]["content"]["parts"][0]["text"], "Let me run it.");
        let last = &all[all.len() - 1]["candidates"][0];
        assert_eq!(last["content"]["parts"][0]["functionCall"], json!({"name": "Bash", "args": {"command": "ls"}}));
        assert_eq!(last["finishReason"], "STOP");
    }
}
