"""Measure each layer's F, B and W on the current device (`partition=profile`).

For every layer, on its real input (the previous layers' output for one example batch):
  F  = forward (the last layer includes the loss, which lives on the last stage);
  B  = torch.autograd.grad(out, x): the gradient w.r.t. the layer input only (the engine
       skips every weight-gradient kernel);
  BW = torch.autograd.grad(out, [x, *params]): the full backward;
  W  = BW - B, the median of the per-repetition differences, clamped at 0. Timing W on
       its own needs the executor's split-backward machinery; the difference is what a
       split backward pays for the weights.
The embedding's input is integer, so its B is 0 and its whole backward is W.
Each figure is the median over `iters` timed repetitions after `warmup` untimed ones.
On CPU the layers are timed at the ranks' intra-op thread count (`threads`: trainer.threads_per_rank),
not torch's default of one thread per core: on a 2-core machine shared with other jobs, two threads
per matmul waited on each other and timed GPT-2 tiny's blocks at 50-90 ms where one thread (what
the ranks run) takes 1 ms, a 12x too slow plan.

One layer at a time: a model built on the meta device (what the planner passes) has each layer
materialised on the device, measured and freed before the next, so profiling holds one layer's
weights and gradients, never the whole model (review F3: llama-sized models built whole on GPU 0,
in every rank process, ran out of memory). Its weights are drawn uniform and small on the device
itself: times and saved bytes do not depend on the values, and the model's own init (seeded CPU
draws per parameter, ~20 s for llama3.2-1b) would be paid again for every microbatch size.
Under `precision=bf16` every forward (loss included) runs under torch.autocast(device, bf16), as
the executor's stages do (runtime/executor.py `_autocast`); fp32 timings on an H100 are several
times the bf16 a run sees.

Results are cached as JSON per (model class and config, batch, seq, device, dtype, precision, torch
version) under $PIPETRAIN_CACHE_DIR/profile (default ~/.cache/pipetrain/profile), written
to a temporary file and renamed, so concurrent ranks never read half a file.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from pipetrain.compat import clear_cublas_workspaces
from pipetrain.files import write_text_atomic
from pipetrain.models.base import COMPUTE_DTYPES, LayeredModel
from pipetrain.partition.costs import LayerCost

# 3: one layer at a time under the run's autocast (2: the whole model in fp32; 1: torch's default threads)
CACHE_FORMAT = 3


def default_cache_dir() -> Path:
    root = Path(os.environ.get("PIPETRAIN_CACHE_DIR") or Path.home() / ".cache" / "pipetrain")
    if root.exists() and not root.is_dir():
        raise ValueError(f"PIPETRAIN_CACHE_DIR={root} is a file: point it at a directory (or unset it for "
                         f"~/.cache/pipetrain)")
    return root / "profile"


def profile_layers(
    model: LayeredModel,
    *,
    batch: int,
    seq: int,
    iters: int = 5,
    warmup: int = 2,
    device: torch.device | str | None = None,
    cache_dir: Path | str | None = None,
    refresh: bool = False,
    threads: int | None = None,
    precision: str = "fp32",
) -> list[LayerCost]:
    """Measured per-layer costs for one microbatch of `batch` x `seq`; params, FLOPs and
    activation bytes come from the model's analytic cost model. `refresh` re-measures.
    `threads`: on CPU, the intra-op threads to time with (what each rank runs); None: torch's current.
    `precision` (trainer.precision): bf16 times every forward under autocast to bf16, as the stages run.
    `model` may live on the meta device (then each layer is materialised on `device` in turn)."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"profile needs iters >= 1 and warmup >= 0 (got iters={iters}, warmup={warmup})")
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if dev.type == "meta":
        raise ValueError("profile_layers times on a real device: pass device= for a model built on meta")
    try:
        with _cpu_threads(dev, threads):
            return _profile(model, batch=batch, seq=seq, iters=iters, warmup=warmup, device=dev, cache_dir=cache_dir,
                            refresh=refresh, precision=precision)
    finally:
        release(dev)


def release(device: torch.device) -> None:
    """Give the allocator's cached blocks back after profiling on CUDA: the launcher process (and
    rank 0, which profiles before it trains) would otherwise keep them reserved for the whole run.
    cuBLAS keeps its workspaces (64 MiB on an H200) as allocator blocks, and one carved from a large
    segment pins the segment: after profiling llama3.2-1b there, 2.1 GB stayed reserved beside 64 MiB
    allocated. They are dropped first (torch's private hook for it, where this build has one; cuBLAS
    makes new ones on its next call)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear_cublas_workspaces()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def _cpu_threads(device: torch.device, threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` on CPU for the block, then restored."""
    before = torch.get_num_threads()
    if device.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _profile(model: LayeredModel, *, batch: int, seq: int, iters: int, warmup: int, device: torch.device,
             cache_dir: Path | str | None, refresh: bool, precision: str) -> list[LayerCost]:
    dev = device
    key = _cache_key(model, batch=batch, seq=seq, device=dev, precision=precision)
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"
    analytic = model.cost_model(microbatch=batch, seq=seq, tflops=1.0)
    if not refresh:
        cached = _read_cache(path, key, len(model.layers))
        if cached is not None:
            return [dataclasses.replace(c, f_ms=f, b_ms=b, w_ms=w) for c, (f, b, w) in zip(analytic, cached)]
    times = _measure(model, batch=batch, seq=seq, iters=iters, warmup=warmup, device=dev, precision=precision)
    costs = [dataclasses.replace(c, f_ms=f, b_ms=b, w_ms=w) for c, (f, b, w) in zip(analytic, times)]
    write_text_atomic(path, json.dumps({"key": key, "iters": iters, "warmup": warmup,
                                        "layers": [dataclasses.asdict(c) for c in costs]}, indent=1))
    return costs


def _cache_key(model: LayeredModel, *, batch: int, seq: int, device: torch.device, precision: str) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "model": type(model).__name__,
        "config": model.config,
        "batch": batch,
        "seq": seq,
        "device": _device_description(device),
        "dtype": str(model.param_dtype),
        "precision": precision,
        "torch": torch.__version__,
    }


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        # CPU timings scale with the intra-op thread count, so it is part of the device.
        return f"cpu:{platform.machine()}:{platform.processor() or '?'}:{torch.get_num_threads()}threads"
    return str(device)


def _read_cache(path: Path, key: dict[str, Any], num_layers: int) -> list[tuple[float, float, float]] | None:
    """The measured (F, B, W) ms per layer of a cache file, or None (missing, stale, a collision). Only the
    times: every other field of a LayerCost is the model's analytic cost, taken fresh at each read, so a
    field added to LayerCost later (experts_flops_share) is not read back as its default from an older file."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key or len(data.get("layers", ())) != num_layers:
            return None  # a hash collision or a stale format: measure again
        return [(float(d["f_ms"]), float(d["b_ms"]), float(d["w_ms"])) for d in data["layers"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize(device)


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The stages' autocast for trainer.precision on `device` (none under fp32)."""
    dtype = COMPUTE_DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def layer_on(model: LayeredModel, i: int, device: torch.device) -> nn.Module:
    """Layer `i` of `model`, on `device`, alone: the layer itself where it already lives there, a
    copy moved there from another real device, or, from the meta device, a copy materialised there
    with small uniform weights drawn on the device (values change neither times nor saved bytes)."""
    layer = model.layers[i]
    where = next(iter(layer.parameters()), None)
    if where is None or where.device == device:
        return layer
    if where.device.type != "meta":
        return copy.deepcopy(layer).to(device)
    real = copy.deepcopy(layer).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(i)
    with torch.no_grad():
        for p in real.parameters():
            p.uniform_(-0.02, 0.02, generator=gen)
    return real


def _measure(model: LayeredModel, *, batch: int, seq: int, iters: int, warmup: int, device: torch.device,
             precision: str) -> list[tuple[float, float, float]]:
    x, target = model.example_batch(microbatch=batch, seq=seq, generator=torch.Generator().manual_seed(0),
                                    device=device)
    last, out = len(model.layers) - 1, []
    for i in range(len(model.layers)):
        layer = layer_on(model, i, device)
        was_training = layer.training
        layer.train()  # time what training runs (dropout active if configured)
        try:
            samples = [_time_once(layer, x, target=target if i == last else None, loss_fn=type(model).loss_fn,
                                  device=device, precision=precision) for _ in range(warmup + iters)][warmup:]
            if i < last:
                with torch.no_grad(), autocast_for(device, precision):
                    x = layer(x)  # the next layer's input, as the stage hands it on
        finally:
            layer.train(was_training)
        del layer  # a materialised copy is freed here, before the next layer is built
        # W is the median of per-repetition differences BW - B
        f, b, w = (statistics.median(v) * 1e3 for v in zip(*[(f, b, bw - b) for f, b, bw in samples]))
        out.append((f, b, max(w, 0.0)))
    return out


def _time_once(layer: nn.Module, inp: torch.Tensor, *, target: torch.Tensor | None, loss_fn: Any,
               device: torch.device, precision: str = "fp32") -> tuple[float, float, float]:
    """(F, B, BW) seconds of one forward and backward of `layer` on `inp`; the forward (and the
    loss) under the run's autocast, the backward outside it, as the executor runs them."""
    params = [p for p in layer.parameters() if p.requires_grad]
    x = inp.detach().requires_grad_(inp.is_floating_point())
    _sync(device)
    t0 = time.perf_counter()
    with autocast_for(device, precision):
        out = layer(x)
        if target is not None:
            out = loss_fn(out, target)
    _sync(device)
    t1 = time.perf_counter()
    grad_out = torch.ones_like(out)  # values do not change the time; not counted in F or B
    _sync(device)
    t1b = time.perf_counter()
    if x.requires_grad:
        torch.autograd.grad(out, x, grad_out, retain_graph=True)  # B: input gradient only
        _sync(device)
    t2 = time.perf_counter()
    torch.autograd.grad(out, [x, *params] if x.requires_grad else params, grad_out)  # BW: full backward
    _sync(device)
    t3 = time.perf_counter()
    return t1 - t0, (t2 - t1b) if x.requires_grad else 0.0, t3 - t2


def saved_bytes_per_token(model: LayeredModel, *, batch: int, seq: int,
                          device: torch.device | str | None = None, precision: str = "fp32",
                          boundary_inputs: bool = False) -> list[float]:
    """Per layer, the bytes autograd saves in its forward for one microbatch, per token: the
    executor's own count (runtime/step_result.SavedBytes), so a plan's activation memory and the
    run's measured one are the same quantity. A tensor two neighbouring layers both save is
    counted in each (the executor counts it once per stage): the estimate errs high.

    `precision` (trainer.precision): under bf16 the layers run under autocast to it, as the stages
    do. Each layer then takes the previous one's output as it is (the first stage's view: the
    residual stream stays in the parameters' dtype from the embedding on), or with
    `boundary_inputs` cast to the compute dtype (a later stage's view: it receives that dtype and
    its residual stream stays in it)."""
    from pipetrain.runtime.step_result import SavedBytes

    compute_dtype = COMPUTE_DTYPES[precision]
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    x, _ = model.example_batch(microbatch=batch, seq=seq, generator=torch.Generator().manual_seed(0), device=dev)
    out = []
    try:
        for i in range(len(model.layers)):  # one layer on the device at a time (layer_on)
            layer = layer_on(model, i, dev)
            counter = SavedBytes()
            if boundary_inputs and compute_dtype is not None and i > 0 and x.is_floating_point():
                x = x.to(compute_dtype)
            inp = x.detach().requires_grad_(x.is_floating_point())
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), autocast_for(dev, precision):
                x = layer(inp).detach()  # drops the graph (and what it saved) with the layer
            del layer
            out.append(counter.bytes / (batch * seq))
    finally:
        release(dev)
    return out


def loss_saved_bytes_per_token(model: LayeredModel, *, seq: int, precision: str = "fp32") -> float:
    """The bytes the loss saves for its backward, per token (a causal LM's cross-entropy: the log-softmax
    of the logits, fp32 under bf16 autocast too, and the int64 targets), counted as the executor counts a
    last stage's forward, which runs the loss inside its count. The loss runs outside the layers, so
    per-layer checkpointing does not drop it: a recomputing last stage keeps it per microbatch in flight
    beside its layers' inputs. Measured on CPU over a few tokens (the model may live on meta: only its
    shapes and loss function are used; a vocabulary of 128k at 4k tokens would be 2 GB). Whole-vocabulary
    bytes: under tensor parallel a tp rank's vocab-parallel loss keeps V/tp of the logits' fp32 softmax
    and the same targets, 1/tp of this but the targets (planner/memory.py: loss_rank_bytes)."""
    from pipetrain.runtime.step_result import SavedBytes

    tokens = min(seq, 8)
    spec = model.boundary_specs(microbatch=1, seq=tokens)[-1]
    target_spec = model.target_spec(microbatch=1, seq=tokens)
    compute = COMPUTE_DTYPES[precision]
    out = torch.zeros(spec.shape, dtype=compute or spec.dtype, requires_grad=True)
    target = torch.zeros(target_spec.shape, dtype=target_spec.dtype)
    counter = SavedBytes()
    autocast = torch.autocast("cpu", dtype=compute) if compute is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), autocast:
        model.loss(out, target)
    return counter.bytes / tokens


def autocast_weight_bytes(model: LayeredModel, *, precision: str = "fp32") -> list[float]:
    """Per layer, the bytes of the compute-dtype copies autocast makes of its Linear weights in one
    forward and saves for the input gradient (0 under fp32). Each microbatch's forward makes its own
    (a new autocast region each), and its graph holds them until its backward: per microbatch in
    flight, like activations, but not per token. Biases are cast too but not saved. Counted from
    the modules alone, so a model on the meta device works."""
    dtype = COMPUTE_DTYPES[precision]
    if dtype is None:
        return [0.0] * len(model.layers)
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    return [float(size * sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear)))
            for layer in model.layers]


def tied_weights(model: Any) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Per weight that several layers share (a tied embedding and head): those layers and its size, read off the
    model's parameters (models/costs.py tied_layers gives the same from the config, for the planner)."""
    if model is None:
        return ()
    from pipetrain.models.split import tie_groups

    params = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[str, set[int]] = {}
    for name, canonical in tie_groups(model).items():
        groups.setdefault(canonical, set()).add(int(name.split(".")[1]))  # layers.{i}.rest
    return tuple((tuple(sorted(layers)), params[c].numel()) for c, layers in sorted(groups.items()) if len(layers) > 1)
