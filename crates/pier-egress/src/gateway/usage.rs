//! Token counts read from the upstream's own answer, as the bytes pass: each API's usage
//! report (the final usage chunk of a Chat Completions stream, Anthropic's `message_start`
//! and `message_delta`, the Responses API's `response.completed`, Gemini's `usageMetadata`),
//! whether the answer is streamed as server-sent events or sent whole.
//!
//! The reader never holds more than one event (or one whole answer) and never changes a byte;
//! what it cannot parse it counts as unparsed, so an odd answer is still delivered and the
//! request is recorded with what was seen.

use serde::Serialize;
use serde_json::Value;

/// Longest server-sent event (or whole non-streamed answer) the reader parses; a longer one is
/// passed through uncounted, so one huge answer cannot grow the gateway's memory without bound.
pub const MAX_EVENT_BYTES: usize = 8 << 20;

/// Which wire format a route speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// OpenAI Chat Completions and Responses (told apart by the answer's shape).
    OpenAi,
    /// Anthropic Messages.
    Anthropic,
    /// Gemini `generateContent` / `streamGenerateContent`.
    Gemini,
}

/// Tokens of one request. `input` counts every prompt token, cached ones included;
/// `reasoning` is part of `output`, as the providers bill it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Usage {
    pub input: u64,
    pub cached_input: u64,
    pub output: u64,
    pub reasoning: u64,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.input + self.output
    }

    pub fn add(&mut self, other: &Usage) {
        self.input += other.input;
        self.cached_input += other.cached_input;
        self.output += other.output;
        self.reasoning += other.reasoning;
    }
}

/// Reads one answer's bytes as they pass.
#[derive(Debug)]
pub struct Reader {
    api: Api,
    sse: bool,
    buf: Vec<u8>,
    /// The current event's `data:` lines (SSE).
    data: Vec<u8>,
    overflow: bool,
    pub usage: Option<Usage>,
    pub model: Option<String>,
    /// Events (or answers) that were not JSON or too long to read.
    pub unparsed: u32,
    /// Anthropic reports input at the start and output at the end: kept apart until then.
    anthropic: Usage,
}

impl Reader {
    /// A reader for an answer of `api`; `sse` when its content type is `text/event-stream`.
    pub fn new(api: Api, sse: bool) -> Reader {
        Reader {
            api,
            sse,
            buf: Vec::new(),
            data: Vec::new(),
            overflow: false,
            usage: None,
            model: None,
            unparsed: 0,
            anthropic: Usage::default(),
        }
    }

    /// Takes in the next bytes of the answer.
    pub fn feed(&mut self, bytes: &[u8]) {
        if !self.sse {
            if self.buf.len() + bytes.len() > MAX_EVENT_BYTES {
                self.overflow = true;
                self.buf = Vec::new();
            } else if !self.overflow {
                self.buf.extend_from_slice(bytes);
            }
            return;
        }
        let mut rest = bytes;
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            let (line, after) = rest.split_at(i);
            rest = &after[1..];
            if self.buf.is_empty() {
                self.line(line);
            } else {
                let mut whole = std::mem::take(&mut self.buf);
                whole.extend_from_slice(line);
                self.line(&whole);
            }
        }
        if self.buf.len() + rest.len() > MAX_EVENT_BYTES {
            self.overflow = true;
            self.buf.clear();
        } else {
            self.buf.extend_from_slice(rest);
        }
    }

    /// The answer ended (whole or not): reads what is left.
    pub fn finish(&mut self) {
        if self.sse {
            let rest = std::mem::take(&mut self.buf);
            if !rest.is_empty() {
                self.line(&rest);
            }
            self.dispatch();
            return;
        }
        if self.overflow {
            self.unparsed += 1;
            return;
        }
        let body = std::mem::take(&mut self.buf);
        if body.is_empty() {
            return;
        }
        match serde_json::from_slice::<Value>(&body) {
            // Gemini's streamed answer without `alt=sse` is one JSON array of chunks.
            Ok(Value::Array(chunks)) => chunks.iter().for_each(|c| self.take(c)),
            Ok(v) => self.take(&v),
            Err(_) => self.unparsed += 1,
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            self.dispatch();
        } else if let Some(data) = line.strip_prefix(b"data:") {
            let data = data.strip_prefix(b" ").unwrap_or(data);
            if self.overflow || self.data.len() + data.len() > MAX_EVENT_BYTES {
                self.overflow = true;
                self.data.clear();
                return;
            }
            if !self.data.is_empty() {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(data);
        }
    }

    fn dispatch(&mut self) {
        if std::mem::take(&mut self.overflow) {
            self.unparsed += 1;
            self.data.clear();
            return;
        }
        let data = std::mem::take(&mut self.data);
        if data.is_empty() || data == b"[DONE]" {
            return;
        }
        match serde_json::from_slice::<Value>(&data) {
            Ok(v) => self.take(&v),
            Err(_) => self.unparsed += 1,
        }
    }

    /// One JSON event or answer of the route's API.
    fn take(&mut self, v: &Value) {
        match self.api {
            Api::OpenAi => self.openai(v),
            Api::Anthropic => self.anthropic(v),
            Api::Gemini => self.gemini(v),
        }
    }

    fn openai(&mut self, v: &Value) {
        // The Responses API wraps its answer in `response.completed` (and its failures and
        // incomplete endings, which still report usage).
        let v = match v.get("type").and_then(Value::as_str) {
            Some(t) if t.starts_with("response.") => match v.get("response") {
                Some(r) => r,
                None => return,
            },
            _ => v,
        };
        self.model_from(v.get("model"));
        let Some(u) = v.get("usage").filter(|u| u.is_object()) else { return };
        let n = |path: &[&str]| path.iter().try_fold(u, |v, k| v.get(k)).and_then(Value::as_u64);
        self.usage = Some(if u.get("prompt_tokens").is_some() {
            Usage {
                input: n(&["prompt_tokens"]).unwrap_or(0),
                cached_input: n(&["prompt_tokens_details", "cached_tokens"]).unwrap_or(0),
                output: n(&["completion_tokens"]).unwrap_or(0),
                reasoning: n(&["completion_tokens_details", "reasoning_tokens"]).unwrap_or(0),
            }
        } else {
            Usage {
                input: n(&["input_tokens"]).unwrap_or(0),
                cached_input: n(&["input_tokens_details", "cached_tokens"]).unwrap_or(0),
                output: n(&["output_tokens"]).unwrap_or(0),
                reasoning: n(&["output_tokens_details", "reasoning_tokens"]).unwrap_or(0),
            }
        });
    }

    fn anthropic(&mut self, v: &Value) {
        let (message, usage) = match v.get("type").and_then(Value::as_str) {
            Some("message_start") => (v.get("message"), v.get("message").and_then(|m| m.get("usage"))),
            Some("message_delta") => (None, v.get("usage")),
            Some("message") => (Some(v), v.get("usage")),
            _ => return,
        };
        if let Some(m) = message {
            self.model_from(m.get("model"));
        }
        let Some(u) = usage else { return };
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        // `input_tokens` leaves out what was read from or written to the cache; the bill counts all.
        if let Some(input) = n("input_tokens") {
            let read = n("cache_read_input_tokens").unwrap_or(0);
            self.anthropic.input = input + read + n("cache_creation_input_tokens").unwrap_or(0);
            self.anthropic.cached_input = read;
        }
        // `output_tokens` of a `message_delta` is the running total, not an increment.
        if let Some(output) = n("output_tokens") {
            self.anthropic.output = output;
        }
        self.usage = Some(self.anthropic);
    }

    fn gemini(&mut self, v: &Value) {
        self.model_from(v.get("modelVersion"));
        // Each streamed chunk carries the totals so far; the last one holds them all.
        let Some(u) = v.get("usageMetadata") else { return };
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        let thoughts = n("thoughtsTokenCount");
        self.usage = Some(Usage {
            input: n("promptTokenCount"),
            cached_input: n("cachedContentTokenCount"),
            output: n("candidatesTokenCount") + thoughts,
            reasoning: thoughts,
        });
    }

    fn model_from(&mut self, v: Option<&Value>) {
        if let Some(m) = v.and_then(Value::as_str).filter(|m| !m.is_empty()) {
            self.model = Some(m.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(api: Api, sse: bool, chunks: &[&str]) -> Reader {
        let mut r = Reader::new(api, sse);
        for c in chunks {
            r.feed(c.as_bytes());
        }
        r.finish();
        r
    }

    #[test]
    fn a_chat_completions_stream_is_counted_from_its_usage_chunk_split_anywhere() {
        let stream = "data: {\"model\":\"gpt-x\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":30,\
                      \"prompt_tokens_details\":{\"cached_tokens\":100},\"completion_tokens_details\":{\"reasoning_tokens\":7}}}\n\n\
                      data: [DONE]\n\n";
        for cut in [1, 7, 50, 117, stream.len() - 3] {
            let r = read(Api::OpenAi, true, &[&stream[..cut], &stream[cut..]]);
            assert_eq!(r.usage, Some(Usage { input: 120, cached_input: 100, output: 30, reasoning: 7 }), "{cut}");
            assert_eq!(r.model.as_deref(), Some("gpt-x"));
            assert_eq!(r.unparsed, 0);
        }
    }

    #[test]
    fn the_responses_api_is_counted_from_response_completed() {
        let r = read(
            Api::OpenAi,
            true,
            &["event: response.created\ndata: {\"type\":\"response.created\",\"response\":{}}\n\n\
             event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"model\":\"o4\",\
             \"usage\":{\"input_tokens\":9,\"input_tokens_details\":{\"cached_tokens\":4},\"output_tokens\":3,\
             \"output_tokens_details\":{\"reasoning_tokens\":2}}}}\r\n\r\n"],
        );
        assert_eq!(r.usage, Some(Usage { input: 9, cached_input: 4, output: 3, reasoning: 2 }));
        assert_eq!(r.model.as_deref(), Some("o4"));
    }

    #[test]
    fn anthropic_input_comes_at_the_start_and_output_as_a_running_total() {
        let r = read(
            Api::Anthropic,
            true,
            &[
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-x\",\
             \"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":50,\"cache_creation_input_tokens\":5,\"output_tokens\":1}}}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":12}}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":40}}\n\n",
            ],
        );
        assert_eq!(r.usage, Some(Usage { input: 65, cached_input: 50, output: 40, reasoning: 0 }));
        assert_eq!(r.model.as_deref(), Some("claude-x"));
    }

    #[test]
    fn whole_answers_of_each_api_are_counted() {
        let r = read(Api::OpenAi, false, &[r#"{"model":"m","usage":{"prompt_tokens":3,"completion_tokens":4}}"#]);
        assert_eq!(r.usage, Some(Usage { input: 3, cached_input: 0, output: 4, reasoning: 0 }));
        let r = read(
            Api::Anthropic,
            false,
            &[r#"{"type":"message","model":"c","usage":{"input_tokens":5,"output_tokens":6}}"#],
        );
        assert_eq!(r.usage, Some(Usage { input: 5, cached_input: 0, output: 6, reasoning: 0 }));
        let r = read(
            Api::Gemini,
            false,
            &[
                r#"[{"usageMetadata":{"promptTokenCount":7,"candidatesTokenCount":1}},"#,
                r#"{"modelVersion":"gemini-x","usageMetadata":{"promptTokenCount":7,"candidatesTokenCount":8,"thoughtsTokenCount":2,"cachedContentTokenCount":3}}]"#,
            ],
        );
        assert_eq!(r.usage, Some(Usage { input: 7, cached_input: 3, output: 10, reasoning: 2 }));
        assert_eq!(r.model.as_deref(), Some("gemini-x"));
    }

    #[test]
    fn garbage_and_oversized_events_are_counted_as_unparsed_and_the_rest_still_read() {
        let big = format!("data: {}\n\n", "x".repeat(MAX_EVENT_BYTES + 10));
        let r = read(
            Api::OpenAi,
            true,
            &["data: {not json\n\n", &big, "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n"],
        );
        assert_eq!(r.unparsed, 2);
        assert_eq!(r.usage.map(|u| u.total()), Some(3));
        let r = read(Api::OpenAi, false, &["<html>bad gateway</html>"]);
        assert_eq!((r.unparsed, r.usage), (1, None));
    }
}
