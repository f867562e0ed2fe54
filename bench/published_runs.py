"""Published training runs the planner is held against (bench/planner_published.py; tests/test_planner_published.py
keeps two of them within 15%). Each row: the published figure and its citation, the model as command-line shapes or
a preset, the cluster, the published layout as plan.* overrides, and the free search for the planner's own pick.
"""

from __future__ import annotations

MEGATRON = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
            "SC'21, arXiv 2104.04473, Table 1 (achieved teraFLOP/s per GPU)")
TORCHTITAN = ("Liang et al., TorchTitan: One-stop PyTorch native solution for production ready LLM pre-training, "
              "arXiv 2410.06511; figures as pytorch/torchtitan docs/performance.md gives them for the paper's runs")

# (name, params B, heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU): Table 1's rows
_MEGATRON_ROWS = (
    ("megatron-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0),
    ("megatron-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142.0),
    ("megatron-39.1b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138.0),
    ("megatron-145.6b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    ("megatron-529.6b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163.0),
)
_MEGATRON_RUN = ["data.seq_len=2048", "plan.recompute=[true]", "plan.attention=materialized", "plan.dp_shard=false",
                 "plan.grad_overlap=0", "plan.max_microbatches=4096", "plan.time_limit_s=900"]


_UNSTATED = {True: "microbatch size 1 (Megatron-LM's scripts for its large GPT runs), v chosen by the planner",
             False: "the microbatch size chosen by the planner"}


def megatron_flops(shape: dict, *, batch: int) -> float:
    """FLOPs of one iteration as Megatron-LM's eq. 3 counts them (full recompute): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    s, l, h, v = shape["seq"], shape["layers"], shape["hidden"], shape["vocab"]
    return 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _megatron(name, params, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> dict:
    dp = gpus // (tp * pp)
    schedule = ["plan.schedules=[1f1b]"] if pp == 1 else ["plan.schedules=[interleaved_1f1b]",
                                                          "plan.virtual_stages=[2,3,4]"]
    mbs = "plan.microbatch_sizes=[1,2,4,8,16]" if pp == 1 else "plan.microbatch_sizes=[1]"
    return {
        "name": name, "source": "megatron", "citation": MEGATRON, "metric": "tflops_per_gpu", "published": tflops,
        "shape": {"params_b": params, "seq": 2048, "layers": layers, "hidden": hidden, "heads": heads,
                  "vocab": 51200},
        "model": ["model=gpt2", f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={hidden}",
                  "model.vocab_size=51200", "model.block_size=2048", "model.dropout=0.1", *_MEGATRON_RUN],
        "cluster": ["plan.device=a100-80gb", f"plan.nodes={gpus // 8}"],
        "layout": [f"plan.tp=[{tp}]", f"plan.pp=[{pp}]", f"plan.global_batch={batch}", mbs, *schedule],
        "search": ["plan.tp=[1,2,4,8]", f"plan.global_batch={batch}", "plan.microbatch_sizes=[1,2,4,8]",
                   "plan.schedules=[1f1b,interleaved_1f1b]", "plan.virtual_stages=[2,3,4]"],
        "notes": (f"published layout tp{tp} x pp{pp} x dp{dp}, batch {batch}, full recompute; Table 1 gives no "
                  f"microbatch size or interleaving degree: {_UNSTATED[pp > 1]}"),
    }


_CARRIED = ("plan.global_batch", "plan.fp8", "plan.recompute", "plan.fused_elementwise", "plan.sequence_parallel")


def _torchtitan(name, model, gpus, layout, published, note) -> dict:
    return {
        "name": name, "source": "torchtitan", "citation": TORCHTITAN, "metric": "tokens_per_s_per_gpu",
        "published": published, "shape": {}, "model": [f"model={model}", "data.seq_len=8192", "plan.grad_overlap=1",
                                                         "plan.max_microbatches=512", "plan.time_limit_s=900"],
        "cluster": ["plan.device=h100-gt", f"plan.nodes={gpus // 8}"],
        "layout": layout, "search": [*[o for o in layout if o.startswith(_CARRIED)],
                                     "plan.tp=[1,2,4,8]", "plan.dp_shard=true", "plan.microbatch_sizes=[1,2,4]",
                                     "plan.schedules=[1f1b,interleaved_1f1b]"],
        "notes": note,
    }


def _fsdp_8b(batch: int) -> list[str]:
    """torchtitan's Llama 3.1 8B layout: FSDP over every GPU, local batch 2, eager, recompute (see the notes)."""
    return ["plan.tp=[1]", "plan.pp=[1]", "plan.dp_shard=true", f"plan.global_batch={batch}",
            "plan.microbatch_sizes=[2]", "plan.recompute=[true]", "plan.schedules=[1f1b]",
            "plan.fused_elementwise=false"]


ROWS = [_megatron(*r) for r in _MEGATRON_ROWS] + [
    _torchtitan("torchtitan-8b-8gpu", "llama3.1-8b", 8, _fsdp_8b(16), 5762.0,
                "Table 1: FSDP 8, local batch 2, selective (op) activation checkpointing, bf16, no torch.compile; "
                "selective AC keeps the matmuls' outputs and recomputes a share of the rest, which the planner's "
                "per-layer recompute cannot name: costed as full recompute (without it 16k tokens of activations do "
                "not fit), an upper bound on its compute; eager element-wise ops (plan.fused_elementwise=false). On "
                "h100-gt, their 96 GB HBM2e H100s at 500 W. The compile (6,667) and Float8 (8,532) rows are left "
                "out."),
    _torchtitan("torchtitan-8b-128gpu", "llama3.1-8b", 128, _fsdp_8b(256), 5605.0,
                "Table 3: FSDP 128 across 16 hosts, local batch 2, selective AC (costed as full recompute), bf16, "
                "no compile; the compile and Float8 rows are left out."),
    _torchtitan("torchtitan-70b-256gpu", "llama3.1-70b", 256,
                ["plan.tp=[8]", "plan.pp=[1]", "plan.dp_shard=true", "plan.global_batch=512",
                 "plan.microbatch_sizes=[16]", "plan.recompute=[true]", "plan.schedules=[1f1b]", "plan.fp8=true",
                 "plan.sequence_parallel=true"],
                829.0,
                "Table 4: FSDP 32 x TP 8 (sequence parallel, as torchtitan's TP plan), local batch 16, full AC, "
                "torch.compile and Float8 (modelled: plan.fp8=true); "
                "the AsyncTP row (876) is left out (the planner keeps TP's collectives on the critical path)."),
    _torchtitan("torchtitan-405b-512gpu", "llama3.1-405b", 512,
                ["plan.tp=[8]", "plan.pp=[8]", "plan.dp_shard=true", "plan.global_batch=256",
                 "plan.microbatch_sizes=[4]", "plan.recompute=[true]", "plan.schedules=[interleaved_1f1b]",
                 "plan.virtual_stages=[2]", "plan.fp8=true", "plan.sequence_parallel=true"], 128.0,
                "Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, interleaved 1F1B, full AC, torch.compile, Float8 "
                "(modelled) and AsyncTP; 8 microbatches of 4 (torchtitan's default then: as many microbatches as "
                "pipeline stages, which their 1F1B row's 100 against interleaved's 128 bears out)."),
]
