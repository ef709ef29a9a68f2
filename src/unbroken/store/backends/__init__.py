"""Storage backends: `local` (POSIX files, fsync and rename)."""
