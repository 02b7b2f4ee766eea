"""What ``attach`` refuses in a model before it changes anything: compiled modules, a library's own checkpointing."""
