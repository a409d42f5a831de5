//! SIGKILL (placeholder, filled below).
