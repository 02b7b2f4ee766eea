"""Talking to the rematd service: the background gRPC stream, its settings, the job's credential, steady steps
folded into fewer reports, and the in-process planner that stands in while the service cannot be reached."""
