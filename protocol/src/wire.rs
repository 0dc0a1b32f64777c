//! How rows travel on the wire: little-endian f32, or halved to f16 / bf16 (half the bytes,
//! rounded activations). Pure conversions, no I/O.

use serde::{Deserialize, Serialize};

/// How rows travel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireType {
    /// 4 bytes a value, exact.
    #[default]
    F32,
    /// IEEE half precision, 2 bytes.
    F16,
    /// bfloat16, 2 bytes.
    Bf16,
}

impl WireType {
    /// Bytes of one value.
    pub fn size(self) -> u64 {
        match self {
            WireType::F32 => 4,
            WireType::F16 | WireType::Bf16 => 2,
        }
    }

    /// Values as little-endian bytes of this type.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * self.size() as usize);
        self.encode_into(values, &mut out);
        out
    }

    /// Appends `values` to `out` as little-endian bytes of this type (rows gathered from
    /// several places go into one payload with one copy each).
    pub fn encode_into(self, values: &[f32], out: &mut Vec<u8>) {
        let at = out.len();
        out.resize(at + values.len() * self.size() as usize, 0);
        let dest = &mut out[at..];
        match self {
            WireType::F32 => {
                for (d, v) in dest.chunks_exact_mut(4).zip(values) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            WireType::F16 => {
                for (d, v) in dest.chunks_exact_mut(2).zip(values) {
                    d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
                }
            }
            WireType::Bf16 => {
                for (d, v) in dest.chunks_exact_mut(2).zip(values) {
                    d.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                }
            }
        }
    }

    /// Little-endian bytes of this type as values (a trailing partial value is ignored).
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        let mut out = Vec::with_capacity(bytes.len() / self.size() as usize);
        self.decode_into(bytes, &mut out);
        out
    }

    /// Appends the values of `bytes` (whole values only) to `out`.
    fn decode_into(self, bytes: &[u8], out: &mut Vec<f32>) {
        match self {
            WireType::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            WireType::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            WireType::Bf16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
        }
    }

    /// The values of `parts` (one payload as it came off the wire, in pieces that may split a
    /// value) cut into runs of `lens` values each: what [`WireType::decode`] of the parts laid
    /// end to end gives, split, with one copy of each value and none of the bytes. Values
    /// beyond the sum of `lens` are ignored; a run the parts do not fill is left short.
    pub fn decode_parts<'a>(
        self,
        parts: impl IntoIterator<Item = &'a [u8]>,
        lens: &[usize],
    ) -> Vec<Vec<f32>> {
        let size = self.size() as usize;
        let mut runs: Vec<Vec<f32>> = lens.iter().map(|&n| Vec::with_capacity(n)).collect();
        let mut run = 0;
        // A value split between two parts: its first bytes.
        let mut carry = [0u8; 4];
        let mut carried = 0;
        for mut part in parts {
            while !part.is_empty() {
                while runs.get(run).is_some_and(|r| r.len() == lens[run]) {
                    run += 1;
                }
                let Some(out) = runs.get_mut(run) else {
                    return runs;
                };
                if carried > 0 {
                    let take = (size - carried).min(part.len());
                    carry[carried..carried + take].copy_from_slice(&part[..take]);
                    carried += take;
                    part = &part[take..];
                    if carried == size {
                        self.decode_into(&carry[..size], out);
                        carried = 0;
                    }
                    continue;
                }
                let whole = (part.len() / size).min(lens[run] - out.len());
                self.decode_into(&part[..whole * size], out);
                part = &part[whole * size..];
                if whole == 0 {
                    carry[..part.len()].copy_from_slice(part);
                    carried = part.len();
                    part = &[];
                }
            }
        }
        runs
    }
}

/// Rows as little-endian bytes.
pub fn f32_to_le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Little-endian bytes as rows (a trailing partial value is ignored; lengths are checked
/// before this is called).
pub fn le_to_f32(bytes: &[u8]) -> Vec<f32> {
    WireType::F32.decode(bytes)
}

/// `payload` cut into pieces at `cuts` (clamped to its length, in any order): a payload as it
/// may come off the wire.
#[cfg(test)]
pub(crate) fn pieces<'a>(payload: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut at: Vec<usize> = cuts.iter().map(|&c| c.min(payload.len())).collect();
    at.sort_unstable();
    let mut out = Vec::new();
    let mut from = 0;
    for &c in at.iter().chain([&payload.len()]) {
        out.push(&payload[from..c]);
        from = c;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn half_wire_types_round_to_their_precision() {
        let v = [1.0f32, -2.5, 3.140625, 65504.0, 1e-3];
        for w in [WireType::F16, WireType::Bf16] {
            let back = w.decode(&w.encode(&v));
            assert_eq!(back.len(), v.len());
            for (a, b) in v.iter().zip(&back) {
                assert!((a - b).abs() <= a.abs() * 0.008 + 1e-4, "{w:?}: {a} vs {b}");
            }
        }
        assert_eq!(WireType::F32.decode(&WireType::F32.encode(&v)), v.to_vec());
    }

    proptest! {
        #[test]
        fn rows_encoded_into_one_payload_are_their_own_encodings_end_to_end(
            rows in proptest::collection::vec(
                proptest::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..40),
                0..6,
            ),
        ) {
            for w in [WireType::F32, WireType::F16, WireType::Bf16] {
                let mut one = Vec::new();
                for r in &rows {
                    w.encode_into(r, &mut one);
                }
                let each: Vec<u8> = rows.iter().flat_map(|r| w.encode(r)).collect();
                prop_assert_eq!(&one, &each);
                // Each value as the `half` crate writes it.
                let reference: Vec<u8> = rows
                    .iter()
                    .flatten()
                    .flat_map(|&v| match w {
                        WireType::F32 => v.to_le_bytes().to_vec(),
                        WireType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                        WireType::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    })
                    .collect();
                prop_assert_eq!(&one, &reference);
            }
            // f32 rows come back bit for bit, NaN payloads too.
            let all: Vec<f32> = rows.concat();
            let back = WireType::F32.decode(&WireType::F32.encode(&all));
            prop_assert_eq!(
                back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                all.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            prop_assert_eq!(WireType::F32.encode(&all), f32_to_le(&all));
        }

        #[test]
        fn a_payload_in_pieces_decodes_as_the_whole_cut_into_runs(
            values in proptest::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..60),
            cuts in proptest::collection::vec(0usize..300, 0..8),
            lens in proptest::collection::vec(0usize..25, 0..6),
        ) {
            for w in [WireType::F32, WireType::F16, WireType::Bf16] {
                let bytes = w.encode(&values);
                let runs = w.decode_parts(pieces(&bytes, &cuts), &lens);
                // The reference: the whole payload decoded, then cut.
                let whole = w.decode(&bytes);
                let mut rest = whole.as_slice();
                prop_assert_eq!(runs.len(), lens.len());
                for (run, &n) in runs.iter().zip(&lens) {
                    let (want, tail) = rest.split_at(n.min(rest.len()));
                    rest = tail;
                    prop_assert_eq!(
                        run.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                }
            }
        }
    }
}
