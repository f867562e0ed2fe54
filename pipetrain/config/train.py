"""Schemas of the training loop (`trainer.*`), the optimizer (`optim.*`) and mode=export (`export.*`).
Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

PRECISIONS = ("fp32", "bf16")  # trainer.precision; train/pipeline.py maps each to a torch dtype
RECOMPUTE = ("none", "full", "selective")  # trainer.recompute
# trainer.recompute_modules (Megatron's --recompute-modules): a layer declares which it has
# (parallel/layer_spec.py RecomputePlanned); core attention, the MLP's and the experts' activation,
# the norms, MLA's up-projections
RECOMPUTE_MODULES = ("attention", "mlp_act", "norm", "moe_act", "mla_up")


@dataclass
class TrainerConfig:
    max_steps: int = 200  # optimizer steps (the quickstart: about a minute on 2 CPU cores)
    seed: int = 1337  # model init and data order: the batch of step k is a function of (seed, k)
    log_every: int = 10  # console/metrics line every N steps (the first and last step always log)
    eval_every: int = 50  # validation loss every N steps and at the end of a longer run (0: never)
    eval_batches: int = 2  # batches of data.batch_size sequences per validation
    ckpt_every: int = 0  # checkpoint every N steps (0: only at the end when ckpt_at_end)
    ckpt_at_end: bool = True  # write a checkpoint after the last step
    # auto: the newest whole checkpoint in the run directory, if it holds one (a rerun of a run.name, a
    # requeued job; a new unnamed run's directory holds none) | never (or null): start fresh, refused where
    # the run directory already holds checkpoints | a checkpoint path (a step_* or run directory)
    resume: Optional[str] = "auto"
    on_nonfinite: str = "stop"  # stop | skip: what a NaN/inf loss does
    max_skipped_steps: int = 3  # on_nonfinite=skip: stop after this many non-finite steps in a row
    # auto: cuda when every rank on a host gets a GPU of its own, else cpu (launch/devices.py) | cpu | cuda
    device: str = "auto"
    threads_per_rank: int = 1  # torch.set_num_threads per rank (on CUDA too: the host work of every rank)
    # precision=fp32 on CUDA: true runs fp32 matmuls on TF32 tensor cores (set_float32_matmul_precision
    # ("high"): 10-bit mantissa, several times fp32's speed). Off by default, fp32 means fp32 as in
    # torch: on an H200 the GPU check's fp32 llama-tiny run with it on rose from loss 6.27 to 7.90 in
    # 20 steps (bf16 fell to 3.2; cause not isolated), so it is opt-in until measured
    tf32: bool = False
    # none | full: each layer's forward again in its backward, from its input | selective: only
    # trainer.recompute_modules inside each layer, re-run in B (W recomputes nothing)
    recompute: str = "none"
    # selective: the modules each layer recomputes (a layer without one skips it; docs/training.md)
    recompute_modules: list[str] = field(default_factory=lambda: list(RECOMPUTE_MODULES))
    activation_checkpointing: bool = False  # an alias of trainer.recompute=full, kept for existing configs
    # with recompute: the stage ids that recompute (null: every stage). The first
    # ranks of 1F1B-like schedules keep the most microbatches in flight: recomputing there alone
    # can fit the memory at less cost (mode=plan searches it with plan.recompute_partial=true)
    recompute_stages: Optional[list[int]] = None
    # fp32 | bf16. bf16: parameters, gradients and optimizer state stay fp32; stages compute under
    # bf16 autocast and the tensors crossing between stages are bf16 (half the bytes); loss and
    # reductions in fp32. On CPU too (slower there than fp32 unless the CPU has bf16 matmuls).
    precision: str = "fp32"
    # torch.compile every pipeline layer of every stage, one compiled graph per block (torchtitan's
    # per-block compile: identical blocks share one compilation). Off by default: on CPU the
    # first step pays the compilation (bench/compile_stage.py measures it).
    compile: bool = False
    # trainer.compile: the first step's point-to-point waits may last this long (a peer compiling its
    # layers is slow, not stuck; NCCL's watchdog would end it); later steps use pipeline.p2p_timeout_s
    compile_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for knob in ("max_steps", "log_every", "eval_batches", "threads_per_rank", "max_skipped_steps"):
            if getattr(self, knob) < 1:
                raise ValueError(f"trainer.{knob} must be >= 1 (got {getattr(self, knob)})")
        for knob in ("eval_every", "ckpt_every"):
            if getattr(self, knob) < 0:
                raise ValueError(f"trainer.{knob} must be >= 0 (got {getattr(self, knob)})")
        if self.compile_timeout_s <= 0:
            raise ValueError(f"trainer.compile_timeout_s must be > 0 seconds (got {self.compile_timeout_s})")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"trainer.on_nonfinite must be stop or skip (got {self.on_nonfinite!r})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"trainer.device must be auto, cpu or cuda (got {self.device!r})")
        self._check_recompute()
        if self.recompute_stages is not None:
            if self.recompute == "none":
                raise ValueError("trainer.recompute_stages names the stages that recompute: set "
                                 "trainer.recompute=full or selective too (or drop trainer.recompute_stages)")
            if (min(self.recompute_stages, default=0) < 0
                    or len(set(self.recompute_stages)) < len(self.recompute_stages)):
                raise ValueError(f"trainer.recompute_stages must list distinct stage ids >= 0 "
                                 f"(got {list(self.recompute_stages)})")
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer.precision must be {' or '.join(PRECISIONS)} (got {self.precision!r})")

    def _check_recompute(self) -> None:
        """trainer.recompute's values; activation_checkpointing=true is recompute=full, and the two agree after."""
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"trainer.recompute must be {', '.join(RECOMPUTE)} (got {self.recompute!r})")
        if self.activation_checkpointing and self.recompute == "selective":
            raise ValueError("trainer.activation_checkpointing=true is trainer.recompute=full: drop it to recompute "
                             "selectively")
        if self.activation_checkpointing:
            self.recompute = "full"
        self.activation_checkpointing = self.recompute == "full"
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown or len(set(self.recompute_modules)) < len(self.recompute_modules):
            raise ValueError(f"trainer.recompute_modules must list distinct names of {', '.join(RECOMPUTE_MODULES)} "
                             f"(got {list(self.recompute_modules)})")
        if self.recompute == "selective" and not self.recompute_modules:
            raise ValueError("trainer.recompute=selective with no trainer.recompute_modules: name some, or set "
                             "trainer.recompute=none")


# Pre-training defaults (a fresh model): peak lr, cosine floor, warm-up steps.
PRETRAIN_LR, PRETRAIN_MIN_LR, PRETRAIN_WARMUP = 3e-3, 3e-4, 5
# Fine-tune defaults (model.pretrained): the field's practice for full fine-tunes of 1-8B models (Alpaca,
# Vicuna and Zephyr's SFT recipes: lr 2e-5, warm-up 3% of the steps, cosine decay), ending at 10% of lr.
FINETUNE_LR, FINETUNE_WARMUP_SHARE, MIN_LR_SHARE = 2e-5, 0.03, 0.1
TUNED = ("lr", "min_lr", "warmup_steps")  # the knobs whose default depends on model.pretrained


@dataclass
class OptimConfig:
    """AdamW with decay / no-decay groups, linear warm-up then cosine decay to min_lr. lr, min_lr and
    warmup_steps left null get the pre-training defaults, or with model.pretrained the fine-tune ones
    (`defaults`, called once by the root schema)."""

    # peak learning rate, reached after warmup_steps; null: 3e-3, or 2e-5 with model.pretrained (a fine-tune)
    lr: Optional[float] = None
    # where the cosine decay ends, at decay_steps; null: 3e-4 (at most optim.lr), or with model.pretrained
    # 10% of optim.lr
    min_lr: Optional[float] = None
    # the step where the cosine reaches min_lr (then lr stays there). None: trainer.max_steps, as the
    # run was started: a resume with a larger trainer.max_steps keeps the checkpoint's length (set
    # this to stretch it), as Megatron keeps --lr-decay-iters apart from --train-iters
    decay_steps: Optional[int] = None
    # linear warm-up from 0 to lr over this many steps; null: 5, or with model.pretrained 3% of the run's steps
    # (at least 1)
    warmup_steps: Optional[int] = None
    weight_decay: float = 0.1  # on matrices (>= 2-D); biases, norms and embeddings' 1-D params get none
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay (0.95 as GPT-3 / nanoGPT)
    eps: float = 1e-8  # AdamW's denominator guard
    grad_clip: float = 1.0  # global gradient-norm clip over all ranks (0: off)

    def __post_init__(self) -> None:
        self.defaulted: list[str] = []  # the fine-tune defaults `defaults` applied ("optim.lr=2e-05"), for the header
        self.check()

    def check(self) -> None:
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0 (got {self.lr})")
        if self.min_lr is not None and not 0 <= self.min_lr <= (self.lr if self.lr is not None else self.min_lr):
            raise ValueError(f"optim.min_lr must be in [0, optim.lr] (got {self.min_lr}, optim.lr={self.lr})")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"optim.decay_steps must be >= 1 or null (trainer.max_steps; got {self.decay_steps})")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1 and optim.beta2 must be in [0, 1) (got {self.beta1}, {self.beta2})")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("optim.grad_clip and optim.weight_decay must be >= 0")

    def defaults(self, *, fine_tune: bool, steps: int) -> None:
        """Fill the knobs left null: the pre-training defaults, or for a fine-tune (model.pretrained) lr 2e-5,
        warm-up 3% of `steps` (at least 1) and min_lr 10% of lr, listed in `defaulted`. Once: a config
        checked again (the planner's copies) finds nothing left null and keeps its list."""
        unset = [k for k in TUNED if getattr(self, k) is None]
        if not unset:
            return
        if self.lr is None:
            self.lr = FINETUNE_LR if fine_tune else PRETRAIN_LR
        if self.min_lr is None:
            self.min_lr = MIN_LR_SHARE * self.lr if fine_tune else min(PRETRAIN_MIN_LR, self.lr)
        if self.warmup_steps is None:
            self.warmup_steps = max(1, round(FINETUNE_WARMUP_SHARE * steps)) if fine_tune else PRETRAIN_WARMUP
        if fine_tune:
            self.defaulted = [f"optim.{k}={getattr(self, k):g}" for k in unset]
        self.check()


EXPORT_DTYPES = ("fp32", "bf16")
MOE_LAYOUTS = ("per_expert", "fused")  # export.moe_layout


@dataclass
class ExportConfig:
    """mode=export: the model (trainer.resume's checkpoint, else model.pretrained, else the seeded
    initial weights) written as a Hugging Face folder that transformers' from_pretrained loads."""

    dir: Optional[str] = None  # the folder to write; null = <run directory>/hf
    max_shard_gb: float = 5.0  # largest safetensors file, in GB (10^9 bytes), as save_pretrained's max_shard_size
    dtype: str = "fp32"  # fp32 | bf16: the dtype of the written tensors (and config.json's torch_dtype)
    # MoE experts: per_expert (one 2-D tensor per expert, the hub's layout, which every transformers
    # version reads) | fused (transformers 5's experts.gate_up_proj / down_proj, 3-D)
    moe_layout: str = "per_expert"
    # true: replace a non-empty export.dir (refused otherwise: its files are the user's); never
    # a folder the export reads from (model.pretrained, the checkpoint) or the run directory
    overwrite: bool = False

    def __post_init__(self) -> None:
        if not self.max_shard_gb > 0:
            raise ValueError(f"export.max_shard_gb must be > 0 (got {self.max_shard_gb})")
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"export.dtype must be {' or '.join(EXPORT_DTYPES)} (got {self.dtype!r})")
        if self.moe_layout not in MOE_LAYOUTS:
            raise ValueError(f"export.moe_layout must be {' or '.join(MOE_LAYOUTS)} (got {self.moe_layout!r})")
