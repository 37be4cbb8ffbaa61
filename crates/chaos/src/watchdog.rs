//! A shell that outlives this process: once the process is gone (killed, crashed), it runs a
//! clean-up command, so a run never leaves a server behind.

use std::{
    os::unix::process::CommandExt,
    process::{Child, Command, Stdio},
};

use crate::BoxError;

/// A running watchdog; [`stop`](Self::stop) it when this process cleans up itself.
#[derive(Debug)]
pub(crate) struct Watchdog(Child);

impl Watchdog {
    /// Starts `sh` waiting for this process to exit, then running `cleanup` (shell text), in a
    /// process group of its own so that a signal to this one's group spares it.
    pub(crate) fn spawn(cleanup: &str) -> Result<Self, BoxError> {
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {cleanup}",
            pid = std::process::id(),
        );
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start the clean-up watchdog: {e}"))?;
        Ok(Self(child))
    }

    /// Ends the watchdog without its clean-up.
    pub(crate) fn stop(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
