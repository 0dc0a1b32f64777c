//! The worker: serves dispatches for the slabs it holds.
//!
//! A dispatch carries, for one layer, several slabs and their token rows. The worker checks it
//! (limits, payload size, that it holds every slab and each is of the ticket's layer), computes
//! each slab's expert on its rows as one batch (the slabs in parallel, handed straight to the
//! kernels' thread pool), and answers the unweighted outputs in the same
//! order. It never sees gating weights. At most `queue` dispatches are computed or waiting at
//! once; beyond that it answers `busy` at once, so the router goes elsewhere instead of
//! waiting. Streams that arrive through a relay are answered with a signature over the reply,
//! so the router knows the worker wrote it even though the relay carried it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::admission::{memory_of, Admission, AdmissionLimits, Proven, DEFAULT_MEMORY_BYTES};
use super::timeline::{mark, mark_ago, Mark};
use crate::error::{bail, Error, Result};
use bytes::Bytes;
use moeswarm_protocol::relay::to_hex;
use moeswarm_protocol::{
    BlobId, DispatchReply, DispatchRequest, Manifest, ReplyStatus, RequestDigest, WireType,
};
use moeswarm_relay::framing::{encode_head, read_head, read_payload, write_encoded, Payload};
use moeswarm_relay::{DataEndpoint, Keypair, PeerId, RelayClient};
use serde::Serialize;

use moeswarm_engine::expert::{forward_each, ExpertWeights};
use moeswarm_engine::kernels::spawn_on_pool;
use moeswarm_engine::layer::load_expert;
use moeswarm_model::store::Store;

pub use crate::faults::WorkerFault;
use crate::faults::{ReplyFault, WorkerHooks};

/// How long a worker waits for a dispatch to arrive whole.
pub const READ_DEADLINE: Duration = Duration::from_secs(30);

/// The time an admitted dispatch's payload has to arrive besides [`PAYLOAD_PACE`]'s.
pub const PAYLOAD_GRACE: Duration = Duration::from_secs(2);
/// The slowest pace an admitted payload may come at, in bytes a second (a phone's uplink).
pub const PAYLOAD_PACE: u64 = 256 * 1024;

/// How long a payload of `bytes` may take to arrive once its dispatch is admitted.
pub fn payload_time(bytes: u64) -> Duration {
    PAYLOAD_GRACE + Duration::from_secs_f64(bytes as f64 / PAYLOAD_PACE as f64)
}

/// What a worker did.
#[derive(Debug, Default, Serialize)]
pub struct WorkerStats {
    /// Dispatches answered with outputs.
    pub answered: AtomicU64,
    /// Dispatches answered busy.
    pub busy: AtomicU64,
    /// Dispatches refused (malformed, unknown slab).
    pub refused: AtomicU64,
    /// Rows computed.
    pub rows: AtomicU64,
}

/// One slab held in memory, ready to compute.
struct HeldSlab {
    layer: u32,
    expert: u32,
    weights: ExpertWeights,
}

/// The experts a worker computes, by slab id. Cloning shares the loaded weights.
#[derive(Default, Clone)]
pub struct HeldExperts {
    slabs: HashMap<BlobId, Arc<HeldSlab>>,
}

impl HeldExperts {
    /// Loads every slab of `manifest` that `store` holds and `into` does not have yet (those
    /// that fail to load, gone bad on disk, are left out).
    pub fn load(store: &Store, manifest: &Manifest, into: &mut Self) -> Result<()> {
        let missing: Vec<(u32, u32)> = store
            .held_slabs(manifest)?
            .into_iter()
            .filter(|&(l, e)| {
                manifest
                    .slab(l, e)
                    .is_some_and(|r| !into.slabs.contains_key(&r.id))
            })
            .collect();
        for slab in missing {
            // A slab that no longer matches its id was dropped from the store by the read
            // (and is then not advertised): the others are served on.
            if let Err(e) = Self::load_some(store, manifest, [slab], into) {
                tracing::warn!("not serving expert {} of layer {}: {e:#}", slab.1, slab.0);
            }
        }
        Ok(())
    }

    /// Loads the given `(layer, expert)` slabs of `manifest` from `store`.
    pub fn load_some(
        store: &Store,
        manifest: &Manifest,
        slabs: impl IntoIterator<Item = (u32, u32)>,
        into: &mut Self,
    ) -> Result<()> {
        for (l, e) in slabs {
            let id = manifest
                .slab(l, e)
                .map(|r| r.id)
                .ok_or_else(|| Error::invalid("no slab"))?;
            into.slabs.insert(
                id,
                Arc::new(HeldSlab {
                    layer: l,
                    expert: e,
                    weights: load_expert(store, manifest, l, e)?,
                }),
            );
        }
        Ok(())
    }

    /// Lets go of the slabs `store` no longer holds (the node dropped them).
    pub fn retain_stored(&mut self, store: &Store) -> Result<()> {
        let mut gone = Vec::new();
        for id in self.slabs.keys() {
            if !store.contains(id)? {
                gone.push(*id);
            }
        }
        for id in gone {
            self.slabs.remove(&id);
        }
        Ok(())
    }

    /// How many slabs are loaded.
    pub fn len(&self) -> usize {
        self.slabs.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.slabs.is_empty()
    }

    /// Computes a checked dispatch: the outputs of every slab, in order (the slabs in
    /// parallel on the kernels' pool), from each slab's rows (`rows`, in the same order).
    fn compute(&self, req: &DispatchRequest, rows: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let width = req.n_embd as usize;
        let mut jobs = Vec::with_capacity(req.slabs.len());
        for (s, part) in req.slabs.iter().zip(rows) {
            let held = self
                .slabs
                .get(&s.slab)
                .ok_or_else(|| Error::invalid(format!("slab {} is not held here", s.slab)))?;
            if part.len() != s.rows as usize * width {
                return Err(Error::invalid("fewer rows than the slabs declare"));
            }
            jobs.push((&held.weights, part));
        }
        Ok(forward_each(&jobs)?)
    }

    /// Why this worker will not compute `req`, if it will not.
    fn refusal(&self, req: &DispatchRequest) -> Option<String> {
        if let Err(e) = req.validate() {
            return Some(e.to_string());
        }
        for s in &req.slabs {
            match self.slabs.get(&s.slab) {
                None => return Some(format!("slab {} is not held here", s.slab)),
                Some(h) if h.layer != req.ticket.layer || h.expert != s.expert => {
                    return Some(format!(
                        "slab {} is layer {} expert {}, not layer {} expert {}",
                        s.slab, h.layer, h.expert, req.ticket.layer, s.expert
                    ))
                }
                Some(h) if h.weights.n_embd() != req.n_embd as usize => {
                    return Some(format!(
                        "rows of width {} for an expert of width {}",
                        req.n_embd,
                        h.weights.n_embd()
                    ))
                }
                Some(_) => {}
            }
        }
        None
    }
}

/// A running worker service.
pub struct WorkerService {
    /// What it did.
    pub stats: Arc<WorkerStats>,
    experts: Arc<std::sync::RwLock<Arc<HeldExperts>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

#[derive(Clone)]
struct Shared {
    experts: Arc<std::sync::RwLock<Arc<HeldExperts>>>,
    admission: Admission,
    /// The routers answered so far: whose share a dispatch draws on.
    proven: Arc<Proven>,
    stats: Arc<WorkerStats>,
    /// Where test faults act (no-ops in the binary users build).
    hooks: WorkerHooks,
    /// Answers computed so far (which of them lie, for a lying worker).
    computed: Arc<AtomicU64>,
    keypair: Keypair,
}

impl WorkerService {
    /// Serves `experts` on the direct endpoint (if any) and on streams the relay splices to
    /// this node (if registered), with at most `queue` dispatches at once.
    pub fn spawn(
        experts: HeldExperts,
        direct: Option<DataEndpoint>,
        relay: Option<RelayClient>,
        keypair: Keypair,
        queue: usize,
        fault: WorkerFault,
    ) -> Self {
        let shared = Shared {
            experts: Arc::new(std::sync::RwLock::new(Arc::new(experts))),
            admission: Admission::new(AdmissionLimits {
                slots: queue,
                memory_bytes: DEFAULT_MEMORY_BYTES,
            }),
            proven: Arc::default(),
            stats: Arc::default(),
            hooks: WorkerHooks::new(fault),
            computed: Arc::default(),
            keypair,
        };
        let mut tasks = Vec::new();
        if let Some(ep) = direct {
            let sh = shared.clone();
            tasks.push(tokio::spawn(async move {
                while let Some((conn, peer, _)) = ep.accept().await {
                    let sh = sh.clone();
                    let from = Some(conn.remote_address().ip().to_canonical());
                    tokio::spawn(async move {
                        while let Ok((send, recv)) = conn.accept_bi().await {
                            tokio::spawn(serve_stream(sh.clone(), send, recv, peer, from));
                        }
                    });
                }
            }));
        }
        if let Some(relay) = relay {
            let sh = shared.clone();
            tasks.push(tokio::spawn(relay.serve_forever(
                move |send, recv, peer| {
                    tokio::spawn(serve_stream(sh.clone(), send, recv, peer, None));
                },
            )));
        }
        Self {
            stats: shared.stats,
            experts: shared.experts,
            tasks,
        }
    }

    /// The experts served now.
    pub fn experts(&self) -> HeldExperts {
        self.experts
            .read()
            .map(|e| (**e).clone())
            .unwrap_or_default()
    }

    /// Serves `experts` from now on (after the node fetched more slabs).
    pub fn set_experts(&self, experts: HeldExperts) {
        if let Ok(mut e) = self.experts.write() {
            *e = Arc::new(experts);
        }
    }

    /// Stops serving.
    pub fn shutdown(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for WorkerService {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Writes `header` and `payload` (its pieces in order); through a relay (`answered` is then
/// the digest of the request as received), signed so that the router can tell the reply and
/// the request it answers are the ones it sent and the worker wrote.
async fn reply(
    sh: &Shared,
    send: &mut quinn::SendStream,
    mut header: DispatchReply,
    payload: Vec<Bytes>,
    answered: Option<&RequestDigest>,
) -> Result<()> {
    if let Some(digest) = answered {
        let sig = sh
            .keypair
            .sign(&header.signed_bytes(&payload.concat(), digest))
            .map_err(|e| Error::invalid(format!("signing a reply: {e}")))?;
        header.signature = Some(to_hex(&sig));
    }
    let seq = header.ticket.seq;
    let len: usize = payload.iter().map(Bytes::len).sum();
    let head = encode_head(&header, len as u64)?;
    mark(seq, Mark::ReplyEncoded);
    write_encoded(send, head, payload).await?;
    mark(seq, Mark::ReplyWritten);
    Ok(())
}

async fn serve_stream(
    sh: Shared,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    router: PeerId,
    from: Option<std::net::IpAddr>,
) {
    let accepted = Instant::now();
    if let Err(e) = serve_one(&sh, &mut send, &mut recv, router, from, accepted).await {
        tracing::debug!("dispatch stream ended: {e:#}");
    }
    // Already finished or reset by the router: nothing more to send either way.
    send.finish().ok();
    // Whatever the router still sends on this stream is not wanted.
    recv.stop(0u32.into()).ok();
}

/// Computes an admitted dispatch on the kernels' pool, handed there straight from the runtime
/// (no blocking thread parked to wait); the admission is held until the compute ends.
async fn compute_on_pool(
    experts: Arc<HeldExperts>,
    req: DispatchRequest,
    payload: Payload,
    admitted: impl Send + 'static,
) -> Result<Vec<Vec<f32>>> {
    let seq = req.ticket.seq;
    let (done, computed) = futures::channel::oneshot::channel();
    spawn_on_pool(
        move || {
            let _admitted = admitted;
            mark(seq, Mark::ComputeBegan);
            // Each slab's rows decoded straight from the pieces the payload came in.
            let rows = req.unpack(payload.parts());
            mark(seq, Mark::PayloadDecoded);
            let out = rows
                .map_err(|e| Error::invalid(e.to_string()))
                .and_then(|rows| experts.compute(&req, rows));
            mark(seq, Mark::ComputeEnded);
            out
        },
        move |out| {
            let _ = done.send(out);
        },
    );
    let out = match computed.await {
        Ok(Ok(out)) => out,
        Ok(Err(_)) => Err(Error::invalid("the compute panicked")),
        Err(_) => Err(Error::invalid("the compute ended without an answer")),
    };
    mark(seq, Mark::ComputeReturned);
    out
}

async fn serve_one(
    sh: &Shared,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    router: PeerId,
    from: Option<std::net::IpAddr>,
    accepted: Instant,
) -> Result<()> {
    let via_relay = from.is_none();
    sh.hooks.before_reading().await;
    let deadline = tokio::time::Instant::now() + READ_DEADLINE;
    let head = tokio::time::timeout_at(deadline, read_head::<DispatchRequest>(recv)).await;
    let (req, declared) = match head {
        Ok(Ok(Some(f))) => f,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => {
            sh.stats.refused.fetch_add(1, Ordering::Relaxed);
            bail!("bad dispatch: {e:#}")
        }
        Err(_) => bail!("dispatch did not arrive in time"),
    };
    let seq = req.ticket.seq;
    mark_ago(seq, Mark::StreamAccepted, accepted.elapsed());
    mark(seq, Mark::HeadRead);
    // Busy and refused answers are decided on the header alone: the payload is never read,
    // and their signature covers the header (they carry no result to forge).
    let header_only = via_relay.then(|| req.digest_of_header());
    let experts = sh
        .experts
        .read()
        .map_err(|_| Error::invalid("poisoned"))?
        .clone();
    if let Some(reason) = experts.refusal(&req) {
        sh.stats.refused.fetch_add(1, Ordering::Relaxed);
        let r = DispatchReply::without_outputs(&req, ReplyStatus::Refused { reason });
        return reply(sh, send, r, Vec::new(), header_only.as_ref()).await;
    }
    let share = sh.proven.key(router, from);
    let Ok(admitted) = sh
        .admission
        .admit(share, memory_of(req.rows_len().max(req.payload_len())))
    else {
        sh.stats.busy.fetch_add(1, Ordering::Relaxed);
        let r = DispatchReply::without_outputs(&req, ReplyStatus::Busy);
        return reply(sh, send, r, Vec::new(), header_only.as_ref()).await;
    };
    mark(seq, Mark::Admitted);
    // Admitted, the payload must come at a steady pace: a header alone holds a slot for
    // seconds, not the whole read deadline.
    let paced = tokio::time::Instant::now() + payload_time(req.payload_len());
    let payload = tokio::time::timeout_at(
        deadline.min(paced),
        read_payload(recv, declared, req.payload_len()),
    )
    .await;
    let payload = match payload {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            sh.stats.refused.fetch_add(1, Ordering::Relaxed);
            bail!("bad dispatch payload: {e:#}")
        }
        Err(_) => bail!("dispatch payload did not arrive in time"),
    };
    mark(seq, Mark::PayloadRead);
    let digest = via_relay.then(|| req.digest(&payload.contiguous()));
    let signed = digest.as_ref();
    if let Some(d) = sh.hooks.extra_compute() {
        tokio::time::sleep(d).await;
    }
    let out = compute_on_pool(experts, req.clone(), payload, admitted).await;
    let mut out = match out {
        Ok(o) => o,
        Err(e) => {
            sh.stats.refused.fetch_add(1, Ordering::Relaxed);
            let r = DispatchReply::without_outputs(
                &req,
                ReplyStatus::Refused {
                    reason: format!("{e:#}"),
                },
            );
            return reply(sh, send, r, Vec::new(), header_only.as_ref()).await;
        }
    };
    sh.stats.answered.fetch_add(1, Ordering::Relaxed);
    sh.proven.answered(router);
    sh.stats.rows.fetch_add(
        req.slabs.iter().map(|s| s.rows as u64).sum(),
        Ordering::Relaxed,
    );
    let header = DispatchReply {
        ticket: req.ticket.clone(),
        status: ReplyStatus::Ok,
        n_embd: req.n_embd,
        slabs: req.slabs.clone(),
        wire: req.wire,
        signature: None,
    };
    let n = sh.computed.fetch_add(1, Ordering::Relaxed);
    sh.hooks.tamper_outputs(n, &mut out);
    let body = reply_body(req.wire, out);
    if sh.hooks.honest() {
        return reply(sh, send, header, body, signed).await;
    }
    let row_bytes = (req.n_embd as u64 * req.wire.size()) as usize;
    reply_lying(sh, send, header, body.concat(), row_bytes, signed).await
}

/// Each slab's outputs as the reply's payload: f32 on a little-endian machine is its own wire
/// form, so each slab's outputs are handed to quinn as they are; other wire types are
/// encoded, each value once.
fn reply_body(wire: WireType, outputs: Vec<Vec<f32>>) -> Vec<Bytes> {
    if wire == WireType::F32 && cfg!(target_endian = "little") {
        return outputs
            .into_iter()
            .map(|o| Bytes::from_owner(LittleEndianF32(o)))
            .collect();
    }
    let mut bytes =
        Vec::with_capacity(outputs.iter().map(Vec::len).sum::<usize>() * wire.size() as usize);
    for o in &outputs {
        wire.encode_into(o, &mut bytes);
    }
    vec![Bytes::from(bytes)]
}

/// f32 values seen as their bytes, which on a little-endian machine are their wire form.
struct LittleEndianF32(Vec<f32>);

impl AsRef<[u8]> for LittleEndianF32 {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// A test fault's answer (`bytes` the honest payload): lied about as the fault says.
async fn reply_lying(
    sh: &Shared,
    send: &mut quinn::SendStream,
    mut header: DispatchReply,
    mut bytes: Vec<u8>,
    row_bytes: usize,
    signed: Option<&RequestDigest>,
) -> Result<()> {
    match sh.hooks.tamper_reply(&mut header, &mut bytes, row_bytes) {
        ReplyFault::Send => {}
        ReplyFault::SendTwice => {
            let again = vec![Bytes::copy_from_slice(&bytes)];
            reply(sh, send, header.clone(), again, signed).await?
        }
        ReplyFault::StallThenSend(d) => tokio::time::sleep(d).await,
        ReplyFault::SendHalfThenFreeze => {
            let frame = [
                moeswarm_protocol::dispatch::frame_head(
                    &serde_json::to_vec(&header).map_err(|e| Error::invalid(e.to_string()))?,
                    bytes.len() as u64,
                ),
                bytes.clone(),
            ]
            .concat();
            send.write_all(&frame[..frame.len() / 2])
                .await
                .map_err(|e| Error::invalid(e.to_string()))?;
            std::future::pending::<()>().await;
        }
    }
    reply(sh, send, header, vec![Bytes::from(bytes)], signed).await
}
