//! Bounded output: head-and-tail capture for streams, and a cap for model input.

/// Keeps the first and last `keep` bytes of a stream and counts the rest.
#[derive(Debug)]
pub struct HeadTail {
    keep: usize,
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: usize,
}

impl HeadTail {
    pub fn new(keep: usize) -> HeadTail {
        HeadTail { keep, head: Vec::new(), tail: std::collections::VecDeque::new(), total: 0 }
    }

    pub fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len();
        let room = self.keep.saturating_sub(self.head.len());
        let take = room.min(bytes.len());
        self.head.extend_from_slice(&bytes[..take]);
        bytes = &bytes[take..];
        if bytes.len() >= self.keep {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - self.keep..]);
        } else {
            let overflow = (self.tail.len() + bytes.len()).saturating_sub(self.keep);
            self.tail.drain(..overflow);
            self.tail.extend(bytes);
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// The kept text, with a note where the middle was elided.
    pub fn render(&self) -> String {
        let head = String::from_utf8_lossy(&self.head);
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        let tail = String::from_utf8_lossy(&tail);
        let elided = self.total - self.head.len() - self.tail.len();
        if elided == 0 { format!("{head}{tail}") } else { format!("{head}\n[... {elided} bytes elided ...]\n{tail}") }
    }
}

/// `text` cut to at most `limit` bytes (on a char boundary) with a note saying so.
pub fn cap(text: String, limit: usize) -> String {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n[output truncated: {} of {} bytes shown]", &text[..end], end, text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_and_tail_keep_the_ends() {
        let mut h = HeadTail::new(4);
        for chunk in [&b"abc"[..], b"defgh", b"ij", b"klmnop"] {
            h.push(chunk);
        }
        assert_eq!(h.total(), 16);
        assert_eq!(h.render(), "abcd\n[... 8 bytes elided ...]\nmnop");
        let mut small = HeadTail::new(8);
        small.push(b"hello");
        small.push(b" world");
        assert_eq!(small.render(), "hello world");
    }

    #[test]
    fn cap_cuts_on_a_char_boundary_with_a_note() {
        assert_eq!(cap("short".into(), 10), "short");
        let capped = cap("ééééé".into(), 5);
        assert!(capped.starts_with("éé\n[output truncated: 4 of 10 bytes shown]"), "{capped}");
    }
}
