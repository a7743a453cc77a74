//! A stdio server's stdout as the MCP transport reads it, watched for answers it will drop.
//!
//! rmcp's transport drops a line over its limit (16 MiB), and a line that does not decode as a
//! JSON-RPC message of the server, and reads on, so the call that line answered would wait for
//! its timeout. [`Watched`] follows each line as the bytes pass and, when one is too long or is
//! a malformed answer, says why on a watch: the calls in flight on that server see it and fail
//! at once, saying why. Lines that are not JSON objects at all (a server's stray log output) are
//! not answers and pass, as rmcp passes over them.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::watch;

/// The longest line the transport reads (rmcp's own limit, set on the transport to match).
pub(crate) const MAX_LINE: usize = 16 << 20;

/// A line kept past this capacity is given back once it has been looked at.
const KEEP_CAPACITY: usize = 1 << 20;

/// The last line of a server's stdout the transport drops, and how many there were so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Dropped {
    pub(crate) count: u64,
    /// What was wrong with the last one, as a clause: "was over 16 MiB", "is not valid MCP (…)".
    pub(crate) why: String,
}

/// `inner`, with each line the transport drops said on a watch.
pub(crate) struct Watched<R> {
    inner: R,
    /// The current line so far, up to [`MAX_LINE`].
    line: Vec<u8>,
    /// Bytes of the current line so far (it may be longer than `line` holds).
    run: usize,
    dropped: watch::Sender<Dropped>,
}

impl<R> Watched<R> {
    pub(crate) fn new(inner: R) -> (Watched<R>, watch::Receiver<Dropped>) {
        let (dropped, rx) = watch::channel(Dropped::default());
        (Watched { inner, line: Vec::new(), run: 0, dropped }, rx)
    }

    fn see(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            // The transport counts the newline against its limit too.
            self.grow(&rest[..=end]);
            self.line_ended();
            rest = &rest[end + 1..];
        }
        self.grow(rest);
    }

    fn grow(&mut self, bytes: &[u8]) {
        let before = self.run;
        self.run = self.run.saturating_add(bytes.len());
        if before <= MAX_LINE && self.run > MAX_LINE {
            self.drop_line(format!("was over {} MiB, which pier does not read", MAX_LINE >> 20));
            self.line = Vec::new();
        } else if self.run <= MAX_LINE {
            self.line.extend_from_slice(bytes);
        }
    }

    fn line_ended(&mut self) {
        if self.run <= MAX_LINE
            && let Some(why) = malformed(&self.line)
        {
            self.drop_line(why);
        }
        self.run = 0;
        self.line.clear();
        if self.line.capacity() > KEEP_CAPACITY {
            self.line = Vec::new();
        }
    }

    fn drop_line(&self, why: String) {
        self.dropped.send_modify(|d| {
            d.count += 1;
            d.why = why;
        });
    }
}

/// Why a whole line (its newline included) is an answer the transport drops, if it is one: a
/// JSON object that does not decode as a message of the server (rmcp's own type), or a line
/// that starts as one and is not JSON. A request or a notification of the server is not an
/// answer (rmcp answers or passes over those itself).
fn malformed(line: &[u8]) -> Option<String> {
    let text = line.strip_prefix(b"\xEF\xBB\xBF".as_slice()).unwrap_or(line);
    let text = text.trim_ascii();
    if !text.starts_with(b"{") {
        return None;
    }
    let e = serde_json::from_slice::<rmcp::model::ServerJsonRpcMessage>(text).err()?;
    match serde_json::from_slice::<serde_json::Value>(text) {
        Ok(v) if v.get("method").is_some() => None,
        Ok(_) => Some(format!("is not a valid MCP answer ({e})")),
        Err(e) => Some(format!("is not JSON ({e})")),
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Watched<R> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.see(&buf.filled()[before..]);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_over_the_limit_is_counted_once_wherever_it_is_cut() {
        let (mut w, rx) = Watched::new(());
        w.see(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n");
        assert_eq!(rx.borrow().count, 0);
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..17 {
            w.see(&chunk);
        }
        assert_eq!(rx.borrow().count, 1);
        assert!(rx.borrow().why.contains("over 16 MiB"), "{:?}", rx.borrow());
        w.see(b"still the same line\nnext\n");
        assert_eq!(rx.borrow().count, 1, "counted once");
        assert_eq!(w.run, 0);
        assert!(w.line.capacity() <= KEEP_CAPACITY, "the big line's buffer was given back");
    }

    #[test]
    fn a_malformed_answer_is_said_and_stray_output_or_requests_are_not() {
        let (mut w, rx) = Watched::new(());
        w.see(b"server started on stdio\n\n");
        w.see(b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/whatever\",\"params\":{\"x\":[1]}}\n");
        w.see(b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"sampling/createMessage\",\"params\":7}\n");
        w.see(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"res");
        w.see(b"ult\":{\"content\":[]}}\r\n");
        assert_eq!(rx.borrow().count, 0, "{:?}", rx.borrow());
        w.see(b"{this is not json\n");
        assert_eq!(rx.borrow().count, 1);
        assert!(rx.borrow().why.starts_with("is not JSON"), "{:?}", rx.borrow());
        w.see(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{\"content\":\"not a list\"},\"error\":5}\n");
        assert_eq!(rx.borrow().count, 2);
        assert!(rx.borrow().why.starts_with("is not a valid MCP answer"), "{:?}", rx.borrow());
    }
}
