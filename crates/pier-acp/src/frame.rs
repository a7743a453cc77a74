//! Newline-delimited framing: one JSON-RPC message per `\n`, bounded in size.
//!
//! The reader owns the only buffer that grows with input, and it never grows past
//! the configured maximum frame size: a longer line is consumed and discarded in
//! place and reported as [`Frame::Oversized`], so a hostile or broken peer cannot
//! make us allocate without bound.

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWrite, AsyncWriteExt};

/// The default maximum size of one frame: 64 MiB.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// One unit read off the wire.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// A complete line without its `\n` (and without a trailing `\r`).
    Line(Vec<u8>),
    /// A line longer than the limit; its bytes were skipped. `len` counts them.
    Oversized { len: usize },
}

/// Reads [`Frame`]s from any buffered async reader.
pub struct FrameReader<R> {
    reader: R,
    max_frame_bytes: usize,
    line: Vec<u8>,
}

impl<R: AsyncBufRead + Unpin> FrameReader<R> {
    pub fn new(reader: R, max_frame_bytes: usize) -> Self {
        Self { reader, max_frame_bytes: max_frame_bytes.max(1), line: Vec::new() }
    }

    /// Returns the next frame, or `None` at end of input.
    ///
    /// Blank lines are skipped. Bytes after the last `\n` at end of input are
    /// treated as a final frame, since a peer that exits without a trailing
    /// newline still meant its last message.
    pub async fn next_frame(&mut self) -> std::io::Result<Option<Frame>> {
        loop {
            match self.read_line().await? {
                None => return Ok(None),
                Some(Frame::Line(line)) if line.iter().all(u8::is_ascii_whitespace) => continue,
                Some(frame) => return Ok(Some(frame)),
            }
        }
    }

    async fn read_line(&mut self) -> std::io::Result<Option<Frame>> {
        self.line.clear();
        let mut skipped: Option<usize> = None;
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                // End of input.
                if let Some(len) = skipped {
                    return Ok(Some(Frame::Oversized { len }));
                }
                if self.line.is_empty() {
                    return Ok(None);
                }
                return Ok(Some(Frame::Line(self.take_line())));
            }
            let (chunk, found_newline) = match memchr_newline(available) {
                Some(pos) => (&available[..pos], Some(pos)),
                None => (available, None),
            };
            match skipped.as_mut() {
                Some(len) => *len += chunk.len(),
                None if self.line.len() + chunk.len() > self.max_frame_bytes => {
                    skipped = Some(self.line.len() + chunk.len());
                    self.line = Vec::new();
                }
                None => self.line.extend_from_slice(chunk),
            }
            let consumed = found_newline.map_or(chunk.len(), |pos| pos + 1);
            self.reader.consume(consumed);
            if found_newline.is_some() {
                return Ok(Some(match skipped {
                    Some(len) => Frame::Oversized { len },
                    None => Frame::Line(self.take_line()),
                }));
            }
        }
    }

    fn take_line(&mut self) -> Vec<u8> {
        let mut line = std::mem::take(&mut self.line);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        line
    }

    /// The capacity currently held by the line buffer; for memory-bound tests.
    pub fn buffered_capacity(&self) -> usize {
        self.line.capacity()
    }
}

fn memchr_newline(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'\n')
}

/// Writes one compact JSON message followed by `\n`.
///
/// `serde_json` escapes control characters inside strings, so a serialised value
/// never contains a raw newline and the framing invariant holds by construction.
pub async fn write_frame<W: AsyncWrite + Unpin>(writer: &mut W, frame: &[u8]) -> std::io::Result<()> {
    writer.write_all(frame).await?;
    writer.write_all(b"\n").await
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio::io::BufReader;

    async fn frames(input: &[u8], max: usize, cap: usize) -> Vec<Frame> {
        let reader = BufReader::with_capacity(cap, input);
        let mut r = FrameReader::new(reader, max);
        let mut out = Vec::new();
        while let Ok(Some(f)) = r.next_frame().await {
            assert!(r.buffered_capacity() <= max.max(cap) * 2 + 64);
            out.push(f);
        }
        out
    }

    fn rt() -> tokio::runtime::Runtime {
        match tokio::runtime::Builder::new_current_thread().build() {
            Ok(rt) => rt,
            Err(e) => panic!("runtime: {e}"),
        }
    }

    #[test]
    fn splits_lines_and_strips_cr() {
        let got = rt().block_on(frames(b"{\"a\":1}\r\n\n{\"b\":2}\n{\"c\":3}", 100, 4));
        assert_eq!(
            got,
            vec![
                Frame::Line(b"{\"a\":1}".to_vec()),
                Frame::Line(b"{\"b\":2}".to_vec()),
                Frame::Line(b"{\"c\":3}".to_vec()),
            ]
        );
    }

    #[test]
    fn oversized_line_is_skipped_and_the_next_one_survives() {
        let mut input = vec![b'x'; 1000];
        input.push(b'\n');
        input.extend_from_slice(b"ok\n");
        let got = rt().block_on(frames(&input, 16, 8));
        assert_eq!(got, vec![Frame::Oversized { len: 1000 }, Frame::Line(b"ok".to_vec())]);
    }

    #[test]
    fn a_line_of_exactly_the_limit_is_accepted() {
        let got = rt().block_on(frames(b"0123456789\n", 10, 3));
        assert_eq!(got, vec![Frame::Line(b"0123456789".to_vec())]);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_stay_bounded(
            input in proptest::collection::vec(any::<u8>(), 0..4096),
            max in 1usize..256,
            cap in 1usize..64,
        ) {
            let got = rt().block_on(frames(&input, max, cap));
            for f in got {
                if let Frame::Line(l) = f {
                    prop_assert!(l.len() <= max);
                    prop_assert!(!l.contains(&b'\n'));
                }
            }
        }
    }
}
