"""Real multi-process gloo runs for tests: one process per rank, no mocks.

Tests that train as a user does start ranks through `pipetrain.launch.launch` (launch/agent.py),
the path `pipetrain` takes. `spawn` (launch/local.py: spawn_local) is for the tests that cannot:
  - several schedules or runs in one process group (test_executor.py, test_observe.py): one
    start-up per group instead of one per schedule and model;
  - ranks that must die mid-step or outlive a dead peer (test_executor_failure.py, the crash
    mid-save in test_checkpoint.py): the launcher stops every rank as soon as one
    fails, before the survivors could show their own errors.
Either way the process group is the same: gloo over a loopback TCP rendezvous.
"""

from pipetrain.launch.local import spawn_local as spawn  # noqa: F401
