//! `moeswarm serve`: an OpenAI-compatible HTTP API over a model, local or through a swarm,
//! many requests at once by continuous batching, until Ctrl-C.

use std::net::SocketAddr;

use anyhow::Result;
use moeswarm_node::api::batcher::BatchOptions;
use moeswarm_node::api::Server;
use moeswarm_node::router::{OpenModel, Place};

use super::model::ModelArgs;
use crate::output;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Where to serve the API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// Sequences generated at once.
    #[arg(long, default_value_t = 16)]
    max_sequences: usize,
    /// Requests waiting beyond those before new ones get 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Context of one sequence, in tokens (at most the model's).
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Prompt tokens one sequence reads in one step (long prompts do not stall the others).
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// The model's name in the API (default: the file name, or the model id).
    #[arg(long)]
    name: Option<String>,
    /// A Jinja chat template to use instead of the model's own.
    #[arg(long)]
    chat_template: Option<std::path::PathBuf>,
}

pub fn run(a: Args) -> Result<bool> {
    let place = a.model.place()?;
    let name = a.name.clone().unwrap_or_else(|| match &place {
        Place::Local(moeswarm_engine::generate::ModelSource::Gguf(p)) => {
            moeswarm_model::gguf::split::model_name(p)
        }
        Place::Local(moeswarm_engine::generate::ModelSource::Store { model, .. }) => {
            model.to_string()
        }
        Place::Swarm(s) => s.model.to_string(),
    });
    let opts = BatchOptions {
        max_sequences: a.max_sequences.max(1),
        max_queue: a.max_queue.max(1),
        prefill_chunk: a.prefill_chunk.max(1),
        ctx: a.ctx.max(2),
    };
    super::runtime(true)?.block_on(async move {
        let mut m = OpenModel::open(&place).await?;
        super::model::use_chat_template(&mut m.tokenizer, a.chat_template.as_deref())?;
        let server = Server::start(m, name.clone(), opts, a.http).await?;
        output::emit(&format!(
            "serving {name} on http://{}/v1\ndashboard on http://{}/\nready\n",
            server.addr, server.addr
        ))?;
        super::until_stopped().await;
        server.shutdown().await;
        anyhow::Ok(true)
    })
}
