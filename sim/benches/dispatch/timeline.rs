//! Collects the marks the data plane takes along a dispatch (`moeswarm_node::dataplane::
//! timeline`) and splits round trips into their parts.
//!
//! A `tracing` subscriber that takes only the timeline's events, stamping each as it comes;
//! router and worker run in this process, so their stamps share a clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moeswarm_node::dataplane::timeline::{Mark, TARGET};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

/// The marks taken so far, by ticket sequence.
#[derive(Clone, Default)]
pub struct Collector(Arc<Mutex<Vec<(u64, Mark, Instant)>>>);

impl Collector {
    /// Collects from now on, for the whole process.
    pub fn install() -> anyhow::Result<Self> {
        let c = Self::default();
        tracing::subscriber::set_global_default(c.clone())?;
        Ok(c)
    }

    /// The marks of the one dispatch that ran since the last call (the one that decoded its
    /// outputs), each once.
    pub fn take_dispatch(&self) -> Option<HashMap<Mark, Instant>> {
        let all = std::mem::take(&mut *self.0.lock().unwrap());
        let seq = all
            .iter()
            .find(|(_, m, _)| *m == Mark::OutputsDecoded)
            .map(|(s, _, _)| *s)?;
        Some(
            all.into_iter()
                .filter(|(s, _, _)| *s == seq)
                .map(|(_, m, t)| (m, t))
                .collect(),
        )
    }
}

#[derive(Default)]
struct Fields {
    seq: Option<u64>,
    mark: Option<Mark>,
    ago_ns: u64,
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "seq" => self.seq = Some(value),
            "ago_ns" => self.ago_ns = value,
            _ => {}
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "name" {
            self.mark = Mark::from_name(value);
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl Subscriber for Collector {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.target() == TARGET {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        meta.target() == TARGET
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::TRACE)
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let now = Instant::now();
        let mut f = Fields::default();
        event.record(&mut f);
        if let (Some(seq), Some(mark)) = (f.seq, f.mark) {
            let at = now - Duration::from_nanos(f.ago_ns);
            self.0.lock().unwrap().push((seq, mark, at));
        }
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// One part of a round trip: from one point to the next along the causal chain.
pub struct Part {
    /// Where it ends (its start is the previous part's end, or the call).
    pub to: Point,
    /// What happens in it.
    pub what: &'static str,
}

/// A point of a round trip: the caller's, or a data-plane mark.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Point {
    /// The router's trunk hands the layer to the executor.
    Call,
    /// A mark.
    At(Mark),
    /// The executor hands the outputs back.
    Returned,
}

/// The round trip's parts, each following the one before: every point of the chain comes after
/// the previous one (the marks left out, the ends of the writes, overlap the next part).
pub const CHAIN: [Part; 17] = [
    part(
        Mark::RowsGathered,
        "router: into the executor, replica choice, rows gathered as wire bytes",
    ),
    part(Mark::StreamOpened, "router: stream opened"),
    part(Mark::HeadEncoded, "router: header encoded (JSON)"),
    part(
        Mark::StreamAccepted,
        "first bytes written, carried, stream accepted",
    ),
    part(Mark::HeadRead, "worker: header read and parsed"),
    part(Mark::Admitted, "worker: checks and admission"),
    part(Mark::PayloadRead, "worker: rest of the payload read"),
    part(Mark::ComputeBegan, "worker: hop to the kernels' pool"),
    part(Mark::PayloadDecoded, "worker: rows decoded from wire bytes"),
    part(Mark::ComputeEnded, "worker: compute"),
    part(Mark::ComputeReturned, "worker: hop back to the runtime"),
    part(
        Mark::ReplyEncoded,
        "worker: outputs encoded, header encoded",
    ),
    part(
        Mark::ReplyHeadRead,
        "reply written, carried, its header read",
    ),
    part(Mark::ReplyRead, "router: rest of the reply read"),
    part(Mark::ReplyJudged, "router: reply judged against the ticket"),
    part(
        Mark::OutputsDecoded,
        "router: outputs decoded and split by slab",
    ),
    Part {
        to: Point::Returned,
        what: "router: checks, back to the trunk",
    },
];

const fn part(mark: Mark, what: &'static str) -> Part {
    Part {
        to: Point::At(mark),
        what,
    }
}

/// One round trip's points, in milliseconds after the call.
pub fn offsets(call: Instant, marks: &HashMap<Mark, Instant>, returned: Instant) -> Offsets {
    let ms = |t: Instant| t.saturating_duration_since(call).as_secs_f64() * 1e3;
    let mut at: HashMap<Point, f64> = marks.iter().map(|(m, t)| (Point::At(*m), ms(*t))).collect();
    at.insert(Point::Call, 0.0);
    at.insert(Point::Returned, ms(returned));
    Offsets(at)
}

/// Where each point of one round trip fell, in milliseconds after the call.
pub struct Offsets(HashMap<Point, f64>);

impl Offsets {
    /// The length of each part of [`CHAIN`] (`None` where a point is missing).
    pub fn parts(&self) -> Vec<Option<f64>> {
        let mut from = Point::Call;
        CHAIN
            .iter()
            .map(|p| {
                let d = self.at(p.to).zip(self.at(from)).map(|(b, a)| b - a);
                from = p.to;
                d
            })
            .collect()
    }

    /// When `point` fell.
    pub fn at(&self, point: Point) -> Option<f64> {
        self.0.get(&point).copied()
    }
}
