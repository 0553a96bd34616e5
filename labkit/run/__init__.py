"""A run on disk: its directory (config, the JSONL logs, checkpoints, the lock), its stop
rules and its trackers."""
