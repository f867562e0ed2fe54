"""OmegaConf resolvers of the shipped cluster configs, and a process's rank before any group exists.

    ${pipetrain.on_rank0:${cluster.name},.hydra}     only rank 0 writes Hydra's .hydra/ and job log
    ${pipetrain.now:%H-%M-%S}                        Hydra's `now`, one instant for every torchrun rank
    ${pipetrain.run_dir:${run.name}}                 outputs/NAME, or a new outputs/DATE/TIME[-n] of its own
    ${pipetrain.tasks_per_node:degree,nodes,rpn,dpr,dps} SLURM tasks per node (the schema's own rule)
    ${pipetrain.devnull:}                            os.devnull

`register_resolvers()` is called by whoever composes a config (the CLI, the sbatch renderer,
the tests), never at import time. A submitit task composes its config
in a fresh process: Hydra pickles the registered resolvers with its singleton state
(hydra.core.singleton.Singleton.get_state) and restores them there.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from pipetrain.config.cluster import tasks_per_node
from pipetrain.config.parallel import world_text

# ---- the process's own rank, before any process group exists ------------------------------

_RANK_VARS = {"torchrun": "RANK", "slurm": "SLURM_PROCID", "submitit_local": "SUBMITIT_LOCAL_GLOBALID"}


def process_rank(cluster: str) -> int:
    """This process's global rank as its launcher announced it (0 for cluster=local's main process)."""
    var = _RANK_VARS.get(cluster)
    return int(os.environ.get(var, "0")) if var else 0


def _on_rank0(cluster: str, value: Any, other: Any = None) -> Any:
    """`${pipetrain.on_rank0:${cluster.name},.hydra}`: value on rank 0, `other` on the other ranks
    (how only rank 0 writes Hydra's .hydra/ and job log into the run directory all ranks share)."""
    return value if process_rank(cluster) == 0 else other


def _shared_now(pattern: str) -> str:
    """`${pipetrain.now:%H-%M-%S}`: Hydra's `now`, but the same instant on every rank of a torchrun
    launch. Each rank composes its own config, so `now` may differ by a second between them and
    split the run over two directories; here the first rank to ask stores its clock in torchrun's
    rendezvous store (TORCHELASTIC_USE_AGENT_STORE: the agent's TCPStore at MASTER_ADDR:MASTER_PORT)
    and the others read it. The key holds the run id, so a restarted worker group (max_restarts)
    gets the same directory back, which is where trainer.resume=auto looks."""
    stamp = float(_shared("now", lambda: repr(time.time())))
    return datetime.fromtimestamp(stamp).strftime(pattern)


_CLAIMED: dict[str, str] = {}  # this process's unnamed run directory, once claimed


def _run_dir(name: Optional[str], root: str = "outputs") -> str:
    """`${pipetrain.run_dir:${run.name}}`: a named run always gets outputs/NAME (so a restarted or
    requeued job finds its checkpoints); an unnamed one a directory nobody else has: outputs/DATE/TIME,
    or TIME-2, TIME-3... when another run took that second (mkdir is the atomic claim). Under
    torchrun one rank claims it and the others read it from the agent's store, keyed by the run id
    (so a restarted worker group gets the same directory back)."""
    if name:
        return f"{root}/{name}"
    if root not in _CLAIMED:
        _CLAIMED[root] = _shared("run_dir", lambda: _claim(Path(root)))
    return _CLAIMED[root]


def _claim(root: Path) -> str:
    now = datetime.now()
    base = root / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")
    for n in range(1, 10_000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir(parents=True)
            return str(path)
        except FileExistsError:
            continue
        except OSError:  # unwritable: the CLI's writability check says so in one line
            return str(path)
    raise ValueError(f"{base}-*: 10,000 runs started in this second: set run.name")


def _shared(what: str, make: Callable[[], str]) -> str:
    """`make()` in this process, or, under torchrun, in the first rank to ask (the others wait for it)."""
    env = os.environ
    if not (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env and "MASTER_PORT" in env):
        return make()
    import datetime as dt

    import torch.distributed as dist  # only here, under torchrun: composing stays torch-free

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=dt.timedelta(seconds=120))
    key = f"pipetrain/{what}/{env.get('TORCHELASTIC_RUN_ID', 'none')}"
    if store.add(key + "/askers", 1) == 1:
        store.set(key, make())
    return store.get(key).decode()


def _tasks_per_node(degree: int, nodes: int, ranks_per_node: Optional[int], dp_replicate: int = 1,
                    dp_shard: int = 1, tp: int = 1, cp: int = 1) -> int:
    rpn = None if ranks_per_node is None else int(ranks_per_node)
    if int(dp_shard) == -1:  # fills the world: nodes x ranks_per_node (the schema says so when unset)
        if rpn is None:
            raise ValueError("parallel.dp_shard=-1 fills the world, which cluster.nodes x cluster.ranks_per_node "
                             "fixes: set cluster.ranks_per_node (or parallel.dp_shard to a number)")
        return rpn
    world = int(degree) * int(dp_replicate) * int(dp_shard) * int(cp) * int(tp)
    return tasks_per_node(world, int(nodes), rpn, world_text(int(degree), int(dp_replicate), int(dp_shard), int(cp),
                                                             int(tp)))


def register_resolvers() -> None:
    for name, fn, cache in (("pipetrain.on_rank0", _on_rank0, False), ("pipetrain.now", _shared_now, True),
                            ("pipetrain.tasks_per_node", _tasks_per_node, False),
                            ("pipetrain.run_dir", _run_dir, True),
                            ("pipetrain.devnull", lambda: os.devnull, False)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=cache)
