//! Turning a `session/prompt`'s content blocks into the text of a turn.
//!
//! The automation profile takes the baseline content only (R033): `text` blocks,
//! and `resource_link` blocks flattened into a bracketed reference
//! `[NAME](URI)`, Markdown link syntax every model reads as a reference. Blocks
//! are joined with a newline. Images, audio and embedded resources are refused,
//! as are prompts with no visible text, since `promptCapabilities` advertises
//! none of them.

use agent_client_protocol_schema::v1::{ContentBlock, Error};
use pier_acp::error::invalid_params;

/// The text of a resource link as the model sees it.
pub fn flatten_resource_link(name: &str, uri: &str) -> String {
    format!("[{name}]({uri})")
}

/// The prompt's text, or the -32602 error that explains what is wrong with it.
pub fn prompt_text(blocks: &[ContentBlock]) -> Result<String, Error> {
    let mut parts = Vec::with_capacity(blocks.len());
    for (i, block) in blocks.iter().enumerate() {
        match block {
            ContentBlock::Text(t) => parts.push(t.text.clone()),
            ContentBlock::ResourceLink(link) => parts.push(flatten_resource_link(&link.name, &link.uri)),
            ContentBlock::Image(_) => return Err(unsupported(i, "image")),
            ContentBlock::Audio(_) => return Err(unsupported(i, "audio")),
            ContentBlock::Resource(_) => return Err(unsupported(i, "resource")),
            _ => return Err(unsupported(i, "unknown")),
        }
    }
    let text = parts.join("\n");
    if text.trim().is_empty() {
        return Err(invalid_params("the prompt is empty; send at least one text or resource_link block with content"));
    }
    Ok(text)
}

fn unsupported(index: usize, kind: &str) -> Error {
    invalid_params(format!(
        "prompt block {index} is of type `{kind}`; this agent accepts only `text` and `resource_link` blocks \
         (its promptCapabilities are all false)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn blocks(v: serde_json::Value) -> Vec<ContentBlock> {
        match serde_json::from_value(v) {
            Ok(b) => b,
            Err(e) => panic!("bad test blocks: {e}"),
        }
    }

    #[test]
    fn text_and_links_are_flattened_in_order() {
        let b = blocks(json!([
            {"type": "text", "text": "Summarise"},
            {"type": "resource_link", "name": "main.rs", "uri": "file:///w/src/main.rs"},
            {"type": "text", "text": "briefly."},
        ]));
        assert_eq!(prompt_text(&b).ok().as_deref(), Some("Summarise\n[main.rs](file:///w/src/main.rs)\nbriefly."));
    }

    #[test]
    fn a_link_alone_is_a_prompt() {
        let b = blocks(json!([{"type": "resource_link", "name": "a", "uri": "file:///a"}]));
        assert!(prompt_text(&b).is_ok());
    }

    #[test]
    fn empty_whitespace_and_rich_blocks_are_refused() {
        for v in [
            json!([]),
            json!([{"type": "text", "text": "  \n\t"}]),
            json!([{"type": "text", "text": "x"}, {"type": "image", "data": "AA==", "mimeType": "image/png"}]),
            json!([{"type": "audio", "data": "AA==", "mimeType": "audio/wav"}]),
            json!([{"type": "resource", "resource": {"uri": "file:///a", "text": "t"}}]),
        ] {
            let err = match prompt_text(&blocks(v.clone())) {
                Ok(t) => panic!("{v} was accepted as {t:?}"),
                Err(e) => e,
            };
            assert_eq!(i32::from(err.code), -32602, "{v}");
        }
    }
}
