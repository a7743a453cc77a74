//! `fs/read_text_file` and `fs/write_text_file`, inside the sandbox: files are
//! opened, created and renamed beneath a root's directory handle (pier-tools'
//! confined primitives), never by path. Reads stream: `line`/`limit` apply while
//! reading, so a huge file costs no more memory than the window asked for.

use std::io::BufRead;

use agent_client_protocol_schema::v1::{
    Error, ReadTextFileRequest, ReadTextFileResponse, WriteTextFileRequest, WriteTextFileResponse,
};
use pier_acp::error::internal;

use crate::sandbox::Sandbox;

pub async fn read_text_file(sandbox: &Sandbox, req: ReadTextFileRequest) -> Result<ReadTextFileResponse, Error> {
    let (root, path) = sandbox.locate(&req.path)?;
    let uri = format!("file://{}", path.display());
    let shown = path.display().to_string();
    let (line, limit) = (req.line, req.limit);
    let root = root.clone();
    let read = tokio::task::spawn_blocking(move || {
        let file = root.open_file(&path)?.file;
        read_window(std::io::BufReader::with_capacity(64 * 1024, file), line, limit)
    })
    .await
    .map_err(|e| internal(e.to_string()))?;
    match read {
        Ok(Ok(text)) => Ok(ReadTextFileResponse::new(text)),
        Ok(Err(Window::NotUtf8)) => Err(internal(format!("{shown} is not a UTF-8 text file"))),
        Ok(Err(Window::TooLarge)) => Err(internal(format!(
            "{shown} is larger than {} MiB; read it in parts with `line` and `limit`",
            MAX_ANSWER >> 20
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::resource_not_found(Some(uri))),
        Err(e) => Err(internal(format!("cannot read {shown}: {e}"))),
    }
}

/// The longest line a windowed read returns; the rest of a longer line is cut and marked.
pub const MAX_LINE: usize = 1 << 20;
/// The most text one read returns: a whole-file read of more is refused, a windowed
/// read stops there with a marker saying where to read on.
pub const MAX_ANSWER: usize = 16 << 20;

/// Why a read returned no text.
#[derive(Debug, PartialEq, Eq)]
pub enum Window {
    NotUtf8,
    /// A whole-file read (no `line`, no `limit`) of more than [`MAX_ANSWER`].
    TooLarge,
}

/// Lines `line..line+limit` (1-based, line endings kept) of `r`, read as a stream:
/// lines before the window are skipped without being kept, reading stops after the
/// window, and no more than [`MAX_LINE`] bytes of a line or [`MAX_ANSWER`] in all are
/// held. Without `line` and `limit` the whole text is returned exactly, or refused.
pub fn read_window(
    mut r: impl BufRead,
    line: Option<u32>,
    limit: Option<u32>,
) -> std::io::Result<Result<String, Window>> {
    let whole = line.is_none() && limit.is_none();
    let skip = u64::from(line.unwrap_or(1).max(1)) - 1;
    let take = limit.map_or(u64::MAX, u64::from);
    let mut out: Vec<u8> = Vec::new();
    // The line being read: its number (0-based), its kept bytes, whether it was cut.
    let (mut index, mut current, mut cut) = (0u64, Vec::new(), false);
    while index < skip.saturating_add(take) {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        let (n, ends) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if index >= skip && !cut {
            let room = if whole {
                MAX_ANSWER.saturating_sub(out.len() + current.len())
            } else {
                MAX_LINE.saturating_sub(current.len())
            };
            current.extend_from_slice(&buf[..n.min(room)]);
            cut = n > room;
        }
        r.consume(n);
        if cut && whole {
            return Ok(Err(Window::TooLarge));
        }
        let last_wanted = index + 1 >= skip.saturating_add(take);
        if ends || (cut && last_wanted) {
            if index >= skip && !keep_line(&mut out, &mut current, cut, index)? {
                return Ok(Err(Window::NotUtf8));
            }
            (index, cut) = (index + 1, false);
            if !whole && out.len() >= MAX_ANSWER && index < skip.saturating_add(take) {
                out.extend_from_slice(
                    format!("[pier: the read stopped at {} MiB; read on from line {}]\n", MAX_ANSWER >> 20, index + 1)
                        .as_bytes(),
                );
                break;
            }
        }
    }
    if (!current.is_empty() || cut) && !keep_line(&mut out, &mut current, cut, index)? {
        return Ok(Err(Window::NotUtf8));
    }
    Ok(String::from_utf8(out).map_err(|_| Window::NotUtf8))
}

/// Appends the line read so far to `out`; a cut line ends at a character boundary,
/// with a marker. False when the bytes are not UTF-8.
fn keep_line(out: &mut Vec<u8>, current: &mut Vec<u8>, cut: bool, index: u64) -> std::io::Result<bool> {
    if cut {
        let valid = match std::str::from_utf8(current) {
            Ok(_) => current.len(),
            // Only an incomplete character at the cut is allowed.
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => return Ok(false),
        };
        current.truncate(valid);
        let newline = current.last() == Some(&b'\n');
        if newline {
            current.pop();
        }
        out.append(current);
        out.extend_from_slice(
            format!(" [pier: line {} is longer than {} KiB; the rest of it was cut]\n", index + 1, MAX_LINE >> 10)
                .as_bytes(),
        );
    } else {
        out.append(current);
    }
    Ok(true)
}

/// Lines `line..line+limit` (1-based), keeping line endings.
pub fn slice_lines(text: &str, line: Option<u32>, limit: Option<u32>) -> String {
    if line.is_none() && limit.is_none() {
        return text.to_owned();
    }
    let start = line.unwrap_or(1).max(1) as usize - 1;
    let take = limit.map_or(usize::MAX, |l| l as usize);
    text.split_inclusive('\n').skip(start).take(take).collect()
}

pub async fn write_text_file(sandbox: &Sandbox, req: WriteTextFileRequest) -> Result<WriteTextFileResponse, Error> {
    let path = sandbox.resolve_write(&req.path)?;
    let (root, _) = sandbox.locate(&path)?;
    let (root, target, content) = (root.clone(), path.clone(), req.content);
    tokio::task::spawn_blocking(move || root.write_atomic(&target, content.as_bytes()))
        .await
        .map_err(|e| internal(e.to_string()))?
        .map_err(|e| internal(format!("cannot write {}: {e}", path.display())))?;
    Ok(WriteTextFileResponse::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_one_based() {
        let t = "a\nb\nc\nd";
        assert_eq!(slice_lines(t, None, None), t);
        assert_eq!(slice_lines(t, Some(2), Some(2)), "b\nc\n");
        assert_eq!(slice_lines(t, Some(3), None), "c\nd");
        assert_eq!(slice_lines(t, None, Some(1)), "a\n");
        assert_eq!(slice_lines(t, Some(9), None), "");
    }

    fn window(text: &[u8], line: Option<u32>, limit: Option<u32>) -> Result<String, Window> {
        read_window(std::io::BufReader::with_capacity(3, text), line, limit).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_streamed_window_matches_the_slice_of_the_whole_text() {
        let t = "a\nbé\nc\nd";
        for line in [None, Some(0), Some(1), Some(2), Some(4), Some(5), Some(9)] {
            for limit in [None, Some(0), Some(1), Some(2), Some(9)] {
                assert_eq!(window(t.as_bytes(), line, limit), Ok(slice_lines(t, line, limit)), "{line:?} {limit:?}");
            }
        }
        assert_eq!(window(b"a\n\xff\n", Some(1), Some(1)), Ok("a\n".to_owned()), "only the window is decoded");
        assert_eq!(window(b"a\n\xff\n", None, None), Err(Window::NotUtf8));
    }

    #[test]
    fn long_lines_are_cut_with_a_marker_and_whole_reads_are_bounded() {
        let mut long = "é".repeat(MAX_LINE);
        long.push_str("\nnext\n");
        let got = window(long.as_bytes(), Some(1), Some(2)).unwrap_or_default();
        let (first, rest) = got.split_once('\n').unwrap_or_default();
        assert!(first.len() <= MAX_LINE + 100, "{}", first.len());
        assert!(first.ends_with("the rest of it was cut]"), "{}", &first[first.len() - 80..]);
        assert_eq!(rest, "next\n");
        let big = vec![b'x'; MAX_ANSWER + 1];
        assert_eq!(window(&big, None, None), Err(Window::TooLarge));
    }
}
