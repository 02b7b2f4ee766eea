"""Plans in, block modes out: where plans come from (the planner in this process, or the service) and the
plan in force."""
