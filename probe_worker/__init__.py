"""probe_worker package."""
