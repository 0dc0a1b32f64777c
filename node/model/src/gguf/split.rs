//! A model in one GGUF file or split into parts, read as one.
//!
//! llama.cpp's `gguf-split` (and gguf-py's writer) cut a model into files named
//! `NAME-0000i-of-0000n.gguf`. Each part is a GGUF of its own that carries `split.no` (from 0),
//! `split.count` and `split.tensors.count` (the model's tensors in all); the first part holds
//! the model's metadata, and the tensors follow one another in order across the parts.
//! [`ModelFiles::open`] takes any part (or a single file), reads every part's header, checks
//! that the parts are all there, belong together and give each tensor exactly once, and
//! presents the model as one logical header whose tensor offsets address the parts' data one
//! after another ([`ModelFiles::locate`] maps them back to a file).
//!
//! A model has one identity however it is stored: [`source_id`] hashes the header a merged
//! file would have (the model's metadata without `split.*`, its tensors in order at aligned
//! offsets), so a split model and the same model in one file slice to the same model id.
//! This module reads headers only; [`super::MappedGguf`] maps the parts' data.

use std::ops::Range;
use std::path::{Path, PathBuf};

use moeswarm_protocol::BlobId;

use super::{align_up, header_bytes, Gguf, GgufError, TensorLayout, Value};

/// The key that numbers a part, from 0.
pub const KEY_SPLIT_NO: &str = "split.no";
/// The key that counts the parts.
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// The key that counts the model's tensors over all parts.
pub const KEY_SPLIT_TENSORS: &str = "split.tensors.count";

/// Most parts a split model may have (the naming scheme's five digits allow more; no real
/// model comes near).
pub const MAX_PARTS: u64 = 1024;

/// Why the files of a model were refused. Each variant names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    /// A file that is not a valid GGUF.
    #[error("{path}: {source}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        source: GgufError,
    },
    /// A part says the model is split but its name does not say where its siblings are.
    #[error(
        "{path} is part {no} of {count} of a split model, but its name does not end in \
         -{no:05}-of-{count:05}.gguf, so the other parts cannot be found"
    )]
    Naming {
        /// The file.
        path: PathBuf,
        /// Its part number (from 1).
        no: u64,
        /// The parts in all.
        count: u64,
    },
    /// A part of the model is not there.
    #[error("part {no} of {count} is missing: {path} does not exist")]
    MissingPart {
        /// The file that should hold it.
        path: PathBuf,
        /// Its part number (from 1).
        no: u64,
        /// The parts in all.
        count: u64,
    },
    /// A file in a part's place that is not that part of this model.
    #[error("{path} is not part {no} of this model: {why}")]
    ForeignPart {
        /// The file.
        path: PathBuf,
        /// The part it stands in for (from 1).
        no: u64,
        /// What gave it away.
        why: String,
    },
    /// A split key with a value that is not a count.
    #[error("{path}: {key} is {value}, want a whole number{limit}")]
    BadKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// Its value.
        value: String,
        /// The bound it broke, if any.
        limit: String,
    },
    /// A tensor given by two parts.
    #[error("tensor {name:?} is given twice: in {first} and in {second}")]
    DuplicateTensor {
        /// The tensor.
        name: String,
        /// The part that gave it first.
        first: PathBuf,
        /// The part that gave it again.
        second: PathBuf,
    },
    /// Fewer or more tensors than the first part says the model has.
    #[error("the parts hold {found} tensors, but {path} says the model has {want}: {what}")]
    TensorCount {
        /// The first part.
        path: PathBuf,
        /// What it says.
        want: u64,
        /// What the parts hold.
        found: u64,
        /// Missing or extra.
        what: &'static str,
    },
}

/// Where one file's tensor data lies in the model's logical header.
#[derive(Debug, Clone)]
pub struct Part {
    /// The file.
    pub path: PathBuf,
    /// Its length.
    pub file_size: u64,
    /// The offsets (in the logical header's address space) its data covers.
    pub span: Range<u64>,
    /// Where `span.start` lies in the file.
    pub file_offset: u64,
}

/// A model's GGUF files: one, or every part of a split, checked to belong together.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The model as one header: the model's metadata (without `split.*` keys), every tensor in
    /// order; its `header_id` is the model's [`source_id`]. For one file, the file's own
    /// layout; for a split model, tensor offsets run over the parts' data one after another
    /// (`data_offset` 0): [`ModelFiles::locate`] says which file holds a range.
    pub header: Gguf,
    /// The files, in order.
    pub parts: Vec<Part>,
}

/// The identity of a model's source: blake3 of the header a merged file of it would have (the
/// metadata without `split.*` keys, the tensors in order at aligned offsets). The same for the
/// model in one file and split into parts, and for a GGUF rewritten with other padding.
pub fn source_id(
    metadata: &[(String, Value)],
    tensors: &[TensorLayout],
) -> Result<BlobId, GgufError> {
    let (bytes, _, _) = header_bytes(metadata, tensors)?;
    Ok(BlobId::from_hash(blake3::hash(&bytes)))
}

/// The path of part `no` (from 1) of `count`, next to `prefix` (`NAME` of `NAME-…-of-….gguf`).
pub fn part_path(prefix: &Path, no: u64, count: u64) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(format!("-{no:05}-of-{count:05}.gguf"));
    PathBuf::from(s)
}

/// The model's name from its file: the file name without `.gguf`, and for a part of a split
/// model without `-0000i-of-0000n` (`Qwen3.5-122B-Q4_K_M-00001-of-00003.gguf` →
/// `Qwen3.5-122B-Q4_K_M`).
pub fn model_name(path: &Path) -> String {
    let base = match parse_part_path(path) {
        Some((prefix, _, _)) => prefix,
        None => path.with_extension(""),
    };
    base.file_name()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned())
}

/// `(prefix, no, count)` of a part's file name, if it follows the scheme.
fn parse_part_path(path: &Path) -> Option<(PathBuf, u64, u64)> {
    let s = path.to_str()?;
    let stem = s.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |d: &str| d.len() == 5 && d.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((PathBuf::from(prefix), no.parse().ok()?, count.parse().ok()?))
}

fn is_split_key(k: &str) -> bool {
    k.starts_with("split.")
}

fn open_header(path: &Path) -> Result<Gguf, SplitError> {
    Gguf::open(path).map_err(|source| SplitError::Gguf {
        path: path.to_path_buf(),
        source,
    })
}

/// The value of split key `key` in `g`, if present, as a count.
fn split_count(g: &Gguf, path: &Path, key: &'static str) -> Result<Option<u64>, SplitError> {
    let Some(v) = g.get(key) else {
        return Ok(None);
    };
    match v.as_u64() {
        Some(n) if n <= MAX_TENSORS_OR_PARTS => Ok(Some(n)),
        _ => Err(SplitError::BadKey {
            path: path.to_path_buf(),
            key,
            value: v.to_string(),
            limit: format!(" up to {MAX_TENSORS_OR_PARTS}"),
        }),
    }
}

const MAX_TENSORS_OR_PARTS: u64 = super::read::MAX_TENSORS;

impl ModelFiles {
    /// Reads the model at `path`: a single GGUF, or any part of a split one (every part is
    /// read and checked).
    pub fn open(path: &Path) -> Result<Self, SplitError> {
        let first = open_header(path)?;
        let count = split_count(&first, path, KEY_SPLIT_COUNT)?.unwrap_or(1);
        if count <= 1 {
            return Self::single(path, first);
        }
        if count > MAX_PARTS {
            return Err(SplitError::BadKey {
                path: path.to_path_buf(),
                key: KEY_SPLIT_COUNT,
                value: count.to_string(),
                limit: format!(" up to {MAX_PARTS}"),
            });
        }
        let no = split_count(&first, path, KEY_SPLIT_NO)?.unwrap_or(0) + 1;
        let prefix = match parse_part_path(path) {
            Some((prefix, n, c)) if n == no && c == count => prefix,
            _ => {
                return Err(SplitError::Naming {
                    path: path.to_path_buf(),
                    no,
                    count,
                })
            }
        };
        let mut headers = Vec::with_capacity(count as usize);
        for i in 1..=count {
            let p = part_path(&prefix, i, count);
            let g = if i == no {
                first.clone()
            } else if !p.exists() {
                return Err(SplitError::MissingPart {
                    path: p,
                    no: i,
                    count,
                });
            } else {
                open_header(&p)?
            };
            headers.push((p, g));
        }
        Self::merge(headers, count)
    }

    fn single(path: &Path, mut header: Gguf) -> Result<Self, SplitError> {
        header.metadata.retain(|(k, _)| !is_split_key(k));
        let layouts: Vec<TensorLayout> = header.tensors.iter().map(Into::into).collect();
        header.header_id = source_id(&header.metadata, &layouts).map_err(|e| SplitError::Gguf {
            path: path.to_path_buf(),
            source: e,
        })?;
        let part = Part {
            path: path.to_path_buf(),
            file_size: header.file_size,
            span: header.data_offset..header.file_size,
            file_offset: header.data_offset,
        };
        Ok(Self {
            header,
            parts: vec![part],
        })
    }

    /// The parts `headers` (in order, `count` of them) as one model, checked.
    fn merge(headers: Vec<(PathBuf, Gguf)>, count: u64) -> Result<Self, SplitError> {
        let (first_path, first) = &headers[0];
        let want_tensors = split_count(first, first_path, KEY_SPLIT_TENSORS)?;
        for (i, (path, g)) in headers.iter().enumerate() {
            check_part(first, path, g, i as u64, count, want_tensors)?;
        }
        let alignment = first.alignment;
        let mut tensors = Vec::new();
        let mut parts = Vec::with_capacity(headers.len());
        let mut seen: std::collections::HashMap<String, usize> = Default::default();
        let mut next = 0u64;
        for (i, (path, g)) in headers.iter().enumerate() {
            let base = align_up(next, alignment);
            let len = g.file_size - g.data_offset;
            for t in &g.tensors {
                if let Some(&j) = seen.get(&t.name) {
                    return Err(SplitError::DuplicateTensor {
                        name: t.name.clone(),
                        first: headers[j].0.clone(),
                        second: path.clone(),
                    });
                }
                seen.insert(t.name.clone(), i);
                let mut t = t.clone();
                t.offset += base;
                tensors.push(t);
            }
            parts.push(Part {
                path: path.clone(),
                file_size: g.file_size,
                span: base..base + len,
                file_offset: g.data_offset,
            });
            next = base + len;
        }
        let found = tensors.len() as u64;
        if let Some(want) = want_tensors.filter(|&w| w != found) {
            return Err(SplitError::TensorCount {
                path: first_path.clone(),
                want,
                found,
                what: if found < want {
                    "some are missing"
                } else {
                    "some are extra"
                },
            });
        }
        let metadata: Vec<(String, Value)> = first
            .metadata
            .iter()
            .filter(|(k, _)| !is_split_key(k))
            .cloned()
            .collect();
        let layouts: Vec<TensorLayout> = tensors.iter().map(Into::into).collect();
        let header_id = source_id(&metadata, &layouts).map_err(|e| SplitError::Gguf {
            path: first_path.clone(),
            source: e,
        })?;
        let header = Gguf {
            version: first.version,
            metadata,
            tensors,
            alignment,
            data_offset: 0,
            file_size: next,
            header_id,
        };
        Ok(Self { header, parts })
    }

    /// The part holding the logical byte range `range` (from [`Gguf::tensor_range`] of
    /// [`Self::header`]), and the range in that part's file; `None` if no one part holds it
    /// all.
    pub fn locate(&self, range: Range<u64>) -> Option<(usize, Range<u64>)> {
        let i = self.parts.partition_point(|p| p.span.end <= range.start);
        let p = self.parts.get(i)?;
        if range.start < p.span.start || range.end > p.span.end {
            return None;
        }
        let start = p.file_offset + (range.start - p.span.start);
        Some((i, start..start + (range.end - range.start)))
    }

    /// Whether the model is split into more than one file.
    pub fn is_split(&self) -> bool {
        self.parts.len() > 1
    }
}

/// Checks that `g`, read from `path` in part `i`'s place (from 0) of `count`, is that part of
/// the model whose first part is `first`.
fn check_part(
    first: &Gguf,
    path: &Path,
    g: &Gguf,
    i: u64,
    count: u64,
    want_tensors: Option<u64>,
) -> Result<(), SplitError> {
    let foreign = |why: String| SplitError::ForeignPart {
        path: path.to_path_buf(),
        no: i + 1,
        why,
    };
    let says_count = split_count(g, path, KEY_SPLIT_COUNT)?;
    let says_no = split_count(g, path, KEY_SPLIT_NO)?;
    match (says_no, says_count) {
        (Some(n), Some(c)) if n == i && c == count => {}
        (Some(n), Some(c)) => {
            return Err(foreign(format!(
                "it says it is part {} of {c}{}",
                n + 1,
                if n != i && c == count {
                    " (a copy of another part?)"
                } else {
                    ""
                }
            )))
        }
        _ => return Err(foreign("it has no split.no or split.count".into())),
    }
    let says_tensors = split_count(g, path, KEY_SPLIT_TENSORS)?;
    if says_tensors != want_tensors {
        return Err(foreign(format!(
            "it says the model has {} tensors, the first part says {}",
            says_tensors.map_or("no count of".into(), |n| n.to_string()),
            want_tensors.map_or("none".into(), |n| n.to_string())
        )));
    }
    if g.version != first.version {
        return Err(foreign(format!(
            "GGUF version {} beside the first part's {}",
            g.version, first.version
        )));
    }
    if g.alignment != first.alignment {
        return Err(foreign(format!(
            "alignment {} beside the first part's {}",
            g.alignment, first.alignment
        )));
    }
    // Metadata a later part repeats must agree with the first part's.
    for (k, v) in &g.metadata {
        if k == KEY_SPLIT_NO {
            continue;
        }
        if let Some(mine) = first.get(k) {
            if mine != v {
                return Err(foreign(format!(
                    "its {k} is {v}, the first part's is {mine}"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_follow_llama_cpp() {
        let p = part_path(Path::new("/m/Qwen3.5-122B-Q4_K_M"), 2, 3);
        assert_eq!(p, Path::new("/m/Qwen3.5-122B-Q4_K_M-00002-of-00003.gguf"));
        assert_eq!(
            parse_part_path(&p),
            Some((PathBuf::from("/m/Qwen3.5-122B-Q4_K_M"), 2, 3))
        );
        assert_eq!(parse_part_path(Path::new("/m/model.gguf")), None);
        assert_eq!(parse_part_path(Path::new("/m/a-2-of-3.gguf")), None);
        assert_eq!(parse_part_path(Path::new("/m/a-0000x-of-00003.gguf")), None);
        assert_eq!(model_name(&p), "Qwen3.5-122B-Q4_K_M");
        assert_eq!(model_name(Path::new("/m/small-q4_k.gguf")), "small-q4_k");
    }

    /// Part `no` (from 0) of `count`, saying the model has `total` tensors, holding `names`
    /// (one f32 block of 32 values each, 128 bytes).
    fn header(no: u16, count: u16, total: i32, names: &[&str]) -> (PathBuf, Gguf) {
        use super::super::{GgmlType, TensorInfo};
        let tensors: Vec<TensorInfo> = names
            .iter()
            .enumerate()
            .map(|(i, n)| TensorInfo {
                name: n.to_string(),
                dims: vec![32],
                dtype: GgmlType::F32,
                offset: i as u64 * 128,
            })
            .collect();
        let g = Gguf {
            version: 3,
            metadata: vec![
                (KEY_SPLIT_NO.into(), Value::U16(no)),
                (KEY_SPLIT_COUNT.into(), Value::U16(count)),
                (KEY_SPLIT_TENSORS.into(), Value::I32(total)),
            ],
            alignment: 32,
            data_offset: 64,
            file_size: 64 + 128 * names.len() as u64,
            header_id: BlobId::of(b""),
            tensors,
        };
        (part_path(Path::new("m"), no as u64 + 1, count as u64), g)
    }

    #[test]
    fn a_tensor_in_two_parts_is_named_with_both() {
        let parts = vec![header(0, 2, 3, &["a", "b"]), header(1, 2, 3, &["b"])];
        match ModelFiles::merge(parts, 2) {
            Err(SplitError::DuplicateTensor {
                name,
                first,
                second,
            }) => {
                assert_eq!(name, "b");
                assert!(first.ends_with("m-00001-of-00002.gguf"));
                assert!(second.ends_with("m-00002-of-00002.gguf"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fewer_tensors_than_the_first_part_promises_is_an_error() {
        let parts = vec![header(0, 2, 4, &["a", "b"]), header(1, 2, 4, &["c"])];
        let e = ModelFiles::merge(parts, 2).unwrap_err();
        assert!(
            matches!(
                e,
                SplitError::TensorCount {
                    want: 4,
                    found: 3,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("missing"));
    }

    #[test]
    fn every_tensor_is_located_in_its_own_part() {
        let parts = vec![
            header(0, 3, 6, &["a", "b"]),
            header(1, 3, 6, &["c"]),
            header(2, 3, 6, &["d", "e", "f"]),
        ];
        let files = ModelFiles::merge(parts, 3).unwrap();
        let want = [(0, 64), (0, 192), (1, 64), (2, 64), (2, 192), (2, 320)];
        for (t, (part, start)) in files.header.tensors.iter().zip(want) {
            let (i, r) = files.locate(files.header.tensor_range(t)).unwrap();
            assert_eq!(
                (i, r.start, r.end - r.start),
                (part, start, 128),
                "{}",
                t.name
            );
        }
        // A range across two parts, or past the end, is in none.
        let end = files.parts[0].span.end;
        assert_eq!(files.locate(end - 8..end + 8), None);
        assert_eq!(
            files.locate(files.header.file_size..files.header.file_size + 1),
            None
        );
        // No split key reaches the model's metadata.
        assert!(files.header.metadata.is_empty());
    }
}
