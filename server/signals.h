// SIGTERM/SIGINT as ordinary events. The handler only records the signal and posts a
// semaphore (both async-signal-safe); the main thread waits on the semaphore and does
// the shutdown work itself. A handler, rather than blocking the signals and calling
// sigwait, because libraries start threads we do not control (OpenBLAS starts its
// pool when it is loaded, before main) and a blocked-everywhere mask cannot be
// guaranteed for those.
#pragma once

namespace kvfuse::server {

// Installs the handlers; call early in main. Also ignores SIGPIPE (a peer closing a
// socket is an error return, not a death).
void install_shutdown_handlers();
// Waits up to timeout_ms for SIGTERM or SIGINT; returns the signal, or 0.
int wait_shutdown_signal(int timeout_ms);

}  // namespace kvfuse::server
