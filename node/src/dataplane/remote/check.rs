//! Checking workers' answers, so that a worker that lies is caught and a wrong answer is not
//! used.
//!
//! A dispatch is checked when the market's sampling rule says so for its worker
//! ([`moeswarm_market::trust`]: always while the worker is new or after it was caught, at the
//! policy's rate once proven), decided as it is sent, so that the second opinion is asked for
//! at the same time and costs no round trip after the answer; and always when an answer holds
//! a value that is not finite (then the second opinion on that group comes after). The check
//! re-computes a uniform sample of the dispatch's groups (the policy's `groups`; all of them
//! in a dispatch with no more, as a decode dispatch of a few sequences is; what a sample
//! catches is stated in [`moeswarm_market::trust::sample`]), drawn by the router and never
//! sent, from the rows as the worker received them (rounded to the wire type), either here
//! when the router holds the slab or on another replica, and compares the outputs bit for
//! bit: the engine gives the same bits on every CPU, and both sides round the same values to
//! the same wire type, so an honest answer always matches. One wrong group condemns the whole
//! answer.
//!
//! A second opinion from the router itself decides. One from another worker that disagrees
//! calls for a third (the router itself after fetching the slab, verified by its hash, from
//! any holder; a third replica only where it cannot): whoever disagrees with it is caught. A
//! caught worker is quarantined ([`super::HealthTable::check_failed`]), none of its answers in
//! the dispatch are used (the groups are computed again elsewhere), and it is counted and
//! named in the stats. Where no majority can be had, neither answer is used.
//!
//! Where no one else holds the slab (the worker is its only holder and the router has none),
//! the router fetches it and computes the second opinion itself, within the referee's budget
//! (see `referee`). A check nothing could be compared with is never a pass: the worker stays
//! on probation (checked every time) until one is. Another worker's agreement counts only on
//! finite values: two replicas answering the same NaN agree on nothing.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use moeswarm_engine::executor::ExpertRequest;
use moeswarm_engine::ops::same_bits;
use moeswarm_market::trust::sample::sample_groups;
use moeswarm_market::trust::sampled;
use moeswarm_relay::PeerId;

use super::super::assign::{assign, Outbound};
use super::RemoteExecutor;

/// Second opinions on a dispatch's groups, in its order: who gave each and its output.
pub(super) type Opinions = Vec<Option<(Opinion, Vec<f32>)>>;

/// A check decided before the dispatch: the groups it re-computes and the opinions on them.
pub(super) struct Ahead {
    /// Per group of the dispatch, in its order: whether it is in the sample.
    sampled: Vec<bool>,
    /// Per group: who gave an opinion on it, and its output.
    opinions: Opinions,
}

impl Ahead {
    /// No group sampled (a check called for only by an answer that is not finite).
    fn none(groups: usize) -> Self {
        Self {
            sampled: vec![false; groups],
            opinions: vec![None; groups],
        }
    }
}

/// Who gave an opinion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Opinion {
    /// The router computed it.
    Local,
    /// Another worker answered it.
    Peer(PeerId),
}

/// What a check made of one accepted dispatch.
pub(super) struct Checked {
    /// Per group of the dispatch: the output to use, or `None` when it must be computed again.
    pub outputs: Vec<Option<Vec<f32>>>,
    /// Workers not to ask again for the groups that must be computed again.
    pub exclude: Vec<PeerId>,
    /// Why those groups must be computed again.
    pub why: String,
}

/// One group's outcome: the output to use if the worker turns out honest, and the one if it
/// lied (`None`: compute it again).
struct Verdict {
    honest: Option<Vec<f32>>,
    truth: Option<Vec<f32>>,
}

fn verdict(honest: Option<Vec<f32>>, truth: Option<Vec<f32>>) -> Verdict {
    Verdict { honest, truth }
}

/// Whether every value of `v` is finite: a branch-free pass over runs of 64 (which the
/// compiler vectorizes; a short-circuit per value does not), stopping at the first run that
/// is not.
fn finite_all(v: &[f32]) -> bool {
    v.chunks(64)
        .all(|run| run.iter().fold(true, |ok, x| ok & x.is_finite()))
}

impl RemoteExecutor {
    /// Whether `peer`'s next answer is to be checked, by the sampling rule, decided before it
    /// is sent: the second opinion is then asked for at the same time as the dispatch
    /// ([`RemoteExecutor::opinion_ahead`]), and costs no round trip after the answer.
    pub(super) fn check_ahead(&self, peer: &PeerId) -> bool {
        sampled(self.health.check_rate(peer), rand::random())
    }

    /// The second opinion on a sample of `out`'s groups ([`sample_groups`], the policy's
    /// [`groups`](moeswarm_market::trust::CheckPolicy::groups)), asked for beside the dispatch
    /// itself. The sample is drawn here, after the dispatch is built, and never sent.
    pub(super) async fn opinion_ahead(&self, req: &ExpertRequest<'_>, out: &Outbound) -> Ahead {
        let n = out.groups.len();
        let budget = self.health.policy().groups as usize;
        let picked = sample_groups(n, budget, rand::random());
        let mut ahead = Ahead::none(n);
        let groups: Vec<usize> = picked.iter().map(|&k| out.groups[k]).collect();
        let got = self
            .second_opinion(req, &groups, &HashSet::from([out.peer]))
            .await;
        for (k, o) in picked.into_iter().zip(got) {
            ahead.sampled[k] = true;
            ahead.opinions[k] = o;
        }
        ahead
    }

    /// Checks `out`'s `answers`: on the groups of `ahead` when the check was decided before
    /// the dispatch, and on every group holding a value that is not finite.
    pub(super) async fn check(
        &self,
        req: &ExpertRequest<'_>,
        out: &Outbound,
        answers: Vec<Vec<f32>>,
        ahead: Option<Ahead>,
    ) -> Checked {
        let peer = out.peer;
        let finite: Vec<bool> = answers.iter().map(|a| finite_all(a)).collect();
        let all_finite = finite.iter().all(|&f| f);
        if all_finite && ahead.is_none() {
            return Checked {
                outputs: answers.into_iter().map(Some).collect(),
                exclude: Vec::new(),
                why: String::new(),
            };
        }
        self.stats.checked.fetch_add(1, Ordering::Relaxed);
        let Ahead { sampled, opinions } = self.complete(req, out, &finite, ahead).await;
        let mut verdicts: Vec<Verdict> = Vec::new();
        let mut lied = false;
        let mut disputed: Vec<PeerId> = Vec::new();
        let (mut compared, mut unverified) = (0u64, 0u64);
        for (k, (answer, opinion)) in answers.into_iter().zip(opinions).enumerate() {
            if !sampled[k] {
                // Not in the sample: used as answered, as an unchecked dispatch's is.
                verdicts.push(verdict(Some(answer), None));
                continue;
            }
            compared += 1;
            // No one else holds the slab: the router fetches it and computes it itself.
            let opinion = match opinion {
                Some(o) => Some(o),
                None => self
                    .referee(req, out.groups[k])
                    .await
                    .map(|v| (Opinion::Local, v)),
            };
            match opinion {
                None => {
                    unverified += 1;
                    // A value that is not finite and that nobody confirms is not used.
                    lied |= !finite[k];
                    let keep = finite[k].then_some(answer);
                    verdicts.push(verdict(keep, None));
                }
                // Another worker agreeing counts only on finite values: two replicas answering
                // the same NaN agree on nothing (the router's own NaN is the truth).
                Some((who, v))
                    if same_bits(&v, &answer) && (who == Opinion::Local || finite[k]) =>
                {
                    if let Opinion::Peer(q) = who {
                        self.credit(q);
                    }
                    verdicts.push(verdict(Some(answer), Some(v)));
                }
                Some((Opinion::Local, v)) => {
                    lied = true;
                    verdicts.push(verdict(None, Some(v)));
                }
                Some((Opinion::Peer(q), v)) => {
                    // Two workers disagree (or agree on values that are not finite): a third
                    // opinion decides, a replica's again only on finite values.
                    let third = self
                        .settle(req, out.groups[k], &HashSet::from([peer, q]))
                        .await
                        .filter(|(who, w)| *who == Opinion::Local || finite_all(w));
                    let Some((who, w)) = third else {
                        disputed.push(q);
                        verdicts.push(verdict(None, None));
                        continue;
                    };
                    let (with_worker, with_q) = (same_bits(&w, &answer), same_bits(&w, &v));
                    match (with_worker, with_q) {
                        (true, true) => self.credit(q),
                        (true, false) => self.convict(q, req.layer),
                        (false, true) => lied = true,
                        // The router's own answer is the truth: both were wrong.
                        (false, false) if who == Opinion::Local => {
                            self.convict(q, req.layer);
                            lied = true;
                        }
                        (false, false) => {
                            disputed.push(q);
                            verdicts.push(verdict(None, None));
                            continue;
                        }
                    }
                    let honest = with_worker.then_some(answer);
                    verdicts.push(verdict(honest, Some(w)));
                }
            }
        }
        self.stats
            .unverified
            .fetch_add(unverified, Ordering::Relaxed);
        // A check passes only where some answer was compared: one no one could check is
        // neither a pass nor a failure (the worker stays on probation).
        let compared = compared > unverified;
        if lied {
            self.convict(peer, req.layer);
        } else if disputed.is_empty() && compared {
            self.credit(peer);
        }
        let why = if lied {
            format!("{peer} answered wrong and is quarantined")
        } else {
            format!("{peer} and another replica disagree, and no third opinion settles it")
        };
        let mut exclude = disputed;
        exclude.push(peer);
        Checked {
            outputs: verdicts
                .into_iter()
                .map(|v| if lied { v.truth } else { v.honest })
                .collect(),
            exclude,
            why,
        }
    }

    /// The check's sample completed with every group holding a value that is not finite
    /// (its second opinion asked for now), and counted in the stats.
    async fn complete(
        &self,
        req: &ExpertRequest<'_>,
        out: &Outbound,
        finite: &[bool],
        ahead: Option<Ahead>,
    ) -> Ahead {
        let peer = out.peer;
        let Ahead {
            mut sampled,
            mut opinions,
        } = ahead.unwrap_or_else(|| Ahead::none(out.groups.len()));
        // A group holding a value that is not finite is always checked.
        let unsampled: Vec<usize> = (0..sampled.len())
            .filter(|&k| !finite[k] && !sampled[k])
            .collect();
        if !unsampled.is_empty() {
            let groups: Vec<usize> = unsampled.iter().map(|&k| out.groups[k]).collect();
            let got = self
                .second_opinion(req, &groups, &HashSet::from([peer]))
                .await;
            for (&k, o) in unsampled.iter().zip(got) {
                sampled[k] = true;
                opinions[k] = o;
            }
        }
        let rows = |k: usize| req.plan.groups[out.groups[k]].tokens.len() as u64;
        let (checked_rows, all_rows) = (0..sampled.len()).fold((0, 0), |(c, a), k| {
            (c + if sampled[k] { rows(k) } else { 0 }, a + rows(k))
        });
        let st = &self.stats;
        st.checked_rows.fetch_add(checked_rows, Ordering::Relaxed);
        st.checked_of_rows.fetch_add(all_rows, Ordering::Relaxed);
        Ahead { sampled, opinions }
    }

    fn credit(&self, peer: PeerId) {
        self.health.check_passed(peer);
        self.stats.check(&peer.to_string(), true);
    }

    fn convict(&self, peer: PeerId, layer: u32) {
        tracing::warn!("worker {peer} answered layer {layer} wrong: quarantined");
        self.health.check_failed(peer);
        self.stats.check(&peer.to_string(), false);
    }

    /// A third opinion on group `i`, disputed by the workers `asked`: the router's own after
    /// fetching the slab (verified by its hash) from any holder, or, where it cannot, a third
    /// replica's. The router's comes first: replicas that lie alike would outvote an honest
    /// one.
    async fn settle(
        &self,
        req: &ExpertRequest<'_>,
        i: usize,
        asked: &HashSet<PeerId>,
    ) -> Option<(Opinion, Vec<f32>)> {
        if let Some(w) = self.referee(req, i).await {
            return Some((Opinion::Local, w));
        }
        self.second_opinion(req, &[i], asked).await.pop().flatten()
    }

    /// The router's own output of group `i`, rounded through the wire type both ways as a
    /// worker's would be (`None` when it does not hold the slab).
    pub(super) async fn local_opinion(
        &self,
        req: &ExpertRequest<'_>,
        i: usize,
    ) -> Option<Vec<f32>> {
        let wire = self.wire;
        let g = &req.plan.groups[i];
        // The rows as the worker received them; the outputs as it sent them.
        let rows = wire.decode(&wire.encode(&req.plan.gather(g, req.x, req.n_embd)));
        let w = self.local_weights(req.layer, g.expert).ok()?;
        let computed = tokio::task::spawn_blocking(move || {
            w.forward_rows(&rows).map(|o| wire.decode(&wire.encode(&o)))
        })
        .await;
        match computed {
            Ok(Ok(v)) => Some(v),
            _ => None,
        }
    }

    /// Outputs of `groups` from someone other than `asked`: the router where it holds the
    /// slab, else one more replica each (`None` where neither is to be had).
    async fn second_opinion(
        &self,
        req: &ExpertRequest<'_>,
        groups: &[usize],
        asked: &HashSet<PeerId>,
    ) -> Vec<Option<(Opinion, Vec<f32>)>> {
        let mut opinions: Vec<Option<(Opinion, Vec<f32>)>> = vec![None; groups.len()];
        let wire = self.wire;
        if self.fallback.is_some() {
            for (k, &i) in groups.iter().enumerate() {
                opinions[k] = self
                    .local_opinion(req, i)
                    .await
                    .map(|v| (Opinion::Local, v));
            }
        }
        let n = req.plan.groups.len();
        let mut wanted = vec![false; n];
        for (k, &i) in groups.iter().enumerate() {
            wanted[i] = opinions[k].is_none();
        }
        if !wanted.iter().any(|&w| w) {
            return opinions;
        }
        let plan = {
            let table = self.table.read().unwrap_or_else(|e| e.into_inner());
            let excluded = vec![asked.clone(); n];
            assign(&table, &self.health, req, wire, &wanted, &excluded)
        };
        let sends = plan
            .iter()
            .map(|o| self.dispatch(o, self.ticket(req.step, req.layer), req));
        for (o, r) in plan.iter().zip(futures::future::join_all(sends).await) {
            let Ok(outs) = r else { continue };
            for (&i, v) in o.groups.iter().zip(outs) {
                if let Some(k) = groups.iter().position(|&g| g == i) {
                    opinions[k] = Some((Opinion::Peer(o.peer), v));
                }
            }
        }
        opinions
    }
}

#[cfg(test)]
mod tests {
    use super::finite_all;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn finite_all_finds_any_nan_or_infinity_wherever_it_is(
            len in 0usize..300,
            bad in proptest::option::of((0usize..300, prop_oneof![
                Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)
            ])),
        ) {
            let mut v: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 7.0).collect();
            if let Some((at, x)) = bad {
                if at < len {
                    v[at] = x;
                }
            }
            prop_assert_eq!(finite_all(&v), v.iter().all(|x| x.is_finite()));
        }
    }
}
