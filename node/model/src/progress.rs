//! The one progress bar: bytes done of bytes to do, drawn on stderr only when it is a terminal.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar for `total` bytes (0: not known yet, set later), hidden when stderr is not a
/// terminal (logs, pipes, tests).
pub fn bytes_bar(total: u64) -> ProgressBar {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}
