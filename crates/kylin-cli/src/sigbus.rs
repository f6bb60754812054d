//! What Kylin promises when a weight file changes under it.
//!
//! Weights are memory-mapped read-only and never copied (DESIGN.md invariant 1). Every size is
//! checked when a file is opened (the header's offsets against the file's length), so a file
//! that is short or corrupt is a typed error before anything runs. A file that is truncated
//! *after* it was mapped cannot be caught that way: the next read of a page past its new end
//! raises SIGBUS, which by default kills the process with a bare "Bus error". Kylin installs a
//! handler that says what happened, with the stable code `FILE_CORRUPTED` and the model's path,
//! and exits with status 135 (128 + SIGBUS, what a shell reports for the signal). Changing a
//! model's files while Kylin runs is not supported (the README says so); this makes the failure
//! explicit instead of mysterious. The handler only calls async-signal-safe functions
//! (`write`, `_exit`).

use std::ffi::CString;
use std::path::Path;
use std::sync::OnceLock;

/// The model whose files are mapped, as the handler prints it (set once, before loading).
static MODEL: OnceLock<CString> = OnceLock::new();

/// Exit status after a SIGBUS (128 + the signal number, 7 on Linux x86_64).
pub const EXIT_STATUS: i32 = 128 + libc::SIGBUS;

/// Installs the SIGBUS handler. Called once at start-up.
pub fn install() {
    // SAFETY: a zeroed `sigaction` is a valid value to fill in; `on_sigbus` has the
    // `SA_SIGINFO` signature; sigaction only reads the struct.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

/// Records the model being loaded, for the handler's message (the first one, if several).
pub fn watch(model: &Path) {
    if let Ok(path) = CString::new(model.as_os_str().as_encoded_bytes()) {
        let _ = MODEL.set(path);
    }
}

extern "C" fn on_sigbus(_signal: libc::c_int, _info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    fn write(bytes: &[u8]) {
        // SAFETY: `write(2)` is async-signal-safe; the buffer is valid for `len` bytes.
        unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
    }
    write(b"\nkylin: [FILE_CORRUPTED] a memory-mapped weight file changed size while Kylin was reading it (SIGBUS)");
    if let Some(path) = MODEL.get() {
        write(b": ");
        write(path.as_bytes());
    }
    write(b". Kylin maps weights read-only and checks their sizes when it opens them; they must not be truncated or rewritten while it runs. Restart Kylin once the files are complete.\n");
    // SAFETY: `_exit` is async-signal-safe and ends the process without unwinding.
    unsafe { libc::_exit(EXIT_STATUS) };
}
