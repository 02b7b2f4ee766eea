"""Programs the distributed tests run on each rank (``python -m tests.workers.<name>``)."""
