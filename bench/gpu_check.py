"""The one-GPU check (issue 24): the `gpu` test tier, then a bf16 throughput run of Llama 3.2 1B.

Run through bench/gpu_check.sh (which installs what is missing first). On one GPU:

1. versions: torch, CUDA, NCCL, the GPU;
2. `python -m pytest -m gpu tests/test_gpu.py` (CUDA is visible to that tier only);
3. `model=llama3.2-1b pipeline.degree=1 schedule=zbv trainer.precision=bf16`: one rank holding two
   stages (zbv's V: local hand-off, split B and W), synthetic tokens, 8 microbatches of 4 x 2,048
   tokens (and with `--compile` also trainer.compile=true); per run tokens/s and MFU (summary.json,
   the median step after warm-up), the allocator's peak (max_memory_allocated, and
   max_memory_reserved beside it) and the planner's predicted peak for the same config
   (`python -m pipetrain.planner.predict ... partition=profile`: the layers' saved bytes measured on
   this GPU; without plan.gpu_overhead_gb, which the allocator does not see), with their ratio.
   Targets (issue 24): MFU >= 0.40 on an H100/H200 in bf16; allocator peak within 10% of the prediction.
4. issue #29's interleaver on one GPU: `python bench/moe_fb_overlap.py --single` (DualPipe-V F&B pairs of
   MoE stages node by node, each all-to-all a one-rank NCCL all-to-all of the same bytes on the
   communication stream plus an emulated network time): the share of the pairs' all-to-all time hidden
   under compute (target >= 0.8) and the host syncs inside the pairs besides the planned one per dispatch
   (target 0), with losses of the interleaved and serial rows side by side (`fb_overlap`).

`--cpu` is the dry run of all of it on this machine: the gpu tier with PIPETRAIN_GPU_DRYRUN=1 (its
tests run on the CPU where that means anything) and the same runs with model=llama-tiny, short
sequences and few steps, so a mistake in the check itself shows before GPU time is spent.

Writes bench/results/gpu_check.json (or --out) after each part, so a run stopped at a time limit
keeps what it measured: every field above, the commands that produced them (as a user types them),
the machine, and probes of what torch does here for the review's findings F4, F5 and F11 (evidence,
not tests). Paths in it are relative to the repo.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

GPU_RUN = ["model=llama3.2-1b", "data=synthetic", "data.seq_len=2048", "data.batch_size=32",
           "pipeline.degree=1", "pipeline.microbatches=8", "schedule=zbv", "trainer.precision=bf16",
           "trainer.device=cuda", "trainer.max_steps=8", "trainer.log_every=4"]
CPU_RUN = ["model=llama-tiny", "data=synthetic", "data.seq_len=64", "data.batch_size=8",
           "pipeline.degree=1", "pipeline.microbatches=4", "schedule=zbv", "trainer.precision=bf16",
           "trainer.device=cpu", "trainer.max_steps=4", "trainer.log_every=2"]
COMMON = ["trainer.eval_every=0", "trainer.ckpt_at_end=false", "logger=[console,jsonl]"]


def sh(cmd: list[str], *, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out.update(gpu=torch.cuda.get_device_name(0), nccl=".".join(map(str, torch.cuda.nccl.version())),
                   gpu_memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1))
    return out


def gpu_tier(cpu: bool, work: Path) -> dict:
    env = {"PIPETRAIN_GPU_DRYRUN": "1"} if cpu else {}
    # -v, written as it goes (PIPETRAIN_GPU_LOG): a check stopped at a time limit still shows each test's outcome
    log = Path(os.environ.get("PIPETRAIN_GPU_LOG", work / "gpu_tier.log"))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rfE", "-m", "gpu", "-n", "0",
                             "-p", "no:cacheprovider", "tests/test_gpu.py"],
                            cwd=REPO, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                            timeout=480).returncode
    tail = log.read_text().strip().splitlines()
    print("\n".join(tail[-25:]), flush=True)
    return {"command": "python -m pytest -q -m gpu tests/test_gpu.py" + (" (PIPETRAIN_GPU_DRYRUN=1)" if cpu else ""),
            "returncode": rc, "result": tail[-1] if tail else "", "seconds": round(time.perf_counter() - t0, 1),
            "passed": [ln.split(" ")[0] for ln in tail if " PASSED" in ln],
            "failures": [line for line in tail if line.startswith(("FAILED", "ERROR"))]}


def predicted_peak_gb(args: list[str], work: Path) -> float | None:
    """The planner's memory model for exactly this config (pipetrain/planner/predict.py)."""
    res = sh([sys.executable, "-m", "pipetrain.planner.predict", *args], timeout=300)
    if res.returncode:
        print(res.stderr[-1500:], flush=True)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_gb"]


def train(args: list[str], name: str, work: Path) -> dict:
    run_dir = work / name
    cmd = ["pipetrain", *args, *COMMON, f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    res = sh([sys.executable, "-m", "pipetrain.cli", *cmd[1:]], env={"WANDB_MODE": "offline"}, timeout=420)
    out = {"command": " ".join(a for a in cmd if not a.startswith("hydra.run.dir")), "returncode": res.returncode,
           "seconds": round(time.perf_counter() - t0, 1)}
    print(f"{name}: rc {res.returncode} in {out['seconds']} s", flush=True)
    if res.returncode:
        out["error"] = res.stderr.strip().splitlines()[-5:]
        print(res.stderr[-3000:], flush=True)
        return out
    s = json.loads((run_dir / "summary.json").read_text())
    peak = s.get("memory/peak_gb")
    out.update(tokens_per_s=s.get("perf/tokens_per_s"), step_time_s=s.get("perf/step_time_s"), mfu=s.get("perf/mfu"),
               peak_allocated_gb=peak, peak_reserved_gb=s.get("memory/peak_reserved_gb"),
               first_loss=s.get("train/first_loss"), loss=s.get("train/loss"))
    pred = predicted_peak_gb([*args, "partition=profile"], work)
    out["predicted_peak_gb"] = pred
    if pred and peak:
        out["peak_over_predicted"] = round(peak / pred - 1, 4)
    print(json.dumps(out), flush=True)
    return out


# ---- probes: what torch and NCCL do on this machine, for the review's findings (evidence, not tests) ----
PROBES = {
    # F5: does Work.wait(timeout) block the host behind queued GPU work, and wait() not?
    "F5_wait_timeout_blocks_host": """
import datetime, json, time, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.ones(1, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); torch.cuda._sleep(1_000_000); e.record(); e.synchronize(); per_ms = 1_000_000 / s.elapsed_time(e)
out = {}
for name, kw in (("wait_timeout", {"timeout": datetime.timedelta(seconds=60)}), ("wait", {})):
    torch.cuda._sleep(int(300 * per_ms)); work = dist.all_reduce(x, async_op=True)
    t0 = time.perf_counter(); work.wait(**kw); out[name + "_host_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    torch.cuda.synchronize()
dist.destroy_process_group(); print(json.dumps(out))
""",
    # F11: fused AdamW given a CPU step for one parameter (the old TP-resume state)
    "F11_fused_adamw_cpu_step": """
import json, torch
torch.manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(8, device="cuda")) for _ in range(2)]
ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
out = {}
for params, cpu_step in ((ps, True), (ref, False)):
    opt = torch.optim.AdamW(params, fused=True)
    for p in params: p.grad = torch.ones_like(p)
    opt.step()
    if cpu_step: opt.state[params[0]]["step"] = torch.tensor(1.0)
    try:
        opt.step(); torch.cuda.synchronize(); out["cpu_step" if cpu_step else "ref"] = "ran"
    except Exception as err:
        out["cpu_step" if cpu_step else "ref"] = f"raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
if out.get("cpu_step") == "ran": out["same_update"] = all(torch.equal(a, b) for a, b in zip(ps, ref))
print(json.dumps(out))
""",
    # F4: gloo with CUDA tensors, two processes on one GPU: all_reduce and send/recv
    "F4_gloo_cuda_tensors": """
import json, os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    x = torch.full((4,), float(rank + 1), device="cuda")
    try: dist.all_reduce(x); out["all_reduce"] = x.tolist()
    except Exception as err: out["all_reduce"] = f"raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    try:
        if rank == 0: dist.send(torch.arange(4.0, device="cuda"), 1); out["send"] = "ok"
        else:
            y = torch.zeros(4, device="cuda"); dist.recv(y, 0); out["recv"] = y.tolist()
    except Exception as err: out["p2p"] = f"raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    q.put((rank, out)); dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, port, q)) for r in range(2)]
    [p.start() for p in procs]; [p.join(120) for p in procs]
    got = {}
    while not q.empty(): r, o = q.get(); got[f"rank{r}"] = o
    got["exitcodes"] = [p.exitcode for p in procs]; print(json.dumps(got))
""",
}


def probes(work: Path) -> dict:
    out = {}
    for name, code in PROBES.items():
        path = work / f"{name}.py"
        path.write_text(code)
        try:
            res = sh([sys.executable, str(path)], timeout=150)
            last = res.stdout.strip().splitlines()[-1:] or [""]
            try:
                out[name] = json.loads(last[0])
            except ValueError:
                out[name] = {"returncode": res.returncode, "stderr": res.stderr.strip().splitlines()[-3:]}
        except subprocess.TimeoutExpired:
            out[name] = {"timed_out": True}
        print(name, json.dumps(out[name]), flush=True)
    return out


def fb_overlap(work: Path) -> dict:
    """Issue #29's one-GPU check: bench/moe_fb_overlap.py --single (the F&B interleaver, its all-to-alls NCCL
    copies of the same bytes on the communication stream plus an emulated network time; the overlap ratio
    from CUDA events and the host syncs inside the pairs). On the CPU dry run the same code on gloo."""
    out = work / "moe_fb_overlap_single.json"
    cmd = [sys.executable, "bench/moe_fb_overlap.py", "--single", "--out", str(out)]
    t0 = time.perf_counter()
    proc = sh(cmd, timeout=900)
    res: dict = {"command": "python bench/moe_fb_overlap.py --single", "returncode": proc.returncode,
                 "seconds": round(time.perf_counter() - t0, 1), "tail": proc.stdout[-1500:] + proc.stderr[-1500:]}
    if out.exists():
        doc = json.loads(out.read_text())
        lay = doc["layouts"]["pp1"]
        res.update(device=lay["device"], config=doc["config"], checks=lay["checks"],
                   rows={k: {f: v for f, v in r.items() if f != "step_ms_rounds"} for k, r in lay["rows"].items()})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (llama-tiny, the gpu tier dry-run)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_check.json"))
    ap.add_argument("--skip-tests", action="store_true", help="only the throughput runs")
    ap.add_argument("--compile", action="store_true", help="also the throughput run with trainer.compile=true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pipetrain-gpu-check-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"mode": "cpu dry run" if args.cpu else "gpu", "versions": versions(), "runs": {}}

    def write() -> None:  # after every part: a run stopped at a time limit keeps what it measured
        done = [r for r in result["runs"].values() if r.get("mfu") is not None]
        best = max(done, key=lambda r: r["mfu"], default=None)
        checks = result.get("fb_overlap", {}).get("checks", {})
        result["targets"] = {
            "mfu_at_least_0.40": None if best is None else best["mfu"] >= 0.40,
            "peak_within_10pct_of_prediction": None if best is None or "peak_over_predicted" not in best
            else abs(best["peak_over_predicted"]) <= 0.10,
            # issue #29: the interleaver on one GPU (CUDA only: the dry run's gloo waits block the host)
            "fb_overlap_ratio_at_least_0.8": None if args.cpu or "a2a_overlap_on" not in checks
            else checks["a2a_overlap_on"] >= 0.8,
            "fb_overlap_no_unplanned_host_sync": None if "unplanned_host_syncs" not in checks
            else checks["unplanned_host_syncs"] == 0,
        }
        out.write_text(json.dumps(result, indent=2) + "\n")

    print(json.dumps(result["versions"]), flush=True)
    if not args.cpu and not result["versions"]["cuda_available"]:
        raise SystemExit("no CUDA device is visible: run bench/gpu_check.sh --cpu for the dry run")
    run = CPU_RUN if args.cpu else GPU_RUN
    result["runs"]["eager"] = train(run, "eager", work)
    write()
    result["fb_overlap"] = fb_overlap(work)
    print(f"fb_overlap: rc {result['fb_overlap']['returncode']}, "
          f"checks {json.dumps(result['fb_overlap'].get('checks'))}", flush=True)
    write()
    if args.compile:
        result["runs"]["compiled"] = train(run + ["trainer.compile=true"], "compiled", work)
        write()
    if not args.skip_tests:
        result["gpu_tier"] = gpu_tier(args.cpu, work)
        write()
    if not args.cpu:
        result["probes"] = probes(work)
        write()
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}", flush=True)
    failed = [r for r in [*result["runs"].values(), result["fb_overlap"]] if r["returncode"]]
    if failed or (not args.skip_tests and result["gpu_tier"]["returncode"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
