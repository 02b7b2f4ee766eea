"""The demo's training side: a small GPT and the loop that trains it while its sequence length changes (the
``rematd demo`` command starts the service beside it)."""
