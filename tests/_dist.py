"""Real multi-process gloo runs for tests: one process per rank, no mocks."""

from pipetrain.launch.local import spawn_local as spawn  # noqa: F401
