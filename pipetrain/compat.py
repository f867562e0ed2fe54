"""Every private torch API pipetrain uses, in one place, with the torch versions it was checked on.

torch keeps no promise about names with a leading underscore; each function below says what it
reaches into and why no public API does the job. Checked on torch 2.13.0 (CPU, gloo: the test
suite) and torch 2.11.0+cu130 (an H200 with NCCL 2.28.9: bench/gpu_check.sh); where the two
differ, both are handled and the function says so. A torch upgrade starts by reading this file.
Hydra and OmegaConf privates have a torch-free sibling door, compat_hydra.py. Not here: the fork server
preloads the module `torch._dynamo` by name where the run compiles (launch/forkserver.py preload(), a
warm-up import that calls nothing in it; the launcher must not import torch, which this file does).
"""

from __future__ import annotations

import datetime
import inspect
import sys
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.optim.optimizer import _use_grad_for_differentiable


def run_backward(roots: Sequence[Any], seeds: Sequence[torch.Tensor], inputs: Sequence[Any], *,
                 keep: bool, accumulate: bool) -> tuple[Optional[torch.Tensor], ...]:
    """One autograd engine pass (`Variable._execution_engine.run_backward`, what torch.autograd.grad and
    backward call after their Python argument checks): the split backward's W makes one pass per parameter
    group, so it skips those checks. Plain tensors and GradientEdges only (no __torch_function__ dispatch)."""
    return Variable._execution_engine.run_backward(
        tuple(roots), tuple(seeds), keep, False, tuple(inputs), True, accumulate
    )


def saved_tensor_slots(node: Any) -> tuple[str, ...]:
    """The names of an autograd node's saved-tensor slots (the `_raw_saved_*` attributes of torch's
    generated nodes): the split backward breaks node -> saved output -> node cycles through them; no
    public API lists a node's SavedTensors."""
    return tuple(a for a in dir(node) if a.startswith("_raw_saved_"))


def saved_tensor_data(node: Any, slot: str) -> list[Any]:
    """What one saved-tensor slot of a node holds (`node._raw_saved_<name>` -> SavedTensor.data; a tuple
    of them for an autograd.Function); raises once the node has run and freed it."""
    value = getattr(node, slot)
    return [v.data for v in (value if isinstance(value, tuple) else (value,))]


def is_view(t: torch.Tensor) -> bool:
    """Whether t is a view of another tensor (`Tensor._is_view`); no public predicate says so."""
    return t._is_view()


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor a view was made from, None for a tensor that is no view (`Tensor._base`): a saved-tensor
    hook asks whether a saved view is a parameter's; no public API returns a view's base."""
    return t._base


def foreach_mul_(tensors: list[torch.Tensor], scalar: float) -> None:
    """Multiply every tensor in place by `scalar` in one fused kernel per device and dtype
    (`torch._foreach_mul_`, what torch's optimizers and clip_grad_norm_ use); no public spelling."""
    torch._foreach_mul_(tensors, scalar)


def set_group_timeout(group: dist.ProcessGroup, seconds: float) -> None:
    """The timeout of an existing process group (`distributed_c10d._set_pg_timeout`; torchtitan
    lowers its groups' timeouts after the first step with it). Public torch sets a timeout only
    when a group is made."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def flatten_mesh(mesh: Any, dims: Sequence[str], name: str) -> Any:
    """The 1-D mesh over several dims of a DeviceMesh (`DeviceMesh._flatten`, as torchtitan's
    ParallelDims builds its dp mesh); no public spelling in 2.11 or 2.13."""
    return mesh[tuple(dims)]._flatten(name)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (`torch._C._current_graph_task_id`, -1
    outside one): non-reentrant activation checkpointing re-runs forwards there, and an MoE block
    must not count their tokens again. No public API says whether a backward is running."""
    return torch._C._current_graph_task_id() != -1


def unflatten_mesh(mesh: Any, dim: str, sizes: Sequence[int], names: Sequence[str]) -> Any:
    """`mesh` with dimension `dim` split row-major into `sizes` named `names` (`DeviceMesh._unflatten`,
    as torchtitan's ParallelDims builds its expert-parallel view); collective, as creating groups is.
    No public spelling in 2.13."""
    return mesh._unflatten(dim, tuple(sizes), tuple(names))


def fsdp_state_param_groups(state: object) -> list:
    """One FSDP2 state's parameter groups: a list in torch 2.13 (`_fsdp_param_groups`), one group
    or None in 2.11 (`_fsdp_param_group`: an H200 run failed on the newer name)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_param_groups(module: torch.nn.Module) -> list:
    """The parameter groups of every FSDP2 state under `module` (fully_shard's `_state_ctx`). The
    executor drives their post_backward itself to reduce a stage's gradients when its last W ends."""
    from torch.distributed.fsdp import fully_shard

    return [g for state in fully_shard.state(module)._state_ctx.all_states for g in fsdp_state_param_groups(state)]


def fsdp_lazy_init(module: torch.nn.Module) -> None:
    """FSDP2's root initialisation (`FSDPState._lazy_init`), which the root module's first forward runs:
    node-level execution never calls a stage's own forward, so the stage claims the root role first."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(module)._lazy_init()


def fsdp_accumulate_in_reduce_dtype(group: object) -> None:
    """Every parameter of an FSDP2 group folds each gradient autograd accumulates into its reduce-dtype
    (fp32) sum at once, as FSDP2's own post-backward hook does after each backward while gradient sync
    is off (`FSDPParam.accumulate_unsharded_grad_if_needed` / `to_accumulated_grad_if_needed`). Node-level
    execution bypasses that hook; without this, bf16 gradients would be summed over microbatches in bf16.
    Registered once: a group keeps its unsharded parameters across steps."""
    for fsdp_param in group.fsdp_params:  # type: ignore[attr-defined]
        def fold(_: torch.Tensor, fp: object = fsdp_param) -> None:
            fp.accumulate_unsharded_grad_if_needed()  # type: ignore[attr-defined]
            fp.to_accumulated_grad_if_needed()  # type: ignore[attr-defined]
        fsdp_param.unsharded_param.register_post_accumulate_grad_hook(fold)


def fsdp_finish_backward(module: torch.nn.Module) -> None:
    """FSDP2's end-of-backward callback (`_root_post_backward_final_callback`), which autograd
    would queue itself: the executor runs backward in pieces (F, B, W), so it calls it once."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(module)._root_post_backward_final_callback()


def local_shape_and_offset(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> tuple[list[int], list[int]]:
    """The local shard's shape and global offset of a DTensor with these placements
    (`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return list(local), list(offset)


def record_memory_history(max_entries: Optional[int]) -> None:
    """Start (max_entries) or stop (None) the CUDA allocator's history (`torch.cuda.memory.
    _record_memory_history`: the snapshot pytorch.org/memory_viz reads)."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator's history (`torch.cuda.memory._dump_snapshot`)."""
    torch.cuda.memory._dump_snapshot(path)


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's workspaces (`torch._C._cuda_clearCublasWorkspaces`, where this build has it):
    kept as allocator blocks, one carved from a large segment pins the whole segment reserved."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def cuda_sleep(cycles: int) -> None:
    """Queue a kernel that spins `cycles` GPU clock cycles on the current stream (`torch.cuda._sleep`, what
    torch's own stream tests use): an emulated network time that occupies no compute (runtime/ep_comm.py
    EPGroup.delay_s). No public API queues a timed wait on a stream."""
    torch.cuda._sleep(cycles)


def cuda_sleep_cycles_per_ms() -> float:
    """GPU clock cycles in one ms of `cuda_sleep` on the current device, measured now (as torch's own tests do),
    after a warm-up sleep that lets the clock rise from idle; a rough figure: the clock moves. Waits for the
    device (a host sync)."""
    torch.cuda.synchronize()
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)  # warm-up
    first.record()
    torch.cuda._sleep(20_000_000)
    last.record()
    last.synchronize()
    return 20_000_000 / first.elapsed_time(last)


def to_empty(module: torch.nn.Module, *, device: Any) -> None:
    """`module.to_empty(device=device)` (uninitialized storage in place of meta tensors), which calls
    `torch.empty_like(t, device=device)` on every meta tensor: a meta tensor's empty_like runs torch's
    Python reference (torch._refs), whose stride logic imports torch.fx.experimental.symbolic_shapes and
    sympy, 0.3-0.6 s of CPU in every rank that builds its model. A plain tensor's storage is made with
    `torch.empty_strided` on the target device instead (the same shape, strides and dtype; no meta kernel
    runs); a tensor subclass (DTensor: tp, FSDP2) keeps empty_like, which it dispatches itself. Through
    `nn.Module._apply`, the private method to_empty itself is built on."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
        return torch.empty_like(t, device=device)

    module._apply(empty)


def keep_compiled_backward() -> None:
    """`torch._functorch.config.donated_buffer = False`: a compiled backward may otherwise reuse the memory
    of the tensors its forward saved (donated buffers) and then refuses retain_graph=True, which the split
    backward's B passes (runtime/backward.py: W restarts the graph below B's boundaries). Set before the
    first backward compiles (AOTAutograd reads it then); no public knob says "this graph is run again"."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False


def untraced(fn: Any) -> Any:
    """`fn` as torch.compiler.disable leaves it where anything imported torch._dynamo (trainer.compile), else
    `fn` itself (importing it costs ~1.4 s of CPU). For Python hooks autograd calls while a compiled graph
    runs (the executor's saved-tensor counter): traced, their guards on the counter's state recompiled at
    every call until dynamo's recompile limit (8), in the measured steps of a compiled run."""
    return torch.compiler.disable(fn) if _dynamo_loaded() else fn


def _dynamo_loaded() -> bool:
    """Whether anything in this process imported torch._dynamo (torch.compile does): until then nothing
    can be tracing, and torch's "do not trace this" wrappers have nothing to do."""
    return "torch._dynamo" in sys.modules


_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)  # the step's body, under torch's wrappers (functools.wraps)
_TRACED_ADAM_STEP = _use_grad_for_differentiable(_ADAM_STEP)  # what torch.optim.Adam.step is, less the hooks


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW that imports no torch._dynamo (~1.4 s of CPU in each process that builds an
    optimizer) in a process that compiles nothing. torch wraps Optimizer.add_param_group, zero_grad,
    state_dict and load_state_dict in `torch._disable_dynamo`, and Adam.step in the private
    `_use_grad_for_differentiable`: each imports torch._dynamo on its first call, only to keep dynamo
    from tracing it (and to call graph_break(), a no-op outside tracing). Until torch._dynamo is
    imported nothing traces, so these run torch's own bodies (`inspect.unwrap`) directly: the same
    code, kernels and numbers; once it is imported (trainer.compile) torch's wrappers run as they
    would. The step's hooks (register_step_pre_hook) are torch's: Optimizer.__init__ wraps this
    class's step as it wraps AdamW's. Checked on torch 2.13 (tests/test_optim.py)."""

    def step(self, closure: Any = None) -> Any:
        if _dynamo_loaded():
            return _TRACED_ADAM_STEP(self, closure)
        with torch.set_grad_enabled(self.defaults["differentiable"]):  # what _use_grad_for_differentiable sets
            return _ADAM_STEP(self, closure)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return super().add_param_group(param_group)
        return inspect.unwrap(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _dynamo_loaded():
            return super().zero_grad(set_to_none)
        return inspect.unwrap(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if _dynamo_loaded():
            return super().state_dict()
        return inspect.unwrap(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return super().load_state_dict(state_dict)
        return inspect.unwrap(torch.optim.Optimizer.load_state_dict)(self, state_dict)
