"""The service process's own upkeep: when the garbage collector runs, the allocator's arenas, repeated log lines."""
