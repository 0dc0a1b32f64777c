//! `moeswarm tokenize`: how the model's tokenizer cuts a text (ids and pieces), from the
//! model's header alone.

use std::io::Read;
use std::path::PathBuf;

use anyhow::{Context, Result};
use moeswarm_engine::text::TextTokenizer;
use moeswarm_model::gguf::ModelFiles;
use serde_json::json;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF model (of a split model: any part); only its header is read.
    #[arg(long)]
    model: PathBuf,
    /// The text, or `-` to read it from standard input.
    text: String,
    /// Put the beginning-of-sequence token first when the model asks for one.
    #[arg(long)]
    add_special: bool,
    /// Take control tokens written in the text (`<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Machine-readable output: ids, and each token's piece.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let text = if a.text == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading the text from standard input")?;
        s
    } else {
        a.text
    };
    let files = ModelFiles::open(&a.model)?;
    let tok = TextTokenizer::from_gguf(&files.header)?;
    let ids = tok.tokenize(&text, a.add_special, !a.no_parse_special)?;
    let pieces: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| tok.piece(id))
        .collect::<Result<_, _>>()?;
    if a.json {
        let tokens: Vec<_> = ids
            .iter()
            .zip(&pieces)
            .map(|(id, p)| match std::str::from_utf8(p) {
                Ok(s) => json!({"id": id, "piece": s}),
                Err(_) => json!({"id": id, "piece": p}),
            })
            .collect();
        output::json(&json!({"count": ids.len(), "ids": ids, "tokens": tokens}))?;
    } else {
        let mut s = String::new();
        for (id, p) in ids.iter().zip(&pieces) {
            s += &format!("{id:>7} {:?}\n", String::from_utf8_lossy(p));
        }
        s += &format!("{} tokens\n", ids.len());
        output::emit(&s)?;
    }
    Ok(true)
}
