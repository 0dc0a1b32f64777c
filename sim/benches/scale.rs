//! The scale simulator's speed: the wall time of `moeswarm sim --scale N --hours H` over the
//! default scenario (Qwen3.5-122B-A10B's 12,288 slabs, the default classes) at 1,000, 10,000
//! and 100,000 nodes, beside the budget of 60 s for 10,000 nodes × 24 h; and, in the same run,
//! the quick choice beside the market's choice over every slab on one short history (the two
//! must tell the same history byte for byte).
//!
//! `cargo bench -p moeswarm-sim --bench scale` (env `MOESWARM_BENCH_SCALE`: the runs, as
//! `NODES:HOURS` separated by commas; default `1000:24,10000:24,100000:1`).

use std::time::Instant;

use moeswarm_sim::scale::report::ScaleReport;
use moeswarm_sim::scale::run;
use moeswarm_sim::scale::scenario::Scenario;

/// The budget for 10,000 nodes × 24 simulated hours, seconds of wall time.
const BUDGET_SECS: f64 = 60.0;

fn timed(sc: &Scenario, nodes: usize, hours: f64) -> (ScaleReport, f64) {
    let t = Instant::now();
    let r = run(sc, nodes, hours, 1);
    (r, t.elapsed().as_secs_f64())
}

/// Peak resident memory of this process so far, MB (Linux).
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn main() {
    let sc = Scenario::default_scenario();
    // The reference: one short history told by the market's choice over every slab, then by
    // the quick choice.
    let (nodes, hours) = (500, 0.25);
    let mut full_sc = sc.clone();
    full_sc.market.quick_choice = false;
    let (full, full_secs) = timed(&full_sc, nodes, hours);
    let (mut quick, quick_secs) = timed(&sc, nodes, hours);
    let answered = quick.rounds.quick;
    quick.rounds.quick = 0;
    let same = serde_json::to_string(&quick).unwrap() == serde_json::to_string(&full).unwrap();
    println!(
        "{nodes} nodes x {hours} h: decide over every slab {full_secs:.2} s, quick choice \
         {quick_secs:.2} s ({:.0}x faster; {answered} of {} rounds answered quickly); same \
         history: {same}",
        full_secs / quick_secs,
        full.rounds.decided
    );
    assert!(same, "the quick choice told another history");

    let runs = std::env::var("MOESWARM_BENCH_SCALE")
        .unwrap_or_else(|_| "1000:24,10000:24,100000:1".into());
    println!("nodes    hours   wall s   events    events/s   slabs fetched   wall / 60 s");
    for spec in runs.split(',') {
        let (n, h) = spec.split_once(':').expect("NODES:HOURS");
        let (n, h): (usize, f64) = (n.parse().expect("nodes"), h.parse().expect("hours"));
        let (r, secs) = timed(&sc, n, h);
        println!(
            "{n:>7} {h:>6} {secs:>8.1} {:>9} {:>10.0} {:>14} {:>12.2}",
            r.events,
            r.events as f64 / secs,
            r.rounds.fetched,
            secs / BUDGET_SECS
        );
        assert!(r.violations.is_empty(), "{:?}", r.violations);
    }
    if let Some(mb) = peak_rss_mb() {
        println!("peak resident memory: {mb:.0} MB");
    }
}
