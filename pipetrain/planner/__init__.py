"""The planner: choose layout, schedule, microbatching and recompute by simulation (mode=plan, schedule=auto)."""
