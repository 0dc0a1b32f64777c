//! [`NodeHandle`]: how the rest of a node drives the swarm task, one command at a time, each
//! answered within a deadline.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{bail, Context, Error, Result};
use libp2p::kad::RecordKey;
use libp2p::{Multiaddr, PeerId};
use moeswarm_market::coverage::CoverageMap;
use moeswarm_market::demand::DemandBook;
use moeswarm_protocol::{ExchangeRequest, ExchangeResponse, ModelId, SignedDemand, SignedHoldings};
use tokio::sync::{mpsc, oneshot};

use super::identity::NodeIdentity;
use super::records::RecordKind;
use super::stats::NodeStats;

/// How long a command to the swarm task may take.
pub const COMMAND_DEADLINE: Duration = Duration::from_secs(30);
/// How long one exchange request may take.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

pub(super) enum Command {
    Subscribe {
        model: ModelId,
        n_layer: u32,
        n_expert: u32,
        reply: oneshot::Sender<Result<()>>,
    },
    /// A record this node signed, as it goes on the wire.
    Publish {
        model: ModelId,
        kind: RecordKind,
        wire: Vec<u8>,
        reply: oneshot::Sender<Result<()>>,
    },
    Learn {
        model: ModelId,
        holdings: Vec<Vec<u8>>,
        demand: Vec<Vec<u8>>,
        reply: oneshot::Sender<()>,
    },
    PublishRaw {
        model: ModelId,
        kind: RecordKind,
        bytes: Vec<u8>,
        reply: oneshot::Sender<Result<()>>,
    },
    Provide {
        model: ModelId,
        reply: oneshot::Sender<Result<()>>,
    },
    Request {
        peer: PeerId,
        request: ExchangeRequest,
        reply: oneshot::Sender<Result<ExchangeResponse>>,
    },
    Providers {
        model: ModelId,
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    DhtRecord {
        key: RecordKey,
        reply: oneshot::Sender<Option<Vec<u8>>>,
    },
    FindPeer {
        peer: PeerId,
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    Coverage {
        model: ModelId,
        reply: oneshot::Sender<Option<CoverageMap>>,
    },
    Heartbeat {
        record: moeswarm_protocol::SignedHeartbeat,
        reply: oneshot::Sender<Result<()>>,
    },
    Demand {
        model: ModelId,
        reply: oneshot::Sender<Option<DemandBook>>,
    },
    Dial {
        addr: Multiaddr,
        reply: oneshot::Sender<Result<()>>,
    },
    Penalize {
        peer: PeerId,
    },
    Credit {
        peer: PeerId,
    },
    AddAddresses {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
    },
    ListenAddrs {
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    Peers {
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    Stats {
        reply: oneshot::Sender<NodeStats>,
    },
}

/// Drives a running node. Cheap to clone; the node stops when every handle is dropped or
/// [`NodeHandle::shutdown`] is called.
#[derive(Clone)]
pub struct NodeHandle {
    tx: mpsc::Sender<Command>,
    /// The node's PeerId.
    pub peer_id: PeerId,
    /// The node's keys.
    pub identity: Arc<NodeIdentity>,
    task: Arc<std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>>,
    status: tokio::sync::watch::Receiver<super::stats::SwarmStatus>,
}

/// How long [`NodeHandle::wait_joined`] waits for the DHT bootstrap once a peer is connected.
pub const BOOTSTRAP_GRACE: Duration = Duration::from_secs(5);

impl NodeHandle {
    pub(super) fn new(
        tx: mpsc::Sender<Command>,
        id: NodeIdentity,
        task: tokio::task::JoinHandle<()>,
        status: tokio::sync::watch::Receiver<super::stats::SwarmStatus>,
    ) -> Self {
        Self {
            tx,
            peer_id: id.peer_id,
            identity: Arc::new(id),
            task: Arc::new(std::sync::Mutex::new(Some(task))),
            status,
        }
    }

    /// Holdings records this node has taken in so far: see [`NodeHandle::records_taken_after`].
    pub fn records_taken(&self) -> u64 {
        self.status.borrow().records_taken
    }

    /// Waits until this node has taken in more holdings records than `seen` (a count from
    /// [`NodeHandle::records_taken`]), or `within` has passed.
    pub async fn records_taken_after(&self, seen: u64, within: Duration) {
        let mut rx = self.status.clone();
        let _ = tokio::time::timeout(within, rx.wait_for(|s| s.records_taken > seen)).await;
    }

    /// Waits until the node, having lost every connection, has one again.
    pub(crate) async fn rejoined(&self) {
        let mut rx = self.status.clone();
        // Err: the node stopped, and nothing is awaited any more.
        if rx.wait_for(|s| s.connected_peers == 0).await.is_err()
            || rx.wait_for(|s| s.connected_peers > 0).await.is_err()
        {
            std::future::pending::<()>().await;
        }
    }

    /// Waits, until `deadline`, for the swarm's status to satisfy `ok`; the last status seen.
    async fn wait_status(
        &self,
        deadline: tokio::time::Instant,
        ok: impl FnMut(&super::stats::SwarmStatus) -> bool,
    ) -> Result<std::result::Result<(), super::stats::SwarmStatus>> {
        let mut rx = self.status.clone();
        let waited =
            tokio::time::timeout_at(deadline, async { rx.wait_for(ok).await.map(|_| ()) }).await;
        match waited {
            Ok(Ok(())) => Ok(Ok(())),
            Ok(Err(_)) => bail!("the node stopped"),
            Err(_) => Ok(Err(*self.status.borrow())),
        }
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| Error::Stopped)?;
        tokio::time::timeout(COMMAND_DEADLINE, rx)
            .await
            .with_context(|| format!("node did not answer within {COMMAND_DEADLINE:?}"))?
            .map_err(|_| Error::Stopped)
    }

    /// Follows the holdings of `model` (of `n_layer` × `n_expert` slabs).
    pub async fn subscribe(&self, model: ModelId, n_layer: u32, n_expert: u32) -> Result<()> {
        self.ask(|reply| Command::Subscribe {
            model,
            n_layer,
            n_expert,
            reply,
        })
        .await?
    }

    /// Publishes a signed holdings record: applied locally, gossiped and put in the DHT.
    pub async fn publish(&self, model: ModelId, record: SignedHoldings) -> Result<()> {
        self.ask(|reply| Command::Publish {
            model,
            kind: RecordKind::Holdings,
            wire: record.to_wire(),
            reply,
        })
        .await?
    }

    /// Publishes a signed demand record: applied locally, gossiped and put in the DHT.
    pub async fn publish_demand(&self, model: ModelId, record: SignedDemand) -> Result<()> {
        self.ask(|reply| Command::Publish {
            model,
            kind: RecordKind::Demand,
            wire: record.to_wire(),
            reply,
        })
        .await?
    }

    /// Hands the node records (wire forms) another peer passed on: each is verified and
    /// applied as if it had arrived by gossip.
    pub async fn learn(
        &self,
        model: ModelId,
        holdings: Vec<Vec<u8>>,
        demand: Vec<Vec<u8>>,
    ) -> Result<()> {
        self.ask(|reply| Command::Learn {
            model,
            holdings,
            demand,
            reply,
        })
        .await
    }

    /// Gossips arbitrary bytes on `model`'s holdings topic, unchecked. For tests of the
    /// receivers' defences (forged and replayed records).
    #[doc(hidden)]
    pub async fn publish_raw(&self, model: ModelId, bytes: Vec<u8>) -> Result<()> {
        self.ask(|reply| Command::PublishRaw {
            model,
            kind: RecordKind::Holdings,
            bytes,
            reply,
        })
        .await?
    }

    /// [`NodeHandle::publish_raw`] on `model`'s demand topic.
    #[doc(hidden)]
    pub async fn publish_raw_demand(&self, model: ModelId, bytes: Vec<u8>) -> Result<()> {
        self.ask(|reply| Command::PublishRaw {
            model,
            kind: RecordKind::Demand,
            bytes,
            reply,
        })
        .await?
    }

    /// Announces in the DHT that this node serves `model`'s manifest.
    pub async fn provide(&self, model: ModelId) -> Result<()> {
        self.ask(|reply| Command::Provide { model, reply }).await?
    }

    /// Sends one exchange request to `peer` and waits for the answer (bounded by
    /// [`REQUEST_DEADLINE`]). A peer this node has no address for is looked up in the DHT
    /// first.
    pub async fn request(
        &self,
        peer: PeerId,
        request: ExchangeRequest,
    ) -> Result<ExchangeResponse> {
        if !self.peers().await?.contains(&peer) {
            // Learn its addresses from the DHT if it can; the swarm dials with all it knows.
            let _ = self.find_peer(peer).await?;
        }
        self.request_once(peer, request)
            .await
            .with_context(|| format!("asking {peer}"))
    }

    /// Tells the swarm where `peer` listens (from its signed record).
    pub async fn add_addresses(&self, peer: PeerId, addrs: Vec<Multiaddr>) {
        if self
            .tx
            .send(Command::AddAddresses { peer, addrs })
            .await
            .is_err()
        {
            tracing::debug!("node stopped: addresses of {peer} not added");
        }
    }

    /// The addresses the DHT knows for `peer` (added to this node's routing table).
    pub async fn find_peer(&self, peer: PeerId) -> Result<Vec<Multiaddr>> {
        self.ask(|reply| Command::FindPeer { peer, reply }).await
    }

    async fn request_once(
        &self,
        peer: PeerId,
        request: ExchangeRequest,
    ) -> Result<ExchangeResponse> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Request {
                peer,
                request,
                reply,
            })
            .await
            .map_err(|_| Error::Stopped)?;
        match tokio::time::timeout(REQUEST_DEADLINE + Duration::from_secs(5), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::Stopped),
            Err(_) => Err(super::stats::RequestFailure::Timeout { peer }.into()),
        }
    }

    /// The nodes the DHT names as serving `model`'s manifest.
    pub async fn providers(&self, model: ModelId) -> Result<Vec<PeerId>> {
        self.ask(|reply| Command::Providers { model, reply }).await
    }

    /// The value of a DHT record, if found.
    pub async fn dht_record(&self, key: RecordKey) -> Result<Option<Vec<u8>>> {
        self.ask(|reply| Command::DhtRecord { key, reply }).await
    }

    /// Says this node is up: a heartbeat signed now, gossiped to every node (see
    /// [`moeswarm_protocol::heartbeat`]).
    pub async fn heartbeat(&self) -> Result<()> {
        use moeswarm_protocol::heartbeat::HEARTBEAT_VALID_SECS;
        use moeswarm_protocol::RecordBody;
        let record = moeswarm_protocol::Heartbeat {
            node: self.identity.key,
            seq: super::records::fresh_seq(),
            expires_at: super::records::now_secs() + HEARTBEAT_VALID_SECS,
        }
        .sign(&self.identity.signing);
        self.ask(|reply| Command::Heartbeat { record, reply })
            .await?
    }

    /// Publishes a heartbeat as it is given (a test's forgery).
    #[doc(hidden)]
    pub async fn publish_raw_heartbeat(
        &self,
        record: moeswarm_protocol::SignedHeartbeat,
    ) -> Result<()> {
        self.ask(|reply| Command::Heartbeat { record, reply })
            .await?
    }

    /// The coverage map of `model` as this node knows it now: its live holders only.
    pub async fn coverage(&self, model: ModelId) -> Result<Option<CoverageMap>> {
        self.ask(|reply| Command::Coverage { model, reply }).await
    }

    /// The demand of `model` as this node knows it now.
    pub async fn demand(&self, model: ModelId) -> Result<Option<DemandBook>> {
        self.ask(|reply| Command::Demand { model, reply }).await
    }

    /// Dials an address.
    pub async fn dial(&self, addr: Multiaddr) -> Result<()> {
        self.ask(|reply| Command::Dial { addr, reply }).await?
    }

    /// Counts a bad answer against `peer`.
    pub async fn penalize(&self, peer: PeerId) {
        if self.tx.send(Command::Penalize { peer }).await.is_err() {
            tracing::debug!("node stopped: penalty of {peer} not counted");
        }
    }

    /// Counts a blob `peer` served that verified here (its standing in the node tables).
    pub async fn credit(&self, peer: PeerId) {
        if self.tx.send(Command::Credit { peer }).await.is_err() {
            tracing::debug!("node stopped: credit of {peer} not counted");
        }
    }

    /// The addresses this node listens on, each with `/p2p/<peer id>` appended.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>> {
        let peer = self.peer_id;
        Ok(self
            .ask(|reply| Command::ListenAddrs { reply })
            .await?
            .into_iter()
            .map(|a| a.with(libp2p::multiaddr::Protocol::P2p(peer)))
            .collect())
    }

    /// The peers connected now.
    pub async fn peers(&self) -> Result<Vec<PeerId>> {
        self.ask(|reply| Command::Peers { reply }).await
    }

    /// Waits until at least `n` peers are connected, or `within` passes.
    pub async fn wait_for_peers(&self, n: usize, within: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        if let Err(s) = self
            .wait_status(deadline, |s| s.connected_peers >= n)
            .await?
        {
            bail!(
                "{} peers connected after {within:?}, wanted {n}",
                s.connected_peers
            );
        }
        Ok(())
    }

    /// Waits until the node has joined: a peer is connected and the DHT bootstrap through it
    /// has finished, so the node knows the peers its bootstrap nodes know. A bootstrap held up
    /// by peers that do not answer (crashed, paused, unreachable) is waited for at most
    /// [`BOOTSTRAP_GRACE`]: the connected peers are enough to go on with, and the DHT keeps
    /// filling in the background. For commands that join, do one thing and leave.
    pub async fn wait_joined(&self, within: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        self.wait_for_peers(1, within)
            .await
            .context("joining through the bootstrap nodes")?;
        let grace = deadline.min(tokio::time::Instant::now() + BOOTSTRAP_GRACE);
        if self
            .wait_status(grace, |s| s.dht_bootstraps > 0)
            .await?
            .is_err()
        {
            tracing::debug!(
                "the DHT bootstrap is still under way: going on with the connected peers"
            );
        }
        Ok(())
    }

    /// What arrived and what was refused.
    pub async fn stats(&self) -> Result<NodeStats> {
        self.ask(|reply| Command::Stats { reply }).await
    }

    /// Stops the node and waits for its task to end (other clones stop working too).
    pub async fn shutdown(self) {
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
    }
}
