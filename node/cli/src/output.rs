//! Writing to stdout without panicking when the reader has gone (a closed pipe).

use std::io::Write;

/// Writes `text` to stdout and flushes it.
pub fn emit(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// Writes `text` and a newline to stdout.
pub fn line(text: &str) -> std::io::Result<()> {
    emit(&format!("{text}\n"))
}

/// Writes `value` as pretty JSON to stdout.
pub fn json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    line(&serde_json::to_string_pretty(value)?)?;
    Ok(())
}

/// Whether `e` is, at its root, a write to a closed pipe.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
