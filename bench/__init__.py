"""shmloader's benchmark harness: workloads x transports -> table, JSON, plots (python -m bench)."""
