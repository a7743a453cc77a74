//! The embedded default model: a small chat model (SmolLM2-135M-Instruct) run on
//! the CPU with candle, so pier works offline with nothing configured.
//!
//! Loading happens once per process and is shared by every session. Generation
//! is CPU-bound, so one runs at a time: requests queue on a fair (FIFO) lock.
//! Tokens stream through the same [`ModelEvent`]s as the HTTP provider; dropping
//! the stream stops generation before the next token. The model cannot drive
//! tool calls, so it is never offered tools.

pub mod install;
pub mod tokenizer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use candle_transformers::models::quantized_llama::ModelWeights;
use tokio::sync::{Mutex, mpsc};

use crate::{ChatMessage, FinishReason, ModelError, ModelEvent, ModelProvider, ModelRequest, ModelStream, Role, Usage};

/// The model `pier models install` puts in place, by name.
pub const DEFAULT_MODEL: &str = "smollm2";

/// Where an installed model lives under `$PIER_HOME`.
pub fn model_path(pier_home: &Path, name: &str) -> PathBuf {
    pier_home.join("models").join(format!("{name}.q8_0.gguf"))
}

/// Sampling and limits of the local model.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    pub path: PathBuf,
    pub seed: u64,
    pub temperature: f64,
    pub top_p: f64,
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    /// The most tokens of one answer; `None`: whatever the context leaves after the prompt.
    pub max_tokens: Option<u32>,
}

/// The part of the context a long prompt leaves for the answer at least (the prompt's
/// oldest tokens are dropped to make room), when no `max_tokens` is set.
const MIN_ANSWER_TOKENS: usize = 1024;

impl LocalConfig {
    /// The settings SmolLM2's authors recommend, with a fixed seed.
    pub fn new(path: PathBuf) -> LocalConfig {
        LocalConfig {
            path,
            seed: 299_792_458,
            temperature: 0.2,
            top_p: 0.9,
            repeat_penalty: 1.1,
            repeat_last_n: 64,
            max_tokens: None,
        }
    }
}

struct Loaded {
    weights: ModelWeights,
    tokenizer: tokenizers::Tokenizer,
    im_end: u32,
    context: usize,
}

/// The local provider. Cheap to clone; the model is loaded on first use.
#[derive(Clone)]
pub struct LocalProvider {
    inner: Arc<Inner>,
}

struct Inner {
    config: LocalConfig,
    loaded: OnceLock<Result<Arc<Loaded>, String>>,
    /// One generation at a time, in arrival order (tokio's mutex is fair). The
    /// generating thread holds it, so it is free exactly when no generation runs.
    turn: Arc<Mutex<()>>,
}

impl LocalProvider {
    pub fn new(config: LocalConfig) -> LocalProvider {
        LocalProvider { inner: Arc::new(Inner { config, loaded: OnceLock::new(), turn: Arc::new(Mutex::new(())) }) }
    }

    /// Resolves once no generation is running (a cancelled one has stopped).
    pub async fn idle(&self) {
        let _ = self.inner.turn.lock().await;
    }

    fn load(&self) -> Result<Arc<Loaded>, String> {
        self.inner.loaded.get_or_init(|| load(&self.inner.config.path).map(Arc::new)).clone()
    }
}

fn load(path: &Path) -> Result<Loaded, String> {
    let mut file = std::fs::File::open(path).map_err(|e| {
        format!("the local model is not installed at {} ({e}); install it with `pier models install`", path.display())
    })?;
    let content =
        gguf_file::Content::read(&mut file).map_err(|e| format!("{} is not a GGUF model: {e}", path.display()))?;
    let (tokenizer, special) = tokenizer::from_gguf(&content)?;
    let im_end = *special.get("<|im_end|>").ok_or("the model has no <|im_end|> token")?;
    let context = content.metadata.get("llama.context_length").and_then(|v| v.to_u32().ok()).unwrap_or(2048) as usize;
    let weights =
        ModelWeights::from_gguf(content, &mut file, &Device::Cpu).map_err(|e| format!("cannot load the model: {e}"))?;
    Ok(Loaded { weights, tokenizer, im_end, context })
}

/// The conversation in SmolLM2's ChatML template, ready for the assistant's turn.
pub fn chatml(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        let role = match m.role {
            Role::System => "system",
            Role::User | Role::Tool => "user",
            Role::Assistant => "assistant",
        };
        out.push_str(&format!("<|im_start|>{role}\n{}<|im_end|>\n", m.content));
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

impl ModelProvider for LocalProvider {
    fn describe(&self) -> String {
        format!("local {}", self.inner.config.path.display())
    }

    fn context_window(&self) -> Option<u64> {
        // SmolLM2's context; another GGUF's own length is only known once it is loaded.
        Some(8192)
    }

    fn stream(&self, request: ModelRequest) -> ModelStream {
        let this = self.clone();
        Box::pin(async_stream::stream! {
            let turn = this.inner.turn.clone().lock_owned().await;
            let loader = this.clone();
            let loaded = match tokio::task::spawn_blocking(move || loader.load()).await {
                Ok(Ok(l)) => l,
                Ok(Err(e)) => { yield Err(ModelError::NotConfigured(e)); return; }
                Err(e) => { yield Err(ModelError::Setup(e.to_string())); return; }
            };
            let (tx, mut rx) = mpsc::channel::<Result<ModelEvent, ModelError>>(16);
            let config = this.inner.config.clone();
            let prompt = chatml(&request.messages);
            let worker = tokio::task::spawn_blocking(move || {
                generate(&loaded, &config, &prompt, &tx);
                drop(turn);
            });
            while let Some(event) = rx.recv().await {
                yield event;
            }
            let _ = worker.await;
        })
    }
}

/// Generates until `<|im_end|>`, the token limit, or the receiver going away.
fn generate(loaded: &Loaded, config: &LocalConfig, prompt: &str, tx: &mpsc::Sender<Result<ModelEvent, ModelError>>) {
    let fail = |e: String| {
        let _ = tx.blocking_send(Err(ModelError::Provider(e)));
    };
    let encoding = match loaded.tokenizer.encode(prompt, false) {
        Ok(e) => e,
        Err(e) => return fail(format!("cannot tokenize the prompt: {e}")),
    };
    let mut tokens: Vec<u32> = encoding.get_ids().to_vec();
    let reserve = config.max_tokens.map_or(MIN_ANSWER_TOKENS, |m| m as usize).min(loaded.context / 2);
    let budget = loaded.context.saturating_sub(reserve).max(1);
    if tokens.len() > budget {
        tokens.drain(..tokens.len() - budget);
    }
    let prompt_tokens = tokens.len();
    let room = loaded.context.saturating_sub(prompt_tokens);
    let limit = config.max_tokens.map_or(room, |m| (m as usize).min(room));
    let mut weights = loaded.weights.clone();
    let mut sampler = LogitsProcessor::from_sampling(
        config.seed,
        Sampling::TopP { p: config.top_p, temperature: config.temperature },
    );
    let mut generated: Vec<u32> = Vec::new();
    let mut text_so_far = String::new();
    let mut finish = FinishReason::Length;
    let mut input: Vec<u32> = tokens.clone();
    let mut pos = 0usize;
    for _ in 0..limit {
        if tx.is_closed() {
            return; // Cancelled: the stream was dropped.
        }
        let step = (|| -> candle_core::Result<u32> {
            let x = Tensor::new(input.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
            let logits = weights.forward(&x, pos)?.squeeze(0)?;
            let context: Vec<u32> = tokens.iter().chain(generated.iter()).copied().collect();
            let start = context.len().saturating_sub(config.repeat_last_n);
            let logits =
                candle_transformers::utils::apply_repeat_penalty(&logits, config.repeat_penalty, &context[start..])?;
            sampler.sample(&logits)
        })();
        let next = match step {
            Ok(t) => t,
            Err(e) => return fail(format!("generation failed: {e}")),
        };
        pos += input.len();
        input = vec![next];
        if next == loaded.im_end {
            finish = FinishReason::Stop;
            break;
        }
        generated.push(next);
        let text = loaded.tokenizer.decode(&generated, true).unwrap_or_default();
        // Emit only complete characters: a partial UTF-8 sequence decodes to U+FFFD.
        if text.len() > text_so_far.len() && !text.ends_with('\u{FFFD}') && text.starts_with(&text_so_far) {
            let delta = text[text_so_far.len()..].to_owned();
            text_so_far = text;
            if tx.blocking_send(Ok(ModelEvent::TextDelta(delta))).is_err() {
                return;
            }
        }
    }
    let completion = generated.len() as u64;
    let usage = Usage {
        prompt_tokens: prompt_tokens as u64,
        completion_tokens: completion,
        total_tokens: prompt_tokens as u64 + completion,
    };
    let _ = tx.blocking_send(Ok(ModelEvent::Usage(usage)));
    let _ = tx.blocking_send(Ok(ModelEvent::Finish { reason: finish, tool_calls: Vec::new() }));
}
