//! What speculative decoding costs and gives, in this process.
//!
//! Part 1, a verification pass: one pass over k + 1 positions of one sequence against a
//! single-token decode step at the same position, on the benchmark model (the reference is the
//! single-token step measured in the same run; target ≤ 1.3× for k + 1 ≤ 5). Part 2, the
//! models trained here (`sim/models/`), greedy over a few prompts: tokens/s, tokens a pass and
//! expert requests a token (the round trips a swarm makes) with drafting off, by prompt
//! lookup, by the MTP block and by an always-right drafter, beside llama.cpp on the same file
//! without drafts and with its own prompt-lookup drafts (`llamacpp_speculative.py`).
//! Through a swarm: `cargo bench -p moeswarm-sim --bench speculation`.
//!
//! `cargo bench -p moeswarm-engine --bench speculation` (`MOESWARM_BENCH_ARCH=qwen35moe` for
//! the hybrid benchmark model).

use moeswarm_testkit as common;

use std::time::Instant;

use common::drafters::KnowingDrafter;
use moeswarm_engine::generate::{
    generate, generate_drafted, GenerateOptions, GenerateReport, LocalModel, ModelSource,
};
use moeswarm_engine::speculative::{Speculation, SpeculationConfig};
use moeswarm_engine::text::SamplingConfig;
use moeswarm_engine::trunk::ForwardTiming;

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    verification_pass(&rt)?;
    trained_models(&rt)
}

fn verification_pass(rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    for path in [common::bench::bench_model()?, common::trained_model()] {
        verification_pass_of(rt, &path)?;
    }
    Ok(())
}

/// The best of a few passes over 1..=5 positions from the same position of `path`'s model,
/// beside llama.cpp's on the same file.
fn verification_pass_of(
    rt: &tokio::runtime::Runtime,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let model = LocalModel::load(&ModelSource::Gguf(path.to_path_buf()))?;
    let h = model.trunk.hyper().clone();
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 37 + 11) % h.n_vocab).collect();
    let mut cache = model.trunk.new_cache();
    let mut t = ForwardTiming::default();
    rt.block_on(
        model
            .trunk
            .forward(&mut cache, &prompt, &model.experts, &mut t),
    )?;
    let reps = 8;
    // Each pass from the same position: checkpoint, run, roll back to it.
    let mut time_rows = |rows: usize| -> anyhow::Result<(f64, ForwardTiming)> {
        let tokens: Vec<u32> = (0..rows as u32)
            .map(|i| (i * 101 + 7) % h.n_vocab)
            .collect();
        let mut best = (f64::MAX, ForwardTiming::default());
        for _ in 0..reps {
            let at = cache.len();
            model.trunk.checkpoint(&mut cache);
            let mut t = ForwardTiming::default();
            let s = Instant::now();
            rt.block_on(
                model
                    .trunk
                    .forward(&mut cache, &tokens, &model.experts, &mut t),
            )?;
            let secs = s.elapsed().as_secs_f64();
            if secs < best.0 {
                best = (secs, t);
            }
            model.trunk.rollback(&mut cache, at)?;
        }
        Ok(best)
    };
    let runs: Vec<(f64, ForwardTiming)> =
        (1..=5).map(&mut time_rows).collect::<anyhow::Result<_>>()?;
    let ours: Vec<f64> = runs.iter().map(|r| r.0).collect();
    let theirs = llama_cpp_passes(path, reps);
    println!(
        "verification pass on {} (best of {reps}), against the single-token step:",
        path.display()
    );
    for rows in 1..=5 {
        let mine = ours[rows - 1];
        let beside = match &theirs {
            Ok(l) => format!(
                "; llama.cpp {:.2} ms, {:.2}x",
                l[rows - 1] * 1e3,
                l[rows - 1] / l[0]
            ),
            Err(e) => format!("; llama.cpp: {e}"),
        };
        let t = &runs[rows - 1].1;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        println!(
            "  {rows} positions: {:.2} ms, {:.2}x{beside} (ours: mixers {:.2}, gating {:.2}, shared expert {:.2}, experts {:.2}, head {:.2} ms)",
            mine * 1e3,
            mine / ours[0],
            ms(t.attention + t.deltanet),
            ms(t.gating),
            ms(t.shared_expert),
            ms(t.experts),
            ms(t.head)
        );
    }
    Ok(())
}

/// llama.cpp's best times for passes over 1..=5 positions (`llamacpp_verify.py`).
fn llama_cpp_passes(path: &std::path::Path, reps: usize) -> anyhow::Result<Vec<f64>> {
    if !common::bench::llama_cpp_available() {
        anyhow::bail!("not available (python3 -m pip install llama-cpp-python)");
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/llamacpp_verify.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(path)
        .args([rayon::current_num_threads().to_string(), reps.to_string()])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "failed: {}",
        err.lines().last().unwrap_or_default()
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    (1..=5)
        .map(|r| {
            v["seconds"][r.to_string()]
                .as_f64()
                .ok_or_else(|| anyhow::anyhow!("no time for {r} positions"))
        })
        .collect()
}

/// Prompts the trained models continue in part 2.
const PROMPTS: [&str; 5] = [
    "The best thing about a good friend is",
    "A man who",
    "In the beginning",
    "Python is a language that",
    "Never trust",
];
/// Tokens generated per prompt.
const TOKENS: usize = 64;

/// What one way of drafting did over [`PROMPTS`].
#[derive(Default)]
struct Totals {
    tokens: usize,
    /// Tokens after the first (which the prompt's pass gives).
    decoded: usize,
    passes: usize,
    rounds: u64,
    secs: f64,
}

impl Totals {
    fn add(&mut self, r: &GenerateReport, secs: f64) {
        self.tokens += r.tokens.len();
        self.decoded += r.tokens.len().saturating_sub(1);
        self.passes += r.speculation.passes;
        self.rounds += r.speculation.expert_rounds;
        self.secs += secs;
    }

    fn rounds_a_token(&self) -> f64 {
        self.rounds as f64 / self.tokens.max(1) as f64
    }
}

fn trained_models(rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    for path in [
        common::trained_model(),
        common::trained("fortunes-qwen3moe-q8_0.gguf"),
    ] {
        trained_model(rt, &path)?;
    }
    Ok(())
}

fn trained_model(rt: &tokio::runtime::Runtime, path: &std::path::Path) -> anyhow::Result<()> {
    let m = LocalModel::load(&ModelSource::Gguf(path.to_path_buf()))?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    println!(
        "{name}, greedy, {TOKENS} tokens after each of {} prompts, local, {} threads:",
        PROMPTS.len(),
        rayon::current_num_threads()
    );
    let mut modes = vec![(Speculation::Off, None), (Speculation::Ngram, Some(4))];
    if m.trunk.has_mtp() {
        modes.extend([1, 3, 4].map(|k| (Speculation::Mtp, Some(k))));
    }
    let opts = |prompt: &str, speculation| GenerateOptions {
        prompt: prompt.into(),
        max_tokens: TOKENS,
        raw: true,
        sampling: SamplingConfig::default(),
        speculation,
        keep_logits: false,
    };
    let mut plain_texts = Vec::new();
    let mut off_rounds = 0.0;
    for (mode, k) in modes {
        let spec = SpeculationConfig::new(mode, k, &m.trunk)?;
        let mut t = Totals::default();
        // One warm-up run, then each prompt once.
        rt.block_on(generate(
            &m.trunk,
            &m.experts,
            &m.tokenizer,
            &opts(PROMPTS[0], spec),
            |_| {},
        ))?;
        for p in PROMPTS {
            let s = Instant::now();
            let r = rt.block_on(generate(
                &m.trunk,
                &m.experts,
                &m.tokenizer,
                &opts(p, spec),
                |_| {},
            ))?;
            t.add(&r, s.elapsed().as_secs_f64());
            if mode == Speculation::Off {
                let mut text = r.prompt_tokens.clone();
                text.extend(&r.tokens);
                plain_texts.push(text);
            }
        }
        if mode == Speculation::Off {
            off_rounds = t.rounds_a_token();
        }
        print_totals(&format!("{mode:?} k={}", k.unwrap_or(0)), &t, off_rounds);
    }
    // The always-right drafter bounds what drafting can give: k + 1 tokens a pass.
    let mut t = Totals::default();
    for (p, text) in PROMPTS.iter().zip(plain_texts) {
        let mut d = KnowingDrafter { text, wrong: false };
        let o = opts(p, SpeculationConfig::OFF);
        let s = Instant::now();
        let r = rt.block_on(generate_drafted(
            &m.trunk,
            &m.experts,
            &m.tokenizer,
            &o,
            Some(&mut d),
            4,
            |_| {},
        ))?;
        t.add(&r, s.elapsed().as_secs_f64());
    }
    print_totals("always right k=4", &t, off_rounds);
    llama_cpp_beside(path)
}

fn print_totals(what: &str, t: &Totals, off_rounds: f64) {
    println!(
        "  {what}: {:.0} tokens/s, {:.2} tokens a pass, {:.2} expert round trips a token ({:.2}x fewer than off)",
        t.tokens as f64 / t.secs,
        t.decoded as f64 / t.passes.max(1) as f64,
        t.rounds_a_token(),
        off_rounds / t.rounds_a_token().max(1e-9)
    );
}

/// llama.cpp on the same file and prompts: greedy without drafts and with its prompt-lookup
/// drafts (k = 4).
fn llama_cpp_beside(path: &std::path::Path) -> anyhow::Result<()> {
    if !common::bench::llama_cpp_available() {
        println!("  llama.cpp: not available (python3 -m pip install llama-cpp-python)");
        return Ok(());
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/llamacpp_speculative.py"
    );
    let threads = rayon::current_num_threads().to_string();
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(path)
        .args([threads.as_str(), &TOKENS.to_string(), "4"])
        .args(PROMPTS)
        .output()?;
    if !out.status.success() {
        anyhow::bail!(
            "llama.cpp run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let plain = v["plain_tps"].as_f64().unwrap_or(0.0);
    match v["prompt_lookup_tps"].as_f64() {
        Some(lookup) => println!(
            "  llama.cpp {}: {plain:.0} tokens/s without drafts, {lookup:.0} with prompt lookup k=4 ({:.2}x; same text: {})",
            v["llama_cpp_python"].as_str().unwrap_or("?"),
            lookup / plain,
            v["same_text"]
        ),
        None => println!(
            "  llama.cpp {}: {plain:.0} tokens/s without drafts; prompt lookup fails: {}",
            v["llama_cpp_python"].as_str().unwrap_or("?"),
            v["prompt_lookup_error"].as_str().unwrap_or("?")
        ),
    }
    Ok(())
}
