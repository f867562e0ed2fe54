"""The planner's memory model on GPUs (review F9, predicted side): the data-parallel reducer's flat
gradient copies, GradSync's copies of weights held on several ranks, and a fixed per-GPU overhead."""

from __future__ import annotations

import pytest

from pipetrain.compose import compose_config
from pipetrain.partition.costs import LayerCost
from pipetrain.planner.auto import measurable_peak_gb
from pipetrain.planner.cmd import assumptions, device, workload
from pipetrain.planner.memory import GB
from pipetrain.planner.search import _Evaluator
from pipetrain.planner.workload import Device, Workload
from pipetrain.planner.space import Candidate

pytestmark = pytest.mark.pure

PARAMS = 1_000_000  # per layer: 4 MB of fp32 gradients


def work(*, act: float = 0.0, tied: tuple = ()) -> Workload:
    """Four equal layers; `act` activation bytes per token (0: the peak is the states and copies alone)."""
    layers = [LayerCost(f"layers.{i}", 1.0, 1.0, 1.0, params=PARAMS, activation_bytes_per_token=act) for i in range(4)]
    return Workload(lambda mbs: layers, seq=1, boundary_bytes_per_token=0.0, tied=tied)


def peak(w: Workload, c: Candidate, **dev) -> list:
    row = _Evaluator(w, Device(1000.0, margin=0.0, **dev)).evaluate(c)
    assert row.feasible, row.reason
    return row.memory


@pytest.mark.parametrize("reduce_dtype, width", [("float32", 4), ("bfloat16", 2)])
def test_data_parallel_replicas_hold_the_reducers_flat_copy_of_their_stage(reduce_dtype, width):
    """runtime/grad_reduce.py flattens a stage's gradients into new reduce_dtype buffers at REDUCE_GRAD
    and keeps them to the step's end: a dp_replicate=2 rank's peak grows by its stage's gradients in
    that dtype; FSDP2 (dp_shard) reduces in its own buffers and dp=1 has no reducer."""
    one = peak(work(), Candidate("1f1b", 2, 1, 1, 4, 1))
    two = peak(work(), Candidate("1f1b", 2, 2, 1, 4, 1), reduce_dtype=reduce_dtype)
    shard = peak(work(), Candidate("1f1b", 2, 2, 1, 4, 1, dp_shard=True))
    stage_params = 2 * PARAMS
    for r in range(2):
        assert two[r].total - one[r].total == pytest.approx(stage_params * width)
        assert two[r].grad_copies == pytest.approx(stage_params * width) and one[r].grad_copies == 0
        assert shard[r].grad_copies == 0


def test_the_flat_copies_join_the_activations_still_alive_in_the_drain():
    """Issued after the stage's last weight gradient, the copy meets the other stage's activations on
    a zbv rank (stage 0's last W ends before stage 1's), not the rank's whole activation peak."""
    w = work(act=1e6)
    one, two = peak(w, Candidate("zbv", 1, 1, 2, 4, 1)), peak(w, Candidate("zbv", 1, 2, 2, 4, 1))
    assert one[0].activations == two[0].activations > 0
    assert 0 < two[0].grad_copies <= 4 * PARAMS * 4  # both stages' copies, at most


def test_tied_weights_on_two_ranks_hold_one_sync_copy():
    """GradSync.sync flattens the gradients of a tied weight's copies into one buffer that it all-reduces,
    whose part then is the gradient (runtime/sync.py): 1x its fp32 gradient on each rank holding it when
    embedding and head live on different ranks (pp=2); one temporary sum where both stages sit on one
    rank (zbv at pp=1); nothing where one stage holds both layers (one Parameter)."""
    tie = (((0, 3), PARAMS),)
    split, plain = (peak(work(tied=tie), Candidate("1f1b", 2, 1, 1, 4, 1)),
                    peak(work(), Candidate("1f1b", 2, 1, 1, 4, 1)))
    for r in range(2):
        assert split[r].total - plain[r].total == pytest.approx(PARAMS * 4)
    assert peak(work(tied=tie), Candidate("zbv", 1, 1, 2, 4, 1))[0].grad_copies == pytest.approx(PARAMS * 4)
    assert peak(work(tied=tie), Candidate("1f1b", 1, 1, 1, 4, 1))[0].grad_copies == 0


def test_a_tied_models_workload_names_its_tied_weight():
    """GPT-2's wte is held by the embedding (layer 0) and the head (the last layer)."""
    cfg = compose_config(["model=gpt2-tiny", "trainer.device=cpu"])
    (layers, numel), = workload(cfg).tied
    assert layers == (0, cfg.model.num_layers - 1) and numel == cfg.model.vocab_size * cfg.model.n_embd
    assert workload(compose_config(["model=mlp", "trainer.device=cpu"])).tied == ()


def test_a_cuda_row_carries_the_fixed_per_gpu_overhead_outside_the_allocator():
    """plan.gpu_overhead_gb (CUDA context + NCCL buffers) is in every CUDA row's predicted peak, not
    under the margin and not in what the allocator's peak is compared with; CPU rows have none."""
    c = Candidate("1f1b", 2, 1, 1, 4, 1)
    cpu, gpu = peak(work(act=1e6), c), peak(work(act=1e6), c, gpu_overhead_gb=1.5)
    for a, b in zip(cpu, gpu):
        assert b.total - a.total == pytest.approx(1.5 * GB) and b.allocated == a.allocated
    row = _Evaluator(work(act=1e6), Device(1000.0, margin=0.0, gpu_overhead_gb=1.5)).evaluate(c)
    assert measurable_peak_gb(row, allocator_peak=True) == pytest.approx(row.pred_peak_gb - 1.5)
    # a cap the CPU row fits is an OOM once the overhead is in
    need = max(m.total for m in cpu) / GB
    tight = _Evaluator(work(act=1e6), Device(need + 1.0, margin=0.0, gpu_overhead_gb=1.5)).evaluate(c)
    assert not tight.feasible and "OOM" in tight.reason


@pytest.mark.parametrize("over, want", [(["trainer.device=cuda"], 1.5), (["trainer.device=cpu"], 0.0),
                                        (["trainer.device=cuda", "plan.gpu_overhead_gb=3"], 3.0),
                                        (["trainer.device=cpu", "plan.gpu_overhead_gb=0.5"], 0.5)])
def test_gpu_overhead_follows_the_device_the_ranks_train_on(over, want):
    cfg = compose_config(["mode=plan", "model=gpt2-tiny", *over])
    assert device(cfg).gpu_overhead_gb == want
    assert (f"of which {want:g} GB fixed per GPU, plan.gpu_overhead_gb" in assumptions(cfg)) == (want > 0)


def test_gpu_overhead_must_not_be_negative():
    with pytest.raises(ValueError, match="plan.gpu_overhead_gb must be >= 0"):
        compose_config(["plan.gpu_overhead_gb=-1"])


def test_predict_costs_exactly_the_configured_run_as_the_planner_does():
    """`python -m pipetrain.planner.predict` (bench/gpu_check.py's prediction): the configured run's own
    row, its `peak_gb` what the allocator can see (the total without plan.gpu_overhead_gb)."""
    from pipetrain.planner.cmd import make_rows
    from pipetrain.planner.predict import predict

    run = ["model=gpt2-tiny", "pipeline.degree=2", "pipeline.microbatches=4", "data.batch_size=8", "schedule=zbv",
           "trainer.precision=bf16", "trainer.device=cuda"]
    got = predict(compose_config(run))
    rows, _ = make_rows(compose_config([*run, "mode=plan", "plan.pp=[2]", "plan.schedules=[zbv]",
                                        "plan.microbatch_sizes=[2]", "plan.partitions=[uniform]"]))
    (row,) = [r for r in rows if r.candidate.microbatches == 4]
    assert got["total_gb"] == pytest.approx(row.pred_peak_gb)
    assert got["peak_gb"] == pytest.approx(row.pred_peak_gb - 1.5) and got["gpu_overhead_gb"] == 1.5


def test_the_last_stages_rank_holds_the_losss_backward():
    """A causal LM's cross-entropy backward allocates the fp32 gradients of its log-softmax's output and
    input at once (8 bytes x vocab per token): on the rank of the last stage only, in what an allocator
    sees, not in a CPU run's count."""
    w = work(act=1e6)
    lm = Workload(w.layers, seq=1, boundary_bytes_per_token=0.0, loss_grad_bytes_per_token=8.0 * 1000)
    c = Candidate("1f1b", 2, 1, 1, 4, 2)
    plain, with_loss = peak(w, c), peak(lm, c)
    assert with_loss[0].total == plain[0].total
    assert with_loss[1].total - plain[1].total == pytest.approx(2 * 8.0 * 1000)  # 2 tokens a microbatch
    assert with_loss[1].counted == pytest.approx(plain[1].counted)
