"""Small helpers that need nothing of mixgemm but its errors: atomic file writes, child processes,
progress."""
