"""`llm-health serve`: background rounds per backend, served from snapshots
(`app`, `collectors`, `probe_targets`), and the Redis view of pools and routes."""
