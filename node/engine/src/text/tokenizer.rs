//! A gpt2-style byte-level BPE tokenizer built from `tokenizer.ggml.*` metadata (as Qwen uses),
//! on the `tokenizers` crate, following llama.cpp: the pre-tokenizer splits its
//! `tokenizer.ggml.pre` names (an unknown one is an error, not a guess), control tokens matched
//! in text when asked (llama.cpp's `parse_special`), user-defined tokens always, and the
//! end-of-generation tokens llama.cpp stops on.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use crate::error::{bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::chat::{ChatError, ChatInputs, ChatTemplate, TemplateOrigin, CHATML};
use moeswarm_model::gguf::{Gguf, Value};

/// llama.cpp's token types.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Token texts llama.cpp takes as end of generation (and so as control tokens), whatever the
/// file says of them.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// Metadata keys of tokens that end generation.
const EOG_KEYS: &[&str] = &[
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
];

/// The regular expressions llama.cpp splits text with before BPE, for a `tokenizer.ggml.pre`
/// value (`None`: the key is absent, which llama.cpp reads as `default`). Each expression
/// splits the pieces the one before it left.
pub fn pre_splits(pre: Option<&str>) -> Result<&'static [&'static str]> {
    const GPT2: &[&str] =
        &[r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"];
    const QWEN2: &[&str] = &[
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const QWEN35: &[&str] = &[
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];
    const DEFAULT: &[&str] = &[
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ];
    Ok(match pre {
        None | Some("default") => DEFAULT,
        Some("gpt2" | "mpt" | "olmo" | "jais" | "trillion") => GPT2,
        Some("qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2") => QWEN2,
        Some("qwen35") => QWEN35,
        Some(other) => bail!(
            "tokenizer.ggml.pre {other:?} is not a pre-tokenizer this engine knows (default, \
             gpt2, qwen2, qwen35 and their aliases): refusing to guess how to split text"
        ),
    })
}

/// The model's tokenizer, with its special tokens.
pub struct TextTokenizer {
    /// Control tokens are matched in text.
    inner: Tokenizer,
    /// Control tokens are plain text (built on first use).
    plain: OnceLock<Tokenizer>,
    /// The most bytes one token stands for (found on first use).
    longest: OnceLock<usize>,
    tokens: Vec<String>,
    /// Control and user-defined tokens: their text is their bytes (no byte-level mapping).
    added: BTreeSet<u32>,
    /// The control tokens' texts, longest first: what a conversation may not write as
    /// control tokens (see `markers`).
    markers: Vec<String>,
    /// Beginning-of-sequence token, if the model has one.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Whether to put `bos` before a prompt.
    pub add_bos: bool,
    /// Whether the vocabulary has ChatML's markers (`<|im_start|>`, `<|im_end|>`).
    pub chatml: bool,
    /// Tokens that end generation (llama.cpp's end-of-generation set).
    eog: BTreeSet<u32>,
    /// The chat template: the model's, one given, ChatML, or why there is none.
    chat: Result<ChatTemplate, ChatError>,
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

fn token_id(g: &Gguf, key: &str, n_vocab: usize) -> Option<u32> {
    g.get(key)
        .and_then(Value::as_u64)
        .filter(|&v| v < n_vocab as u64)
        .map(|v| v as u32)
}

fn tokenizer_error(what: &str) -> impl Fn(tokenizers::Error) -> crate::error::Error + '_ {
    move |e| crate::error::Error::Tokenizer(format!("{what}: {e}"))
}

/// The pre-tokenizer for `splits`: each expression isolates its matches, then bytes are
/// mapped to gpt2's printable characters.
fn pre_tokenizer(splits: &[&str]) -> Result<Sequence> {
    let mut steps = Vec::with_capacity(splits.len() + 1);
    for re in splits {
        let split = Split::new(
            SplitPattern::Regex((*re).into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| crate::error::Error::Tokenizer(format!("pre-tokenizer regex: {e}")))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));
    Ok(Sequence::new(steps))
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
        let splits = pre_splits(g.get("tokenizer.ggml.pre").and_then(Value::as_str))?;
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
        inner.with_pre_tokenizer(Some(pre_tokenizer(splits)?));
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
        let n = tokens.len();
        let mut eog: BTreeSet<u32> = EOG_KEYS.iter().filter_map(|k| token_id(g, k, n)).collect();
        let (mut control, mut user) = (Vec::new(), Vec::new());
        let mut added = BTreeSet::new();
        for (i, t) in tokens.iter().enumerate() {
            let named_eog = EOG_TEXTS.contains(&t.as_str());
            if named_eog {
                eog.insert(i as u32);
            }
            match types.get(i) {
                _ if named_eog => control.push(AddedToken::from(t.clone(), true)),
                Some(&TOKEN_TYPE_CONTROL) => control.push(AddedToken::from(t.clone(), true)),
                Some(&TOKEN_TYPE_USER_DEFINED) => {
                    user.push(AddedToken::from(t.clone(), false).normalized(false))
                }
                _ => continue,
            }
            added.insert(i as u32);
        }
        let mut markers: Vec<String> = control.iter().map(|t| t.content.clone()).collect();
        markers.sort_by_key(|m| std::cmp::Reverse(m.len()));
        markers.retain(|m| !m.is_empty());
        inner
            .add_special_tokens(control)
            .map_err(tokenizer_error("adding control tokens"))?;
        inner
            .add_tokens(user)
            .map_err(tokenizer_error("adding user-defined tokens"))?;
        let find = |s: &str| tokens.iter().position(|t| t == s).map(|i| i as u32);
        let mut me = Self {
            inner,
            plain: OnceLock::new(),
            longest: OnceLock::new(),
            bos: token_id(g, "tokenizer.ggml.bos_token_id", n),
            eos: token_id(g, "tokenizer.ggml.eos_token_id", n),
            add_bos: matches!(
                g.get("tokenizer.ggml.add_bos_token"),
                Some(Value::Bool(true))
            ),
            chatml: find("<|im_start|>").is_some() && find("<|im_end|>").is_some(),
            eog,
            added,
            markers,
            tokens,
            chat: Err(ChatError::NoTemplate),
        };
        me.chat = match g.get("tokenizer.chat_template").and_then(Value::as_str) {
            Some(source) => me.compile(source, TemplateOrigin::Model),
            None if me.chatml => me.compile(CHATML, TemplateOrigin::ChatMl),
            None => Err(ChatError::NoTemplate),
        };
        Ok(me)
    }

    fn compile(&self, source: &str, origin: TemplateOrigin) -> Result<ChatTemplate, ChatError> {
        let text = |id: Option<u32>| id.and_then(|i| self.token_text(i)).unwrap_or("");
        ChatTemplate::new(source, text(self.bos), text(self.eos), origin)
    }

    /// Uses the template `source` for chat instead of the model's (`--chat-template`).
    pub fn set_chat_template(&mut self, source: &str) -> Result<(), ChatError> {
        self.chat = Ok(self.compile(source, TemplateOrigin::Given)?);
        Ok(())
    }

    /// The chat template, or why there is none.
    pub fn chat_template(&self) -> Result<&ChatTemplate, ChatError> {
        self.chat.as_ref().map_err(Clone::clone)
    }

    /// The prompt for a conversation (see [`ChatTemplate::render`]).
    pub fn render_chat(&self, inputs: &ChatInputs) -> Result<String, ChatError> {
        self.chat_template()?.render(inputs)
    }

    /// The token ids of a conversation's prompt: what the template writes, control markers
    /// included, as [`TextTokenizer::encode`] takes it; what the conversation itself holds
    /// (messages, tools, keywords) as plain text, so a marker written there is never a
    /// control token (see `markers`).
    pub fn encode_chat(&self, inputs: &ChatInputs) -> Result<Vec<u32>> {
        let mut replaced = super::markers::Replaced::default();
        let m = &self.markers;
        let mut safe = ChatInputs {
            messages: replaced.value(&inputs.messages, m)?,
            tools: None,
            add_generation_prompt: inputs.add_generation_prompt,
            extra: Vec::with_capacity(inputs.extra.len()),
        };
        if let Some(tools) = &inputs.tools {
            safe.tools = Some(replaced.value(tools, m)?);
        }
        for (k, v) in &inputs.extra {
            safe.extra.push((k.clone(), replaced.value(v, m)?));
        }
        let rendered = self.render_chat(&safe)?;
        let mut ids = self.tokenize("", true, false)?;
        for piece in replaced.pieces(&rendered) {
            ids.extend(match piece {
                super::markers::Piece::Template(t) => self.tokenize(t, false, true)?,
                super::markers::Piece::Text(t) => self.tokenize(t, false, false)?,
            });
        }
        Ok(ids)
    }

    /// A conversation of `(role, content)` turns as the model expects it, ready for the
    /// assistant's turn.
    pub fn chat<'a>(
        &self,
        turns: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<String, ChatError> {
        self.render_chat(&ChatInputs::turns(turns))
    }

    /// A user's text as the model expects it: one user turn of a chat for models that chat,
    /// the text as is for those that do not.
    pub fn prompt(&self, user: &str) -> Result<String, ChatError> {
        match self.chat([("user", user)]) {
            Err(ChatError::NoTemplate) => Ok(user.to_string()),
            other => other,
        }
    }

    /// Token ids of `text` (with `bos` first when the model asks for it), control tokens
    /// written in the text taken as those tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenize(text, true, true)
    }

    /// Token ids of `text`: `bos` first when `add_special` and the model asks for it; control
    /// tokens written in the text taken as those tokens when `parse_special`, as plain text
    /// otherwise (user-defined tokens always, as llama.cpp does).
    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special {
            &self.inner
        } else {
            self.plain.get_or_init(|| {
                let mut t = self.inner.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = tok
            .encode(text, false)
            .map_err(tokenizer_error("encoding"))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The most bytes one token stands for: a text of `n` bytes has at least
    /// `n / longest_token_bytes()` tokens.
    pub fn longest_token_bytes(&self) -> usize {
        *self.longest.get_or_init(|| {
            (0..self.tokens.len() as u32)
                .filter_map(|id| self.piece(id).ok())
                .map(|p| p.len())
                .max()
                .unwrap_or(1)
                .max(1)
        })
    }

    /// Text of `ids`, control tokens left out (what a user reads of a generation).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(tokenizer_error("decoding"))
    }

    /// Text of `ids` with control tokens written out: `tokenize` of it gives `ids` back.
    pub fn detokenize(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend(self.piece(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The bytes token `id` stands for (a piece may be part of a UTF-8 character).
    pub fn piece(&self, id: u32) -> Result<Vec<u8>> {
        let Some(text) = self.tokens.get(id as usize) else {
            bail!(
                "token {id} is outside the vocabulary of {} tokens",
                self.tokens.len()
            );
        };
        if self.added.contains(&id) {
            return Ok(text.as_bytes().to_vec());
        }
        Ok(text.chars().flat_map(byte_of_char).collect())
    }

    /// The vocabulary's text of token `id`, as the file writes it.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Whether generation should stop at `id`: any of the vocabulary's end-of-generation
    /// tokens (`eos`, `eot`, `<|im_end|>`, `<|endoftext|>`, … as llama.cpp decides).
    pub fn is_stop(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The end-of-generation tokens.
    pub fn stop_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }
}

/// The byte gpt2's byte-level alphabet writes as `c` (bytes that print as themselves, and the
/// others shifted to U+0100 onwards); a character outside the alphabet stands for its UTF-8.
fn byte_of_char(c: char) -> Vec<u8> {
    let u = c as u32;
    let prints =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    if u < 256 && prints(u) {
        return vec![u as u8];
    }
    if (256..256 + 68).contains(&u) {
        // The n-th byte that does not print as itself, in order.
        let mut n = u - 256;
        for b in 0u32..256 {
            if !prints(b) {
                if n == 0 {
                    return vec![b as u8];
                }
                n -= 1;
            }
        }
    }
    c.to_string().into_bytes()
}
