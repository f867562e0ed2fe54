"""The parallel degrees a plan searches besides pp and dp: plan.tp, plan.ep and plan.cp, each resolved and
checked against the world, the model and data.seq_len in one line naming the knob, before anything is
simulated (as parallel.tp / ep / cp are checked before a run starts). Pure: no torch."""

from __future__ import annotations

from pipetrain.config import AUTO, Config
from pipetrain.config.devices import LOCAL

NODE_TP = (1, 2, 4, 8)  # tp degrees a device plan tries by default: powers of two inside one node


def world_size(config: Config) -> int:
    """Ranks the plan lays out: plan.world_size, else plan.nodes x plan.devices_per_node (plan.device's node where
    that is null), else the run's layout."""
    p = config.plan
    if p.world_size is not None:
        return p.world_size
    if p.node_size is not None:
        return p.nodes * p.node_size
    return config.layout.world


def tp_degrees(config: Config) -> list[int]:
    """plan.tp, its null resolved: [1] locally; on a device every power of two up to its node that divides what
    the model splits (heads, widths, vocabulary)."""
    p, m = config.plan, config.model
    if p.tp is not None:
        return list(p.tp)
    if p.device == LOCAL:
        return [1]
    divides = m.tp_divides() or {}
    return [t for t in NODE_TP if t <= (p.node_size or 1) and (t == 1 or divides)
            and all(v % t == 0 for v in divides.values())]


def check_tp(config: Config) -> None:
    """plan.tp against the world and the model, one line each, before anything is simulated."""
    p, m, world = config.plan, config.model, world_size(config)
    for tp in tp_degrees(config):
        if world % tp:
            raise ValueError(
                f"plan.tp lists {tp}, which does not divide the world of {world} ranks: drop it from plan.tp")
        if tp == 1:
            continue
        divides = m.tp_divides()
        if divides is None:
            if m.family == "sleep" and not (config.schedule.name == AUTO or p.run):
                continue  # mode=plan prices the sleep model's tp as mode=simulate does; it cannot train it
            raise ValueError(f"plan.tp lists {tp} but model={m.name} has no tensor-parallel plan (GPT-2, the Llama "
                             f"family and DeepSeek have one): set plan.tp=[1]")
        for knob, value in divides.items():
            if value % tp:
                raise ValueError(
                    f"plan.tp lists {tp}, which does not divide model.{knob}={value}: drop it from plan.tp")
        if p.sequence_parallel and m.has_seq and config.data.seq_len % tp:
            raise ValueError(f"plan.sequence_parallel splits data.seq_len={config.data.seq_len} across plan.tp {tp}: "
                             f"set data.seq_len to a multiple of {tp} or drop {tp} from plan.tp")


def ep_degrees(config: Config) -> list[int]:
    """plan.ep, its null resolved (every divisor of an MoE model's expert count; [1] for a dense model),
    each checked against the model in one line."""
    moe, listed = config.model.moe_config, config.plan.ep
    if moe is None:
        if listed and max(listed) > 1:
            raise ValueError(f"plan.ep lists {max(listed)} but model={config.model.name} has no MoE experts to split: "
                             f"set plan.ep=[1] or choose an MoE model (model=moe-tiny)")
        return [1]
    if listed is None:
        return [e for e in range(1, moe.num_experts + 1) if moe.num_experts % e == 0]
    for ep in listed:
        if moe.num_experts % ep:
            raise ValueError(f"plan.ep lists {ep}, which does not divide model.moe.num_experts={moe.num_experts}: "
                             f"drop it from plan.ep")
    return list(listed)


def cp_degrees(config: Config) -> list[int]:
    """plan.cp, each checked against the model and data.seq_len in one line (as parallel.cp is)."""
    m, seq = config.model, config.data.seq_len
    for cp in [c for c in config.plan.cp if c > 1]:
        if m.family not in ("llama", "deepseek"):
            raise ValueError(f"plan.cp lists {cp} but model={m.name} is not a Llama-family or DeepSeek model (context "
                             f"parallel splits their attention): set plan.cp=[1]")
        if seq % (2 * cp):
            raise ValueError(f"plan.cp lists {cp}, which cuts data.seq_len={seq} into {2 * cp} chunks: "
                             f"set data.seq_len to a multiple of {2 * cp} or drop {cp} from plan.cp")
    return list(config.plan.cp)
