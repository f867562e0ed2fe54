"""Which links a layout's groups cross, and what each group's collectives get of them (plan.device set).

Ranks are laid out as pipetrain's launcher lays them (parallel/layout.py, torchtitan's mesh order): global rank =
(((pp x dp_replicate + r) x dp_shard + s) x cp + c) x tp + t, so tp is fastest, then cp, then dp (expert parallel
folded over the innermost cp and dp_shard ranks, after tp's where etp = tp), pp slowest; nodes take consecutive
ranks, plan.devices_per_node each.
A group of `size` ranks `stride` apart then has min(size, devices_per_node / stride) members on each node it
touches, and crosses nodes when stride x size > devices_per_node:

  tp  stride 1            cp  stride tp           ep  stride etp (folded over cp, dp: tp when etp = tp, else 1)
  dp  stride tp x cp      pp  stride tp x cp x dp (one P2P pair per rank)

Bandwidth per rank, as the ring collectives of schedules/reduce_cost.py (all-reduce 2(n-1)/n x S, all-gather and
reduce-scatter (n-1)/n x S) and the all-to-alls of partition/costs.py divide it:
  inside a node   NVLink / xGMI: half the datasheet's both-directions figure, at the 80% NCCL's all-reduce bus
                  bandwidth reaches of it (DGX A100: ~230 of 300 GB/s one way);
  across nodes    the node's network shared by its devices, at 85% of line rate, times the group's members on a
                  node (their rings leave the node through as many NICs: NCCL's rings over a rail-optimized fabric),
                  capped by NVLink. A pipeline's P2P pair has one member per node: one NIC's share.
Latency per collective or transfer: 10 us inside a node, 25 us across (NCCL's small-message latencies).
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipetrain.config.devices import DeviceSpec

NVLINK_SHARE = 0.5 * 0.8  # one direction of the datasheet's figure, at NCCL's bus bandwidth
NETWORK_SHARE = 0.85
INTRA_LATENCY_MS, INTER_LATENCY_MS = 0.010, 0.025


@dataclass(frozen=True)
class GroupLink:
    gbs: float  # per-rank bandwidth its collectives get
    latency_ms: float
    crosses_nodes: bool


def group_link(spec: DeviceSpec, per_node: int, *, stride: int, size: int, p2p: bool = False) -> GroupLink:
    """The link a group of `size` ranks `stride` apart gets (module docstring); `p2p`: a pair's transfer, one NIC."""
    intra = spec.link_gbs * NVLINK_SHARE
    if size <= 1 or stride * size <= per_node:
        return GroupLink(intra, INTRA_LATENCY_MS, False)
    members = 1 if p2p else max(1, min(size, per_node // stride))
    nic = spec.network_gbs / per_node * NETWORK_SHARE
    return GroupLink(min(intra, nic * members), INTER_LATENCY_MS, True)


@dataclass(frozen=True)
class Links:
    """One layout's groups and their links."""

    tp: GroupLink
    cp: GroupLink
    ep: GroupLink
    dp: GroupLink
    pp: GroupLink

    def crossing(self) -> str:
        """The groups that leave a node, for the plan's notes ('' when none)."""
        return ", ".join(name for name in ("tp", "cp", "ep", "dp", "pp") if getattr(self, name).crosses_nodes)


def layout_links(spec: DeviceSpec, per_node: int, *, pp: int, dp: int, cp: int, tp: int, ep: int = 1,
                 etp: Optional[int] = None) -> Links:
    """Every group of a pp x dp x cp x tp layout on nodes of `per_node` devices, ep folded over the innermost
    ranks after the expert's etp ones (parallel/layout.py; `etp` None: tp)."""
    if per_node < 1:
        raise ValueError(f"plan.devices_per_node must be >= 1 (got {per_node})")
    link = lambda stride, size: group_link(spec, per_node, stride=stride, size=size)  # noqa: E731
    return Links(tp=link(1, tp), cp=link(tp, cp), ep=link(tp if etp is None else etp, ep), dp=link(tp * cp, dp),
                 pp=group_link(spec, per_node, stride=tp * cp * dp, size=pp, p2p=True))
