//! A gpt2-style byte-level BPE tokenizer built from `tokenizer.ggml.*` metadata (as Qwen uses),
//! on the `tokenizers` crate.

use crate::error::{bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use moeswarm_model::gguf::{Gguf, Value};

/// Qwen2's pre-tokenizer split (`tokenizer.ggml.pre = qwen2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's token type for control tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;

/// The model's tokenizer, with its special tokens.
pub struct TextTokenizer {
    inner: Tokenizer,
    /// Beginning-of-sequence token, if the model has one.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Whether to put `bos` before a prompt.
    pub add_bos: bool,
    /// Whether the vocabulary has ChatML's markers (`<|im_start|>`, `<|im_end|>`).
    pub chatml: bool,
    im_end: Option<u32>,
}

fn strings(g: &Gguf, key: &str) -> Result<Vec<String>> {
    let items = g
        .get(key)
        .and_then(Value::as_array)
        .with_context(|| format!("metadata {key} is missing or not an array"))?;
    items
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .with_context(|| format!("{key} holds a non-string"))
        })
        .collect()
}

fn token_id(g: &Gguf, key: &str) -> Option<u32> {
    g.get(key).and_then(Value::as_u64).map(|v| v as u32)
}

impl TextTokenizer {
    /// Builds the tokenizer of the model whose header is `g`.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let model = g
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .unwrap_or("");
        if model != "gpt2" {
            bail!("tokenizer model {model:?} is not supported (only gpt2-style byte-level BPE)");
        }
        let tokens = strings(g, "tokenizer.ggml.tokens")?;
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        // Keep only merges whose parts and result are tokens; others can never apply.
        let merges: Vec<(String, String)> = strings(g, "tokenizer.ggml.merges")
            .unwrap_or_default()
            .into_iter()
            .filter_map(|m| {
                let (a, b) = m.split_once(' ')?;
                let ok = vocab.contains_key(a)
                    && vocab.contains_key(b)
                    && vocab.contains_key(&format!("{a}{b}"));
                ok.then(|| (a.to_string(), b.to_string()))
            })
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| crate::error::Error::Tokenizer(format!("building the BPE model: {e}")))?;
        let mut inner = Tokenizer::new(bpe);
        let pre = g
            .get("tokenizer.ggml.pre")
            .and_then(Value::as_str)
            .unwrap_or("gpt2");
        let byte_level = ByteLevel::new(false, false, pre == "gpt2");
        if pre == "gpt2" {
            inner.with_pre_tokenizer(Some(byte_level));
        } else {
            let split = Split::new(
                SplitPattern::Regex(QWEN2_SPLIT.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| crate::error::Error::Tokenizer(format!("pre-tokenizer regex: {e}")))?;
            inner.with_pre_tokenizer(Some(Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(byte_level),
            ])));
        }
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let types: Vec<i64> = g
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|v| match v {
                        Value::I32(x) => *x as i64,
                        other => other.as_u64().map(|x| x as i64).unwrap_or(1),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let specials: Vec<AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| types.get(*i) == Some(&TOKEN_TYPE_CONTROL))
            .map(|(_, t)| AddedToken::from(t.clone(), true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| crate::error::Error::Tokenizer(format!("adding special tokens: {e}")))?;
        let find = |s: &str| tokens.iter().position(|t| t == s).map(|i| i as u32);
        let im_end = find("<|im_end|>");
        Ok(Self {
            inner,
            bos: token_id(g, "tokenizer.ggml.bos_token_id"),
            eos: token_id(g, "tokenizer.ggml.eos_token_id"),
            add_bos: matches!(
                g.get("tokenizer.ggml.add_bos_token"),
                Some(Value::Bool(true))
            ),
            chatml: find("<|im_start|>").is_some() && im_end.is_some(),
            im_end,
        })
    }

    /// Token ids of `text` (with `bos` first when the model asks for it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| crate::error::Error::Tokenizer(format!("encoding: {e}")))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids` (special tokens left out).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| crate::error::Error::Tokenizer(format!("decoding: {e}")))
    }

    /// The prompt as the model expects it: ChatML for chat models, the text as is otherwise.
    pub fn prompt(&self, user: &str) -> String {
        if self.chatml {
            format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
        } else {
            user.to_string()
        }
    }

    /// A conversation as the model expects it, ready for the assistant's turn: ChatML for
    /// chat models (`(role, content)` turns), the contents one per line otherwise.
    pub fn chat<'a>(&self, turns: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
        let mut out = String::new();
        for (role, content) in turns {
            if self.chatml {
                out += &format!("<|im_start|>{role}\n{content}<|im_end|>\n");
            } else {
                out += content;
                out.push('\n');
            }
        }
        if self.chatml {
            out += "<|im_start|>assistant\n";
        }
        out
    }

    /// Whether generation should stop at `id` (end of sequence or end of a chat turn).
    pub fn is_stop(&self, id: u32) -> bool {
        Some(id) == self.eos || Some(id) == self.im_end
    }
}
