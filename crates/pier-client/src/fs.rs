//! `fs/read_text_file` and `fs/write_text_file`, inside the sandbox: files are
//! opened, created and renamed beneath a root's directory handle (pier-tools'
//! confined primitives), never by path.

use agent_client_protocol_schema::v1::{
    Error, ReadTextFileRequest, ReadTextFileResponse, WriteTextFileRequest, WriteTextFileResponse,
};
use pier_acp::error::internal;

use crate::sandbox::Sandbox;

pub async fn read_text_file(sandbox: &Sandbox, req: ReadTextFileRequest) -> Result<ReadTextFileResponse, Error> {
    let (root, path) = sandbox.locate(&req.path)?;
    let uri = format!("file://{}", path.display());
    let (root, target) = (root.clone(), path.clone());
    let text = match tokio::task::spawn_blocking(move || root.read_text(&target))
        .await
        .map_err(|e| internal(e.to_string()))?
    {
        Ok(Some(text)) => text,
        Ok(None) => return Err(Error::resource_not_found(Some(uri))),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            return Err(internal(format!("{} is not a UTF-8 text file", path.display())));
        }
        Err(e) => return Err(internal(format!("cannot read {}: {e}", path.display()))),
    };
    Ok(ReadTextFileResponse::new(slice_lines(&text, req.line, req.limit)))
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
}
