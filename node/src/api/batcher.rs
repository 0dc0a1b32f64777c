//! Continuous batching: many sequences generated at once, one forward step for all of them.
//!
//! A [`Batcher`] owns the running batch. Requests wait in a bounded queue; at every step
//! boundary finished and abandoned sequences leave and waiting ones join (up to
//! `max_sequences`). One step runs every active sequence's next tokens through
//! [`Trunk::forward_batch`]: a decode token for those generating, the next chunk of the prompt
//! (at most `prefill_chunk` tokens) for those still reading theirs, so a long prompt does not
//! stall the others. Each sequence has its own cache, bounded by the context length, and its
//! own sampler. Because a batched step gives every sequence the logits it gets alone, greedy
//! sequences get exactly the tokens they get alone.
//!
//! Each request hands in a channel; the batcher sends it [`Event`]s as tokens come. A request
//! whose channel is closed (the client went away) leaves at the next step boundary.
//!
//! A sequence may speculate ([`SpeculationConfig`]): before the step it drafts its own tokens
//! (its MTP block, or prompt lookup), they ride in the same step as its next token, beside the
//! other sequences' rows (one expert request per layer for all), and after it the sequence
//! keeps the drafts its sampler accepts and rolls its cache back past the rest. Prefill and
//! sequences that do not speculate share the step as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use moeswarm_engine::executor::ExpertExecutor;
use moeswarm_engine::speculative::{
    check_drafts, Checked, DraftContext, Drafter, ModeDrafter, Speculation, SpeculationConfig,
};
use moeswarm_engine::text::{Sampler, SamplingConfig, TextTokenizer};
use moeswarm_engine::trunk::{ForwardTiming, KvCache, Trunk};
use moeswarm_engine::Result;

/// How the batch is run.
#[derive(Debug, Clone)]
pub struct BatchOptions {
    /// Sequences generated at once.
    pub max_sequences: usize,
    /// Requests waiting beyond the running ones before new ones are refused.
    pub max_queue: usize,
    /// Most prompt tokens one sequence reads in one step.
    pub prefill_chunk: usize,
    /// Tokens of context a sequence may hold (prompt and generated), at most the model's.
    pub ctx: usize,
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self {
            max_sequences: 16,
            max_queue: 64,
            prefill_chunk: 64,
            ctx: 4096,
        }
    }
}

/// One generation asked of the batcher.
#[derive(Debug)]
pub struct Request {
    /// The prompt's token ids (already templated and encoded).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingConfig,
    /// Texts that end the generation (not included in it).
    pub stop: Vec<String>,
    /// Drafting ([`SpeculationConfig::OFF`]: one token a step); see [`Batcher::speculation`].
    pub speculation: SpeculationConfig,
    /// Where the events go.
    pub events: mpsc::UnboundedSender<Event>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token, or a stop text.
    Stop,
    /// `max_tokens` generated, or the context is full.
    Length,
}

/// What the batcher tells a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The first token is about to come: the prompt is read.
    Started,
    /// New text (whole UTF-8).
    Text(String),
    /// The end, with the token counts.
    Done {
        /// Why.
        finish: Finish,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// The generation failed.
    Failed(String),
}

/// Why a request was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The queue is full: try again later.
    #[error("the queue is full ({0} waiting)")]
    Busy(usize),
    /// The prompt does not fit the context.
    #[error("the prompt has {tokens} tokens; the context holds {ctx}")]
    TooLong {
        /// Prompt tokens.
        tokens: usize,
        /// Context length.
        ctx: usize,
    },
    /// The batcher has stopped.
    #[error("the batcher has stopped")]
    Stopped,
}

/// What the batcher did, for metrics.
#[derive(Debug, Default)]
pub struct BatchStats {
    /// Sequences running now.
    pub active: AtomicU64,
    /// Requests waiting now.
    pub queued: AtomicU64,
    /// Forward steps run.
    pub steps: AtomicU64,
    /// Rows (tokens) of all steps.
    pub step_rows: AtomicU64,
    /// Sequences of all steps (the mean batch size is this over `steps`).
    pub step_sequences: AtomicU64,
    /// Tokens generated.
    pub tokens_generated: AtomicU64,
    /// Drafted tokens checked.
    pub drafted: AtomicU64,
    /// Drafted tokens kept.
    pub accepted: AtomicU64,
    /// Sequences that ended because their client went away.
    pub abandoned: AtomicU64,
}

/// Hands requests to a running batcher.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Request>,
    ctx: usize,
    has_mtp: bool,
    /// What it did.
    pub stats: Arc<BatchStats>,
}

impl Batcher {
    /// Queues `req`; refused at once when the queue is full or the prompt is too long.
    pub fn submit(&self, req: Request) -> std::result::Result<(), Refusal> {
        if req.prompt.len() >= self.ctx {
            return Err(Refusal::TooLong {
                tokens: req.prompt.len(),
                ctx: self.ctx,
            });
        }
        // Counted before it is sent: the batcher may take it (and count it out) at once.
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        let refused = match self.tx.try_send(req) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                Refusal::Busy(self.stats.queued.load(Ordering::Relaxed).saturating_sub(1) as usize)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Refusal::Stopped,
        };
        self.stats.queued.fetch_sub(1, Ordering::Relaxed);
        Err(refused)
    }

    /// The context a sequence may hold.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// The speculation a request asks for (`None`: the model's default, its MTP block
    /// drafting 3 tokens where it has one), checked against the model; the error in words.
    pub fn speculation(
        &self,
        mode: Option<Speculation>,
        draft: Option<usize>,
    ) -> std::result::Result<SpeculationConfig, String> {
        SpeculationConfig::requested(mode, draft, self.has_mtp)
    }
}

/// One running sequence.
struct Sequence {
    req: Request,
    cache: KvCache,
    sampler: Sampler,
    /// Prompt tokens read so far.
    read: usize,
    history: Vec<u32>,
    out: Vec<u32>,
    /// The token to feed next, once the prompt is read.
    next: Option<u32>,
    shown: usize,
    /// The residual streams of the positions not yet shown to the MTP drafter.
    kept_hidden: Vec<f32>,
    /// This step's drafted tokens.
    drafts: Vec<u32>,
    /// Its drafter, when it speculates.
    drafter: Option<ModeDrafter>,
}

impl Sequence {
    /// This step's tokens.
    fn input(&self, chunk: usize) -> Vec<u32> {
        if self.read < self.req.prompt.len() {
            let end = (self.read + chunk.max(1)).min(self.req.prompt.len());
            self.req.prompt[self.read..end].to_vec()
        } else {
            self.next
                .into_iter()
                .chain(self.drafts.iter().copied())
                .collect()
        }
    }
}

/// Starts the batcher on `trunk` and `exec`: a task that runs until every [`Batcher`] handle
/// is dropped.
pub fn spawn<E: ExpertExecutor + Send + Sync + 'static>(
    trunk: Arc<Trunk>,
    exec: Arc<E>,
    tokenizer: Arc<TextTokenizer>,
    opts: BatchOptions,
) -> Batcher {
    let ctx = opts.ctx.min(trunk.hyper().context_length as usize).max(2);
    let (tx, rx) = mpsc::channel(opts.max_queue.max(1));
    let stats = Arc::new(BatchStats::default());
    let has_mtp = trunk.has_mtp();
    let run = Run {
        trunk,
        exec,
        tokenizer,
        opts: BatchOptions { ctx, ..opts },
        stats: stats.clone(),
    };
    tokio::spawn(run.serve(rx));
    Batcher {
        tx,
        ctx,
        has_mtp,
        stats,
    }
}

struct Run<E> {
    trunk: Arc<Trunk>,
    exec: Arc<E>,
    tokenizer: Arc<TextTokenizer>,
    opts: BatchOptions,
    stats: Arc<BatchStats>,
}

impl<E: ExpertExecutor + Send + Sync> Run<E> {
    async fn serve(self, mut rx: mpsc::Receiver<Request>) {
        let mut active: Vec<Sequence> = Vec::new();
        let mut timing = ForwardTiming::default();
        loop {
            // Join: wait for work when idle, else take what is waiting, up to the limit.
            if active.is_empty() {
                match rx.recv().await {
                    Some(r) => self.admit(&mut active, r),
                    None => return,
                }
            }
            while active.len() < self.opts.max_sequences {
                match rx.try_recv() {
                    Ok(r) => self.admit(&mut active, r),
                    Err(_) => break,
                }
            }
            // Leave: clients that went away.
            let before = active.len();
            active.retain(|s| !s.req.events.is_closed());
            self.stats
                .abandoned
                .fetch_add((before - active.len()) as u64, Ordering::Relaxed);
            self.stats
                .active
                .store(active.len() as u64, Ordering::Relaxed);
            if active.is_empty() {
                continue;
            }
            self.step(&mut active, &mut timing).await;
            self.stats
                .active
                .store(active.len() as u64, Ordering::Relaxed);
        }
    }

    fn admit(&self, active: &mut Vec<Sequence>, req: Request) {
        self.stats.queued.fetch_sub(1, Ordering::Relaxed);
        let sampler = Sampler::new(req.sampling.clone());
        let drafter = req.speculation.drafter();
        active.push(Sequence {
            history: req.prompt.clone(),
            req,
            cache: self.trunk.new_cache(),
            sampler,
            read: 0,
            out: Vec::new(),
            next: None,
            shown: 0,
            kept_hidden: Vec::new(),
            drafts: Vec::new(),
            drafter,
        });
    }

    /// Each generating sequence that speculates drafts its tokens for this step (at most
    /// what its `max_tokens` and the context leave room for) and marks its cache; one whose
    /// drafting fails is told so and leaves.
    async fn draft(&self, active: &mut Vec<Sequence>, timing: &mut ForwardTiming) {
        let mut failed = Vec::new();
        for (i, seq) in active.iter_mut().enumerate() {
            if let Err(e) = self.draft_one(seq, timing).await {
                let _ = seq.req.events.send(Event::Failed(format!("{e:#}")));
                failed.push(i);
            }
        }
        for i in failed.into_iter().rev() {
            active.remove(i);
        }
    }

    /// `seq`'s drafts for this step, if it speculates.
    async fn draft_one(&self, seq: &mut Sequence, timing: &mut ForwardTiming) -> Result<()> {
        seq.drafts.clear();
        let Some(drafter) = seq.drafter.as_mut() else {
            return Ok(());
        };
        if seq.read < seq.req.prompt.len() {
            return Ok(());
        }
        let room = seq
            .req
            .speculation
            .draft
            .min(seq.req.max_tokens.saturating_sub(seq.out.len() + 1))
            .min(self.opts.ctx.saturating_sub(seq.cache.len() + 2));
        if room == 0 {
            return Ok(());
        }
        // The history ends with the next token (taken, not yet run).
        let ctx = DraftContext {
            trunk: &self.trunk,
            exec: self.exec.as_ref(),
            cache: &mut seq.cache,
            history: &seq.history,
            kept_hidden: &seq.kept_hidden,
            timing: &mut *timing,
        };
        seq.drafts = drafter.draft(ctx, room).await?;
        // The drafter has seen these rows (the MTP block keeps them in its cache).
        seq.kept_hidden.clear();
        if !seq.drafts.is_empty() {
            self.trunk.checkpoint(&mut seq.cache);
        }
        Ok(())
    }

    /// A generating sequence's tokens from its step's logits: its drafts checked in order
    /// (each kept one taken), the first rejected one's replacement or one more, the cache
    /// rolled back past what was not kept; `Some` when the sequence ends.
    fn take_tokens(
        &self,
        seq: &mut Sequence,
        logits: &[f32],
        hidden: &[f32],
        base: usize,
    ) -> Result<Option<Finish>> {
        let n_embd = self.trunk.hyper().n_embd as usize;
        let drafts = std::mem::take(&mut seq.drafts);
        let Checked { accepted, next } =
            check_drafts(&mut seq.sampler, logits, &seq.history, &drafts);
        for &d in &drafts[..accepted] {
            if let Some(finish) = self.advance(seq, d)? {
                return Ok(Some(finish));
            }
        }
        if !drafts.is_empty() {
            self.trunk.rollback(&mut seq.cache, base + 1 + accepted)?;
            self.stats
                .drafted
                .fetch_add(drafts.len() as u64, Ordering::Relaxed);
            self.stats
                .accepted
                .fetch_add(accepted as u64, Ordering::Relaxed);
        }
        if seq.req.speculation.mode == Speculation::Mtp {
            seq.kept_hidden
                .extend_from_slice(&hidden[..(1 + accepted) * n_embd]);
        }
        self.advance(seq, next)
    }

    /// One forward step of every active sequence; then each samples, reports, and the
    /// finished ones leave. A sequence whose drafting, experts or text fail is told so and
    /// leaves; the others go on with exactly the tokens they get alone.
    async fn step(&self, active: &mut Vec<Sequence>, timing: &mut ForwardTiming) {
        self.draft(active, timing).await;
        let inputs: Vec<Vec<u32>> = active
            .iter()
            .map(|s| s.input(self.opts.prefill_chunk))
            .collect();
        let bases: Vec<usize> = active.iter().map(|s| s.cache.len()).collect();
        let stepped = {
            let mut batch: Vec<(&mut KvCache, &[u32])> = active
                .iter_mut()
                .zip(&inputs)
                .map(|(s, t)| (&mut s.cache, t.as_slice()))
                .collect();
            self.trunk
                .forward_batch_each(&mut batch, self.exec.as_ref(), timing)
                .await
        };
        let (logits, hidden) = match stepped {
            Ok(r) => r,
            // Only a batch of one fails as a whole.
            Err(e) => {
                for s in active.drain(..) {
                    let _ = s.req.events.send(Event::Failed(format!("{e:#}")));
                }
                return;
            }
        };
        let s = &self.stats;
        s.steps.fetch_add(1, Ordering::Relaxed);
        s.step_sequences
            .fetch_add(active.len() as u64, Ordering::Relaxed);
        s.step_rows.fetch_add(
            inputs.iter().map(|t| t.len() as u64).sum(),
            Ordering::Relaxed,
        );
        let mut keep = Vec::with_capacity(active.len());
        let each = inputs.iter().zip(logits).zip(&bases).enumerate();
        for (mut seq, (i, ((input, logits), &base))) in active.drain(..).zip(each) {
            let taken = logits.and_then(|logits| {
                self.take_step(&mut seq, input.len(), &logits, hidden.of(i), base)
            });
            match taken {
                Ok(Some(finish)) => {
                    let _ = seq.req.events.send(Event::Done {
                        finish,
                        prompt_tokens: seq.req.prompt.len(),
                        completion_tokens: seq.out.len(),
                    });
                }
                Ok(None) => keep.push(seq),
                Err(e) => {
                    let _ = seq.req.events.send(Event::Failed(format!("{e:#}")));
                }
            }
        }
        *active = keep;
    }

    /// What `seq` makes of its step: the prompt read further, or its first token, or its
    /// drafts checked and its next token; `Some` when it ends here.
    fn take_step(
        &self,
        seq: &mut Sequence,
        rows: usize,
        logits: &[f32],
        hidden: &[f32],
        base: usize,
    ) -> Result<Option<Finish>> {
        if seq.read >= seq.req.prompt.len() {
            return self.take_tokens(seq, logits, hidden, base);
        }
        seq.read += rows;
        if seq.req.speculation.mode == Speculation::Mtp {
            seq.kept_hidden.extend_from_slice(hidden);
        }
        if seq.read < seq.req.prompt.len() {
            return Ok(None);
        }
        let _ = seq.req.events.send(Event::Started);
        let vocab = self.trunk.hyper().n_vocab as usize;
        let last = &logits[logits.len() - vocab..];
        let tok = seq.sampler.sample(last, &seq.history);
        self.advance(seq, tok)
    }

    /// Takes the sampled token `tok`: sends the text it completes; `Some` when the sequence
    /// ends here.
    fn advance(&self, seq: &mut Sequence, tok: u32) -> Result<Option<Finish>> {
        if self.tokenizer.is_stop(tok) {
            return Ok(Some(Finish::Stop));
        }
        seq.out.push(tok);
        seq.history.push(tok);
        self.stats.tokens_generated.fetch_add(1, Ordering::Relaxed);
        let text = self.tokenizer.decode(&seq.out)?;
        // A stop text not found before cannot start before what was shown less its length
        // (and a few bytes of a character decoded whole only now).
        let longest = seq.req.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = seq.shown.saturating_sub(longest + 8).min(text.len());
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(at) = seq
            .req
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text[from..].find(s.as_str()).map(|at| from + at))
            .min()
        {
            if at > seq.shown && text.is_char_boundary(seq.shown) {
                let _ = seq
                    .req
                    .events
                    .send(Event::Text(text[seq.shown..at].to_string()));
            }
            return Ok(Some(Finish::Stop));
        }
        // Hold back what could be the start of a stop text, and incomplete characters.
        let hold = seq
            .req
            .stop
            .iter()
            .filter_map(|s| {
                let last = *text.as_bytes().last()?;
                (1..s.len()).rev().find(|&k| {
                    s.as_bytes()[k - 1] == last && s.is_char_boundary(k) && text.ends_with(&s[..k])
                })
            })
            .max()
            .unwrap_or(0);
        let upto = text.len() - hold;
        if !text.ends_with('\u{FFFD}')
            && upto > seq.shown
            && text.is_char_boundary(seq.shown)
            && text.is_char_boundary(upto)
        {
            let _ = seq
                .req
                .events
                .send(Event::Text(text[seq.shown..upto].to_string()));
            seq.shown = upto;
        }
        if seq.out.len() >= seq.req.max_tokens || seq.cache.len() + 1 >= self.opts.ctx {
            if text.len() > seq.shown && text.is_char_boundary(seq.shown) {
                let _ = seq
                    .req
                    .events
                    .send(Event::Text(text[seq.shown..].to_string()));
                seq.shown = text.len();
            }
            return Ok(Some(Finish::Length));
        }
        seq.next = Some(tok);
        Ok(None)
    }
}
