//! A Server-Sent Events decoder for streamed model responses.
//!
//! Written here rather than taken from a crate so that it can bound its memory:
//! a line longer than `max_line_bytes` is an error, not an ever-growing buffer.

/// Decodes SSE bytes into the `data` payloads of complete events.
pub struct SseDecoder {
    buf: Vec<u8>,
    data: String,
    has_data: bool,
    max_line_bytes: usize,
}

/// The stream carried a line longer than the limit.
#[derive(Debug, PartialEq, Eq)]
pub struct LineTooLong(pub usize);

impl SseDecoder {
    pub fn new(max_line_bytes: usize) -> Self {
        Self { buf: Vec::new(), data: String::new(), has_data: false, max_line_bytes }
    }

    /// Feeds bytes; returns the data of every event they completed, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, LineTooLong> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(pos) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos;
            let mut line = &self.buf[start..end];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            let line = String::from_utf8_lossy(line).into_owned();
            start = end + 1;
            self.line(&line, &mut events);
        }
        self.buf.drain(..start);
        if self.buf.len() > self.max_line_bytes {
            return Err(LineTooLong(self.buf.len()));
        }
        Ok(events)
    }

    /// Ends the stream; returns a last event left without its blank line.
    pub fn finish(&mut self) -> Option<String> {
        let rest = std::mem::take(&mut self.buf);
        let mut events = Vec::new();
        if !rest.is_empty() {
            self.line(String::from_utf8_lossy(&rest).trim_end_matches('\r'), &mut events);
        }
        self.line("", &mut events);
        events.pop()
    }

    fn line(&mut self, line: &str, events: &mut Vec<String>) {
        if line.is_empty() {
            if self.has_data {
                events.push(std::mem::take(&mut self.data));
                self.has_data = false;
            }
            return;
        }
        if line.starts_with(':') {
            return; // A comment, as keep-alives are sent.
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(value);
            self.has_data = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_events_split_anywhere() {
        let input = b": keep-alive\n\ndata: {\"a\":1}\r\n\r\ndata: x\ndata: y\n\nevent: e\ndata: [DONE]\n\n";
        for cut in 0..input.len() {
            let mut d = SseDecoder::new(1024);
            let mut got = d.push(&input[..cut]).unwrap_or_default();
            got.extend(d.push(&input[cut..]).unwrap_or_default());
            assert_eq!(got, vec!["{\"a\":1}", "x\ny", "[DONE]"], "cut at {cut}");
        }
    }

    #[test]
    fn a_trailing_event_without_blank_line_is_kept() {
        let mut d = SseDecoder::new(1024);
        assert_eq!(d.push(b"data: last"), Ok(vec![]));
        assert_eq!(d.finish(), Some("last".to_owned()));
    }

    #[test]
    fn an_endless_line_is_an_error() {
        let mut d = SseDecoder::new(16);
        assert_eq!(d.push(&[b'x'; 32]), Err(LineTooLong(32)));
    }
}
