"""Worker processes: the spawned worker, its per-step wire format and shared KV pools."""
