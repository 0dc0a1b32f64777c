//! One process per store: an exclusive lock (`flock`) on `<store>/lock`, taken before anything
//! in the store is touched and held while it is open.
//!
//! sled locks its own files too, but reports a held lock as an ordinary I/O error, which a
//! store opening could not tell from an index it cannot read: a second `node`, `scrub` or
//! `generate --store` on a running node's store took the live index for a corrupt one, moved it
//! aside and emptied `tmp/` under the running node. With this lock the second process is
//! refused, naming the holder, before it reads or moves anything.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use crate::error::{Context, Error, Result};

/// How long an open waits for a lock held by a store that is closing (a node restarted in the
/// same process releases it a moment after its last handle drops).
const WAIT: Duration = Duration::from_secs(2);

/// The held lock of one open store; released when dropped (its file is closed).
#[derive(Debug)]
pub(super) struct StoreLock {
    _file: Option<File>,
    /// The store cannot be written (read-only media, or not this user's to write): nothing in
    /// it can change under anyone, so no lock is needed, and the store is opened to be read.
    read_only: bool,
}

impl StoreLock {
    /// Takes the lock of the store at `dir`, or says who holds it.
    pub(super) fn take(dir: &Path) -> Result<Self> {
        let path = dir.join("lock");
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path);
        let mut file = match opened {
            Ok(f) => f,
            // A store on read-only media (or not ours to write): it cannot be changed under
            // anyone, so it is opened to be read, without a lock.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EROFS) | Some(libc::EACCES)) => {
                return Ok(Self {
                    _file: None,
                    read_only: true,
                });
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("opening the store's lock {}", path.display()))
            }
        };
        let until = std::time::Instant::now() + WAIT;
        loop {
            // SAFETY: flock on a file this function owns; it touches no memory.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::WouldBlock {
                return Err(err).with_context(|| format!("locking {}", path.display()));
            }
            if std::time::Instant::now() >= until {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(Error::StoreInUse {
                    dir: dir.to_path_buf(),
                    holder: holder.trim().chars().take(64).collect(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Who holds it, for the message a second process gets (best effort: a store on
        // read-only media is still read).
        if file.set_len(0).is_ok() && file.rewind().is_ok() {
            let _ = write!(file, "pid {}", std::process::id());
            let _ = file.flush();
        }
        Ok(Self {
            _file: Some(file),
            read_only: false,
        })
    }

    /// Whether the store cannot be written by this process.
    pub(super) fn read_only(&self) -> bool {
        self.read_only
    }
}
