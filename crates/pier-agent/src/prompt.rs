//! Turning a `session/prompt`'s content blocks into the text of a turn.
//!
//! The automation profile takes the baseline content only (R033): `text` blocks,
//! and `resource_link` blocks flattened into a bracketed reference
//! `[NAME](URI)`, Markdown link syntax every model reads as a reference. Blocks
//! are joined with a newline. Images, audio and embedded resources are refused,
//! as are prompts with no visible text, since `promptCapabilities` advertises
//! none of them.

//!
//! The editor profile also takes embedded text resources (given to the model with
//! their URI) and, where the model takes images, image blocks.

use agent_client_protocol_schema::v1::{ContentBlock, EmbeddedResourceResource, Error};
use pier_acp::error::invalid_params;
use pier_engine::UserPrompt;

/// What a profile's prompts may carry besides text and resource links.
#[derive(Debug, Clone, Copy, Default)]
pub struct Accepts {
    pub embedded_context: bool,
    pub image: bool,
}

/// The prompt as the engine takes it, or the -32602 error that explains what is wrong with it.
pub fn user_prompt(blocks: &[ContentBlock], accepts: Accepts) -> Result<UserPrompt, Error> {
    let mut parts = Vec::with_capacity(blocks.len());
    // What a person wrote or sent, without the wrapper an embedded resource gets.
    let mut visible = Vec::with_capacity(blocks.len());
    let mut images = Vec::new();
    for (i, block) in blocks.iter().enumerate() {
        match block {
            ContentBlock::Text(t) => {
                parts.push(t.text.clone());
                visible.push(t.text.clone());
            }
            ContentBlock::ResourceLink(link) => {
                parts.push(flatten_resource_link(&link.name, &link.uri));
                visible.push(link.name.clone());
            }
            ContentBlock::Resource(r) if accepts.embedded_context => match &r.resource {
                EmbeddedResourceResource::TextResourceContents(t) => {
                    parts.push(format!("<resource uri=\"{}\">\n{}\n</resource>", t.uri, t.text));
                    visible.push(t.text.clone());
                }
                EmbeddedResourceResource::BlobResourceContents(b) => {
                    return Err(invalid_params(format!(
                        "prompt block {i} is a binary resource ({}); this agent takes embedded resources as text only",
                        b.uri
                    )));
                }
                _ => return Err(unsupported(i, "resource")),
            },
            ContentBlock::Image(img) if accepts.image => {
                images.push(pier_model::Image { mime_type: img.mime_type.clone(), data: img.data.clone() })
            }
            ContentBlock::Image(_) => return Err(refused(i, "image", accepts)),
            ContentBlock::Audio(_) => return Err(refused(i, "audio", accepts)),
            ContentBlock::Resource(_) => return Err(unsupported(i, "resource")),
            _ => return Err(unsupported(i, "unknown")),
        }
    }
    let text = parts.join("\n");
    if text.trim().is_empty() && images.is_empty() {
        return Err(invalid_params("the prompt is empty; send at least one text or resource_link block with content"));
    }
    Ok(UserPrompt { text, images, title_text: Some(visible.join("\n")) })
}

fn refused(index: usize, kind: &str, accepts: Accepts) -> Error {
    if accepts.embedded_context {
        invalid_params(format!(
            "prompt block {index} is of type `{kind}`, which this agent's model does not take (see \
             promptCapabilities; set `vision = true` on a provider that accepts images)"
        ))
    } else {
        unsupported(index, kind)
    }
}

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
