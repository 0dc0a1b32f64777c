//! `moeswarm scrub`: check a whole store now: hash every blob, adopt good files the index does
//! not name, quarantine bad ones, and list (or collect) the blobs no model names.

use std::path::PathBuf;

use anyhow::Result;
use moeswarm_model::store::Store;
use serde::Serialize;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// Store directory (it must exist).
    #[arg(long)]
    store: PathBuf,
    /// Also delete the blobs no model in the store names (left by work that failed or was
    /// cut short; a re-run of that work would have used them).
    #[arg(long)]
    collect_orphans: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// What a scrub found and did.
#[derive(Serialize)]
struct ScrubReport {
    blobs_ok: usize,
    dropped: Vec<Named>,
    adopted: usize,
    models_reindexed: Vec<String>,
    quarantined: Vec<Named>,
    leftovers_removed: usize,
    index_rebuilt: Option<String>,
    read_only: bool,
    orphans: Vec<String>,
    orphans_collected: usize,
}

#[derive(Serialize)]
struct Named {
    name: String,
    why: String,
}

/// Exit status 1 when anything was found bad (dropped or quarantined): mended, but a person
/// should know.
pub fn run(a: Args) -> Result<bool> {
    let (store, r) = Store::open_existing(&a.store)?;
    let orphans = store.orphans()?;
    let mut collected = 0;
    if a.collect_orphans {
        for id in &orphans {
            store.remove(id)?;
            collected += 1;
        }
    }
    let report = ScrubReport {
        blobs_ok: r.blobs_ok,
        dropped: r
            .dropped
            .iter()
            .map(|(id, why)| Named {
                name: id.to_string(),
                why: why.clone(),
            })
            .collect(),
        adopted: r.adopted.len(),
        models_reindexed: r.models_reindexed.iter().map(|m| m.to_string()).collect(),
        quarantined: r
            .quarantined
            .iter()
            .map(|(name, why)| Named {
                name: name.clone(),
                why: why.clone(),
            })
            .collect(),
        leftovers_removed: r.leftovers_removed,
        index_rebuilt: r.index_rebuilt.clone(),
        read_only: r.read_only,
        orphans: orphans.iter().map(|o| o.to_string()).collect(),
        orphans_collected: collected,
    };
    let clean = report.dropped.is_empty() && report.quarantined.is_empty();
    if a.json {
        output::json(&report)?;
        return Ok(clean);
    }
    if report.read_only {
        let text = format!(
            "{} blobs verified, {} that do not match their names (left in place): the store is \
             read-only, so it was checked from its files and nothing in it was changed\n",
            report.adopted,
            report.quarantined.len()
        );
        output::emit(&text)?;
        return Ok(clean);
    }
    let mut text = format!(
        "{} blobs verified, {} adopted, {} dropped, {} quarantined, {} unfinished files removed\n",
        report.blobs_ok,
        report.adopted,
        report.dropped.len(),
        report.quarantined.len(),
        report.leftovers_removed
    );
    if let Some(why) = &report.index_rebuilt {
        text += &format!("the index could not be read ({why}): rebuilt from the blobs\n");
    }
    for m in &report.models_reindexed {
        text += &format!("model {m} indexed again from its manifest\n");
    }
    for d in &report.dropped {
        text += &format!("dropped {}: {}\n", d.name, d.why);
    }
    for q in &report.quarantined {
        text += &format!("quarantined {}: {}\n", q.name, q.why);
    }
    if !orphans.is_empty() {
        text += &format!(
            "{} blobs no model names{}\n",
            orphans.len(),
            if a.collect_orphans {
                ": deleted"
            } else {
                " (--collect-orphans deletes them)"
            }
        );
    }
    output::emit(&text)?;
    Ok(clean)
}
