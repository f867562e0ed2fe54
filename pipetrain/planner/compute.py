"""A layer's time on a catalog device (config/devices.py) from what it computes (partition/costs.py LayerShape),
instead of one TFLOP/s for every layer: plan.py's model_layer_costs calls `layer_times` when plan.device names a device.

  GEMM        roofline: max(2mnk / (peak x efficiency), bytes / HBM bandwidth). The efficiency is the share of the
              peak a large GEMM sustains (`Kernels.gemm`), times d / (d + 128) for each of m, n, k: a GEMM whose
              dimension is a few tiles wide (a head_dim of 96, a tp-split width, a microbatch of one short
              sequence) fills fewer of the device's tiles and waves (at d = 4,096: 97%; d = 2,048: 94%; d = 128: 50%)
              F = (m, n, k), B (input gradient) = (m, k, n), W (weight gradient) = (k, n, m).
  attention   flash: one fused kernel, causal, so each query meets half the sequence on average:
              F = 4 x tokens x seq/2 x head_dim x heads FLOPs at `Kernels.attention_f` of the peak, B 2.5x that
              (the backward recomputes the scores) at `attention_b`.
              materialized (Megatron-LM 2021's): QK^T and AV as batched GEMMs over the whole s x s, and the
              scores' scale-mask-softmax and dropout as element-wise passes over s x s x heads values
              (4 in the forward, 5 in the backward, each read and written once).
  element-wise  norms, activations, residual adds, the loss: bytes over HBM bandwidth at `Kernels.memory`;
              the backward moves twice the forward's; unfused (plan.fused_elementwise=false) UNFUSED times that.
  fp8         plan.fp8: the linear layers' GEMMs at the fp8 peak (`Kernels.gemm_fp8` of it) plus their casts (each
              operand read in bf16 and written in fp8, 3 bytes per value); attention stays bf16.

One tp x cp rank's shapes are timed (tp splits a GEMM's n or k and the heads, cp the queries), and the result
scaled back to the whole layer (x tp x cp) so that tp_cost.py and costs.py's cp_layer_costs, which divide a whole
layer's time by tp and cp, give that rank's time: the small-GEMM efficiency of a wide tp stays in the prediction.
Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipetrain.config.devices import DeviceSpec
from pipetrain.partition.costs import COLUMN, ROW, LayerCost

TILE = 128  # the dimension at which a GEMM reaches half its large-size efficiency (d / (d + TILE))


@dataclass(frozen=True)
class Kernels:
    """What the software reaches of a device's peaks (the planner's assumptions, each with where it comes from)."""

    gemm: float  # share of the bf16 peak a large GEMM sustains
    gemm_fp8: float  # likewise of the fp8 peak
    attention_f: float  # share of the bf16 peak a fused (flash) attention forward sustains
    attention_b: float  # and its backward
    memory: float  # share of the HBM bandwidth a streaming element-wise kernel reaches


# cuBLAS large bf16 GEMMs: ~250 of the A100's 312 TFLOP/s inside a training step (bias and activation
# epilogues, ~270 alone) and ~750 of the H100 SXM's 989 (NVIDIA's and public
# GEMM benchmarks); FlashAttention-2 (arXiv 2307.08691): up to 73% of the A100's peak forward, ~60% backward, and
# 35% of the H100's (FlashAttention-3, arXiv 2407.08608, Figure 1's FA2 bars); streaming kernels ~80% of HBM.
KERNELS = {
    "a100": Kernels(gemm=0.80, gemm_fp8=0.0, attention_f=0.62, attention_b=0.50, memory=0.80),
    "h100": Kernels(gemm=0.76, gemm_fp8=0.62, attention_f=0.40, attention_b=0.33, memory=0.80),
    "b200": Kernels(gemm=0.76, gemm_fp8=0.62, attention_f=0.40, attention_b=0.33, memory=0.80),
    "mi300x": Kernels(gemm=0.60, gemm_fp8=0.50, attention_f=0.35, attention_b=0.28, memory=0.75),
}
FAMILY = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-sxm": "h100", "h100-gt": "h100", "h800": "h100",
          "h200": "h100", "b200": "b200", "mi300x": "mi300x"}
# unfused element-wise ops (eager PyTorch: RMSNorm as pow, mean, rsqrt and two muls; SiLU then mul; RoPE apart) move
# about three times the bytes of fused kernels (torch.compile, Megatron-LM's fused LayerNorm / bias-GeLU / softmax)
UNFUSED = 3.0


@dataclass(frozen=True)
class Timing:
    """How a plan times layers on a device: which device, the run's attention kernel and GEMM precision, and the
    bytes of an activation value (2: bf16)."""

    device: DeviceSpec
    attention: str = "flash"
    fp8: bool = False
    value_bytes: int = 2
    fused: bool = True  # element-wise ops fused (plan.fused_elementwise); False: UNFUSED x their bytes

    @property
    def kernels(self) -> Kernels:
        return KERNELS[FAMILY[self.device.name]]

    @property
    def sustained_tflops(self) -> float:
        """What a layer without a shape (an MoE block, a sleep layer) is timed at: the bf16 peak of a large GEMM."""
        return self.device.bf16_tflops * self.kernels.gemm


def gemm_ms(m: float, n: float, k: float, t: Timing, *, fp8: bool = False) -> float:
    """One (m, k) @ (k, n) GEMM: the roofline of its FLOPs at the shape's efficiency and its bytes."""
    dev, kern = t.device, t.kernels
    share = (kern.gemm_fp8 if fp8 else kern.gemm) * (m / (m + TILE)) * (n / (n + TILE)) * (k / (k + TILE))
    compute = 2.0 * m * n * k / (dev.peak_tflops(fp8) * 1e12 * share)
    memory = stream_ms((m * k + k * n + m * n) * (1 if fp8 else t.value_bytes), t) / 1e3
    return max(compute, memory) * 1e3


def stream_ms(nbytes: float, t: Timing) -> float:
    """Bytes through HBM by an element-wise kernel."""
    return nbytes / (t.device.memory_tbs * 1e12 * t.kernels.memory) * 1e3


def layer_times(layer: LayerCost, *, tokens: int, seq: int, t: Timing, tp: int = 1, cp: int = 1,
                sequence_parallel: bool = False) -> LayerCost:
    """`layer` for one microbatch of `tokens` tokens (sequences of `seq`), its F, B and W from its shape on `t`'s
    device as one tp x cp rank computes them, scaled to the whole layer (x tp x cp: see the module's docstring).
    A layer without a shape is returned as it is (plan.py costs its FLOPs at `t.sustained_tflops`)."""
    if layer.shape is None:  # costed by plan.py at t.sustained_tflops already
        return layer
    s, m = layer.shape, tokens / cp  # this rank's tokens (cp splits every sequence)
    f = b = w = 0.0
    for k, n, split in s.gemms:
        k_r, n_r = (k / tp if split == ROW else k), (n / tp if split == COLUMN else n)
        f += gemm_ms(m, n_r, k_r, t, fp8=t.fp8)
        b += gemm_ms(m, k_r, n_r, t, fp8=t.fp8)
        w += gemm_ms(k_r, n_r, m, t, fp8=t.fp8)
        if t.fp8:  # each operand cast to fp8: read bf16, write fp8 (x and W in F; dY in B, then reused by W)
            f += stream_ms(3.0 * (m * k_r + k_r * n_r), t)
            b += stream_ms(3.0 * (m * n_r + k_r * n_r), t)
    if s.heads:
        fa, ba = attention_ms(heads=s.heads / tp, head_dim=s.head_dim, queries=m, seq=seq, cp=cp, t=t)
        f, b = f + fa, b + ba
    values = s.elementwise_values / tp + s.elementwise_whole / (tp if sequence_parallel else 1)
    moved = stream_ms(values * m * t.value_bytes * (1.0 if t.fused else UNFUSED), t)
    f, b = f + moved, b + 2.0 * moved
    scale = tp * cp
    return dataclasses.replace(layer, f_ms=f * scale, b_ms=b * scale, w_ms=w * scale)


def attention_ms(*, heads: float, head_dim: int, queries: float, seq: int, cp: int, t: Timing) -> tuple[float, float]:
    """(F, B) ms of one rank's attention: `heads` of its heads over its `queries` query tokens (seq / cp of each
    sequence), each query meeting up to `seq` keys."""
    peak = t.device.bf16_tflops * 1e12
    if t.attention == "flash":  # causal: a query meets seq / 2 keys on average (cp's head-tail chunks too)
        flops = 4.0 * queries * (seq / 2) * head_dim * heads
        return flops / (peak * t.kernels.attention_f) * 1e3, 2.5 * flops / (peak * t.kernels.attention_b) * 1e3
    q = seq / cp  # a sequence's queries on this rank
    pairs = queries / q * heads  # (sequence, head) pairs, each a (q, seq) score matrix
    scores = gemm_ms(q, seq, head_dim, t) + gemm_ms(q, head_dim, seq, t)  # QK^T, then softmax(.) V
    values = pairs * q * seq * t.value_bytes  # bytes of one pass over the scores
    return pairs * scores + stream_ms(4 * values, t), 2.0 * pairs * scores + stream_ms(5 * values, t)
