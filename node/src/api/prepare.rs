//! Requests made ready for the batch off the async runtime: parsing the body, rendering a
//! chat and tokenizing the prompt run on a blocking thread, one request at a time, so that a
//! crowd of huge prompts neither stalls the runtime's threads (shared with the batch, the
//! streams and `/health`) nor takes every core from the batch. A prompt that cannot fit the
//! context is refused before it is tokenized where its length alone shows it.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

use super::openai::ApiError;
use super::ApiState;

/// Requests made ready at once.
const AT_ONCE: usize = 1;
/// Requests waiting to be made ready before more are turned away (503).
const MAX_WAITING: usize = 64;

/// The one-at-a-time lane requests are made ready in.
pub struct Preparation {
    lane: Semaphore,
    waiting: AtomicUsize,
}

impl Default for Preparation {
    fn default() -> Self {
        Self {
            lane: Semaphore::new(AT_ONCE),
            waiting: AtomicUsize::new(0),
        }
    }
}

/// Counts a request waiting in the lane while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ApiState {
    /// Runs `work` in the lane, on a blocking thread; 503 when too many wait already.
    pub(super) async fn off_runtime<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let prep = &self.preparation;
        let waiting = Waiting(&prep.waiting);
        if prep.waiting.fetch_add(1, Ordering::Relaxed) >= MAX_WAITING {
            return Err(ApiError::busy(format!(
                "the server is busy ({MAX_WAITING} requests waiting to be read): retry later"
            )));
        }
        let permit = prep
            .lane
            .acquire()
            .await
            .map_err(|_| ApiError::server("the server is stopping".into()))?;
        drop(waiting);
        let done = tokio::task::spawn_blocking(work).await;
        drop(permit);
        done.map_err(|e| ApiError::server(format!("reading the request failed: {e}")))?
    }
}

/// Refuses a prompt whose length alone shows it cannot fit a context of `ctx` tokens (no
/// token is longer than `longest` bytes); `param` names it.
pub(super) fn fits_at_all(
    text: &str,
    longest: usize,
    ctx: usize,
    param: &'static str,
) -> Result<(), ApiError> {
    let fewest = text.len().div_ceil(longest.max(1));
    if fewest >= ctx {
        return Err(ApiError::too_long(
            format!(
                "the prompt has at least {fewest} tokens ({} bytes, no token over {longest}); \
                 the context holds {ctx}",
                text.len()
            ),
            param,
        ));
    }
    Ok(())
}
