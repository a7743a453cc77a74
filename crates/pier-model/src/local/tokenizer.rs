//! The tokenizer of a GGUF model, built from its metadata: GPT-2-style byte-level
//! BPE (`tokenizer.ggml.tokens`, `.merges`), digits split one by one, special
//! tokens (`token_type` 3) kept whole.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Content;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

fn meta<'a>(content: &'a Content, key: &str) -> Result<&'a candle_core::quantized::gguf_file::Value, String> {
    content.metadata.get(key).ok_or_else(|| format!("the model file has no `{key}`"))
}

/// Builds the tokenizer; returns it with the special tokens by name.
pub fn from_gguf(content: &Content) -> Result<(Tokenizer, HashMap<String, u32>), String> {
    let tokens = meta(content, "tokenizer.ggml.tokens")?.to_vec().map_err(|e| e.to_string())?;
    let merges = meta(content, "tokenizer.ggml.merges")?.to_vec().map_err(|e| e.to_string())?;
    let types = content.metadata.get("tokenizer.ggml.token_type").and_then(|v| v.to_vec().ok());
    let mut vocab = HashMap::new();
    let mut special = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        let t = t.to_string().map_err(|e| e.to_string())?.clone();
        let kind = types.and_then(|ty| ty.get(i)).and_then(|v| v.to_i32().ok()).unwrap_or(1);
        if kind == 3 {
            special.insert(t.clone(), i as u32);
        }
        vocab.insert(t, i as u32);
    }
    let merges: Vec<(String, String)> = merges
        .iter()
        .filter_map(|m| m.to_string().ok())
        .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = vocab.into_iter().collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| e.to_string())?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre: Vec<PreTokenizerWrapper> = vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()];
    tokenizer.with_pre_tokenizer(Some(Sequence::new(pre)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let mut specials: Vec<(&String, &u32)> = special.iter().collect();
    specials.sort_by_key(|(_, id)| **id);
    let added: Vec<AddedToken> = specials.iter().map(|(t, _)| AddedToken::from((*t).clone(), true)).collect();
    tokenizer.add_special_tokens(added).map_err(|e| format!("cannot add the special tokens: {e}"))?;
    Ok((tokenizer, special))
}
