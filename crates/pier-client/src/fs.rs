//! `fs/read_text_file` and `fs/write_text_file`, inside the sandbox.

use std::io::Write;

use agent_client_protocol_schema::v1::{
    Error, ReadTextFileRequest, ReadTextFileResponse, WriteTextFileRequest, WriteTextFileResponse,
};
use pier_acp::error::internal;

use crate::sandbox::Sandbox;

pub async fn read_text_file(sandbox: &Sandbox, req: ReadTextFileRequest) -> Result<ReadTextFileResponse, Error> {
    let path = sandbox.resolve(&req.path)?;
    let uri = format!("file://{}", path.display());
    let text = match tokio::fs::read(&path).await {
        Ok(bytes) => {
            String::from_utf8(bytes).map_err(|_| internal(format!("{} is not a UTF-8 text file", path.display())))?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Error::resource_not_found(Some(uri))),
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
    let content = req.content;
    let target = path.clone();
    tokio::task::spawn_blocking(move || {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = target.with_file_name(format!(".{name}.pier-{}.tmp", std::process::id()));
        let result = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(content.as_bytes())?;
            if let Ok(meta) = std::fs::metadata(&target) {
                file.set_permissions(meta.permissions())?;
            }
            file.sync_all()?;
            std::fs::rename(&tmp, &target)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    })
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
