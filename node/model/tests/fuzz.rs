//! The GGUF reader and the slab reader, fed mutated and truncated copies of real files (a
//! bounded number of cases, so it runs in CI): no panic, no input taking over a second, and
//! what parses can be asked for its hyper-parameters and expert layers without a panic.

use moeswarm_testkit as common;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::data;
use moeswarm_model::gguf::Gguf;
use moeswarm_model::hparams::{expert_layers, hyper_params, layers_run};
use moeswarm_model::SlabView;
use proptest::prelude::*;

fn quick<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{what} took {:?}",
        start.elapsed()
    );
    out
}

fn model() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| std::fs::read(data("tiny-q8_0.gguf")).unwrap())
}

/// One slab of the tiny model, as slicing writes it.
fn slab() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = moeswarm_model::store::Store::open(dir.path()).unwrap();
        let (_, manifest, _) =
            moeswarm_model::slice::slice(&data("tiny-q8_0.gguf"), &store, Default::default())
                .unwrap();
        store.read(&manifest.slab(0, 0).unwrap().id).unwrap()
    })
}

/// `bytes` with `edits` (position as a fraction of `within`, new byte) applied, cut to
/// `keep` of its length.
fn mutated(bytes: &[u8], within: usize, edits: &[(f64, u8)], keep: f64) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for &(at, v) in edits {
        let i = ((at * within as f64) as usize).min(b.len() - 1);
        b[i] = v;
    }
    b.truncate(((keep * b.len() as f64) as usize).max(1));
    b
}

fn edits() -> impl Strategy<Value = Vec<(f64, u8)>> {
    proptest::collection::vec((0.0f64..1.0, any::<u8>()), 1..8)
}

fn keep() -> impl Strategy<Value = f64> {
    prop_oneof![Just(1.0), 0.0f64..1.0]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_mutated_gguf_header_is_read_or_refused_never_a_panic(edits in edits(), keep in keep()) {
        let header = Gguf::from_bytes(model()).unwrap().data_offset as usize;
        let bytes = mutated(model(), header, &edits, keep);
        if let Ok(g) = quick("reading", || Gguf::from_bytes(&bytes)) {
            quick("layers", || layers_run(&g).err());
            quick("hyper-parameters", || hyper_params(&g).err());
            quick("expert layers", || expert_layers(&g).err());
        }
    }

    #[test]
    fn a_mutated_slab_is_read_or_refused_never_a_panic(edits in edits(), keep in keep()) {
        let bytes = mutated(slab(), slab().len(), &edits, keep);
        quick("slab", || SlabView::parse(&bytes).err());
    }
}
