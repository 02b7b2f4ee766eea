"""A training step as rematd sees it: its phases, what its start and end do, the hello sent once a profile is
complete, and what an out-of-memory error does."""
