//! A stdio server's stdout as the MCP transport reads it, watched for lines too long to read.
//!
//! rmcp's transport drops a line over its limit (16 MiB) and reads on, so the call that line
//! answered would wait for ever. [`Watched`] counts each line's length as the bytes pass and
//! moves a counter when one crosses the limit: the calls in flight on that server see it and
//! fail, saying why.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::watch;

/// The longest line the transport reads (rmcp's own limit, set on the transport to match).
pub(crate) const MAX_LINE: usize = 16 << 20;

/// `inner`, with a count of the lines over [`MAX_LINE`] so far.
pub(crate) struct Watched<R> {
    inner: R,
    /// Bytes of the current line so far.
    run: usize,
    /// Whether the current line was counted already.
    counted: bool,
    oversized: watch::Sender<u64>,
}

impl<R> Watched<R> {
    pub(crate) fn new(inner: R) -> (Watched<R>, watch::Receiver<u64>) {
        let (oversized, rx) = watch::channel(0);
        (Watched { inner, run: 0, counted: false, oversized }, rx)
    }

    fn see(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            // The transport counts the newline against its limit too.
            self.grow(end + 1);
            (self.run, self.counted) = (0, false);
            rest = &rest[end + 1..];
        }
        self.grow(rest.len());
    }

    fn grow(&mut self, n: usize) {
        self.run = self.run.saturating_add(n);
        if self.run > MAX_LINE && !self.counted {
            self.counted = true;
            self.oversized.send_modify(|n| *n += 1);
        }
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
        w.see(b"{\"short\":1}\n");
        assert_eq!(*rx.borrow(), 0);
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..17 {
            w.see(&chunk);
        }
        assert_eq!(*rx.borrow(), 1);
        w.see(b"still the same line\nnext\n");
        assert_eq!(*rx.borrow(), 1, "counted once");
        assert_eq!(w.run, 0);
    }
}
