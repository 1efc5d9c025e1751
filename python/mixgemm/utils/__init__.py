"""Small helpers with no mixgemm dependency: atomic file writes, child processes, progress."""
