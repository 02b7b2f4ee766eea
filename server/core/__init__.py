"""The transport-neutral core: rank sessions, the plan policy, operator controls and the read views."""
