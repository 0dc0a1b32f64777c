//! How a dispatch's rows lie in its payload, and how they are taken out again. Pure: no I/O.
//!
//! A router sends a worker the rows of each slab it asks for, slab after slab. One token is
//! routed to several experts, and when two of them are on the same worker its row would travel
//! twice (at batch 1, a worker holding 3 of a token's 8 experts would get the same row 3
//! times). So when rows repeat, the payload carries each distinct row once and an index:
//!
//! - [`RowLayout::EachSlab`]: the rows of every slab in order (no row repeats);
//! - [`RowLayout::Distinct`]`(d)`: one `u32` LE per slab row, in slab order, naming which of
//!   the `d` distinct rows it is, then the `d` distinct rows.
//!
//! Rows are `n_embd` values of the dispatch's [`WireType`]. [`pack`] chooses the layout and
//! writes the payload; [`unpack`] checks and reads one back as each slab's rows, straight from
//! the pieces it arrived in.

use crate::dispatch::{DispatchError, SlabRows};
use crate::wire::WireType;

/// How a payload lays out its rows (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLayout {
    /// Every slab's rows in order.
    EachSlab,
    /// An index of every slab row into this many distinct rows, then the distinct rows.
    Distinct(u32),
}

impl RowLayout {
    /// The layout a dispatch header names (`distinct_rows`).
    pub fn of(distinct_rows: Option<u32>) -> Self {
        distinct_rows.map_or(RowLayout::EachSlab, RowLayout::Distinct)
    }

    /// What a dispatch header says of this layout (`distinct_rows`): the inverse of [`of`](Self::of).
    pub fn distinct_rows(self) -> Option<u32> {
        match self {
            RowLayout::EachSlab => None,
            RowLayout::Distinct(d) => Some(d),
        }
    }

    /// Bytes of a payload of this layout for `slab_rows` rows in all.
    pub fn payload_len(self, slab_rows: u64, n_embd: u32, wire: WireType) -> u64 {
        let row = n_embd as u64 * wire.size();
        match self {
            RowLayout::EachSlab => slab_rows * row,
            RowLayout::Distinct(d) => slab_rows * 4 + d as u64 * row,
        }
    }
}

/// The payload for slab rows `ids` (every slab's rows in order, each named by an id that is
/// the same for equal rows: the token it is), whose values `row(id)` gives: each distinct row
/// once with the index when any repeats, else the rows in order. Returns the layout and the
/// payload.
pub fn pack<'a>(
    wire: WireType,
    ids: &[u32],
    row: impl Fn(u32) -> &'a [f32],
) -> (RowLayout, Vec<u8>) {
    let mut distinct: Vec<u32> = Vec::new();
    let mut at: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    let index: Vec<u32> = ids
        .iter()
        .map(|&id| {
            *at.entry(id).or_insert_with(|| {
                distinct.push(id);
                distinct.len() as u32 - 1
            })
        })
        .collect();
    let width = ids.first().map_or(0, |&id| row(id).len());
    if distinct.len() == ids.len() {
        let mut payload = Vec::with_capacity(ids.len() * width * wire.size() as usize);
        for &id in ids {
            wire.encode_into(row(id), &mut payload);
        }
        return (RowLayout::EachSlab, payload);
    }
    let mut payload =
        Vec::with_capacity(index.len() * 4 + distinct.len() * width * wire.size() as usize);
    for i in &index {
        payload.extend_from_slice(&i.to_le_bytes());
    }
    for &id in &distinct {
        wire.encode_into(row(id), &mut payload);
    }
    (RowLayout::Distinct(distinct.len() as u32), payload)
}

/// Each slab's rows from a payload of `layout` (the pieces it arrived in, `n_embd` values of
/// `wire` a row, its length already checked against the header): an index naming a row that
/// is not there is refused.
pub fn unpack<'a>(
    layout: RowLayout,
    slabs: &[SlabRows],
    n_embd: u32,
    wire: WireType,
    parts: impl IntoIterator<Item = &'a [u8]>,
) -> Result<Vec<Vec<f32>>, DispatchError> {
    let width = n_embd as usize;
    let lens: Vec<usize> = slabs.iter().map(|s| s.rows as usize * width).collect();
    let d = match layout {
        RowLayout::EachSlab => return Ok(wire.decode_parts(parts, &lens)),
        RowLayout::Distinct(d) => d as usize,
    };
    let total: usize = slabs.iter().map(|s| s.rows as usize).sum();
    // The index first (it may straddle pieces), then the distinct rows.
    let mut index_bytes = Vec::with_capacity(total * 4);
    let mut rest: Vec<&[u8]> = Vec::new();
    for part in parts {
        let take = (total * 4 - index_bytes.len()).min(part.len());
        index_bytes.extend_from_slice(&part[..take]);
        rest.push(&part[take..]);
    }
    let distinct = wire
        .decode_parts(rest, &[d * width])
        .pop()
        .unwrap_or_default();
    if index_bytes.len() != total * 4 || distinct.len() != d * width {
        return Err(DispatchError::Malformed {
            what: "payload",
            reason: "shorter than its row index and rows".into(),
        });
    }
    let mut index = index_bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let mut out = Vec::with_capacity(slabs.len());
    for s in slabs {
        let mut rows = Vec::with_capacity(s.rows as usize * width);
        for i in index.by_ref().take(s.rows as usize) {
            let row = distinct.get(i * width..(i + 1) * width).ok_or_else(|| {
                DispatchError::Malformed {
                    what: "payload",
                    reason: format!("row index {i} of {d} distinct rows"),
                }
            })?;
            rows.extend_from_slice(row);
        }
        out.push(rows);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlobId;
    use crate::wire::pieces;
    use proptest::prelude::*;

    fn slabs(rows: &[u32]) -> Vec<SlabRows> {
        rows.iter()
            .enumerate()
            .map(|(i, &r)| SlabRows {
                slab: BlobId::of(&[i as u8]),
                expert: i as u32,
                rows: r,
            })
            .collect()
    }

    proptest! {
        #[test]
        fn each_slab_gets_its_rows_back_whatever_repeats_and_pieces(
            counts in proptest::collection::vec(1u32..5, 1..6),
            tokens in proptest::collection::vec(0u32..6, 30),
            cuts in proptest::collection::vec(0usize..400, 0..6),
            width in 1usize..5,
        ) {
            let slabs = slabs(&counts);
            let total: usize = counts.iter().map(|&c| c as usize).sum();
            let ids = &tokens[..total];
            let x: Vec<f32> = (0..6 * width).map(|i| i as f32 * 0.75 - 3.0).collect();
            let row = |id: u32| &x[id as usize * width..(id as usize + 1) * width];
            for wire in [WireType::F32, WireType::F16, WireType::Bf16] {
                let (layout, payload) = pack(wire, ids, row);
                let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len();
                // Repeats travel once; without repeats the payload is the rows in order.
                let want_layout = if distinct == total {
                    RowLayout::EachSlab
                } else {
                    RowLayout::Distinct(distinct as u32)
                };
                prop_assert_eq!(layout, want_layout);
                prop_assert_eq!(
                    payload.len() as u64,
                    layout.payload_len(total as u64, width as u32, wire)
                );
                let got = unpack(layout, &slabs, width as u32, wire, pieces(&payload, &cuts))
                    .unwrap();
                // The reference: each slab's rows gathered one by one, through the wire type.
                let mut k = 0;
                for (s, rows) in slabs.iter().zip(&got) {
                    let mut want = Vec::new();
                    for &id in &ids[k..k + s.rows as usize] {
                        want.extend(wire.decode(&wire.encode(row(id))));
                    }
                    k += s.rows as usize;
                    prop_assert_eq!(rows, &want);
                }
            }
        }
    }

    #[test]
    fn an_index_naming_a_row_not_sent_is_refused() {
        let slabs = slabs(&[2]);
        let mut payload = Vec::new();
        payload.extend_from_slice(&0u32.to_le_bytes());
        payload.extend_from_slice(&1u32.to_le_bytes());
        payload.extend_from_slice(&WireType::F32.encode(&[1.0, 2.0]));
        let e = unpack(
            RowLayout::Distinct(1),
            &slabs,
            2,
            WireType::F32,
            [&payload[..]],
        );
        assert!(
            matches!(&e, Err(DispatchError::Malformed { reason, .. }) if reason.contains("row index 1 of 1")),
            "{e:?}"
        );
        let short = unpack(
            RowLayout::Distinct(1),
            &slabs,
            2,
            WireType::F32,
            [&payload[..10]],
        );
        assert!(short.is_err());
    }
}
