"""Every command of the README, of docs/*.md and of the recipes' comments runs as written on this machine
(CPU), with short runs: a training command gets `trainer.max_steps` appended (a written one is
scaled down, N -> N // 50 and at least 1, or 2 in a block that resumes, so the resume continues past
the first run; schedule=auto's calibration runs take 2 steps). A command
the docs call GPU-sized is not run; one that needs the user's own files (a Hugging Face folder,
a token file, a corpus) must fail in one line naming the missing file; one that needs SLURM must
say so in one line. Commands run through bash, as a user pastes them, one ```bash block in one
directory and in order (later lines use what earlier ones wrote)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipetrain.planner.memory import StateBytes

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# programs as the console scripts would run them (PYTHONPATH, if set, picks the code under test)
PRELUDE = f"""
pipetrain() {{ {shlex.quote(sys.executable)} -m pipetrain.cli "$@"; }}
pipetrain-prepare() {{ {shlex.quote(sys.executable)} -m pipetrain.prepare "$@"; }}
torchrun() {{ {shlex.quote(sys.executable)} -m torch.distributed.run "$@"; }}
python() {{ {shlex.quote(sys.executable)} "$@"; }}
set -e
"""
NOT_RUN = ("pip install", "python -m pytest")  # setting up and the test suite itself
# run in full, as written, by another test
RUN_ELSEWHERE = {"pipetrain": "tests/test_train.py::test_quickstart_trains_with_a_falling_loss"}
ASIDES = {"torchrun", "pipetrain -m"}  # names in the text, not commands


@dataclass
class Case:
    where: str  # README.md:123, recipes/gpt2.yaml:9
    commands: list[str]  # run in order in one directory
    gpu: bool = False  # the docs call it GPU-sized: not run
    refused: bool = False  # the docs say it is refused: it must fail in one line, before any rank
    mark: str = ""  # the words that call it GPU-sized


def shorten(cmd: str, *, keep_checkpoints: bool = True) -> str:
    """Short runs: trainer.max_steps scaled down, or appended to a training command, and
    schedule=auto's calibration runs at their shortest; no final
    checkpoint (GPT-2's is 1.5 GB) unless a later command of the block resumes from it."""
    words = cmd.split()
    if words[0] not in ("pipetrain", "torchrun") or "--help" in words or any(
            w in words for w in ("mode=simulate", "mode=export", "mode=eval")):
        return cmd
    tail = "" if keep_checkpoints or "trainer.ckpt_at_end=" in cmd else " trainer.ckpt_at_end=false"
    if "schedule=auto" in words and "plan.calibrate_steps=" not in cmd:
        tail += " plan.calibrate_steps=2"  # its calibration runs (on CPU) shortened too: 5 steps -> 2
    if "trainer.max_steps=" in cmd:  # a block that resumes keeps 2 steps at least, so the resume continues past
        least = 2 if keep_checkpoints else 1  # the first run; otherwise one step checks the command as well as 20
        return re.sub(r"trainer\.max_steps=(\d+)",
                      lambda m: ("trainer.max_steps="
                                 f"{m.group(1) if int(m.group(1)) <= 5 else max(least, int(m.group(1)) // 50)}"),
                      cmd) + tail
    return f"{cmd} trainer.max_steps=1{tail}"


DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def doc_cases(doc: str) -> list[Case]:
    """The commands of one page: README.md or docs/<topic>.md."""
    text = (REPO / doc).read_text()
    cases = []
    for block in re.finditer(r"```bash\n(.*?)```", text, flags=re.S):
        line = text[: block.start()].count("\n") + 2
        joined = block.group(1).replace("\\\n", " ")
        cmds = []
        for raw in joined.splitlines():
            cmd, _, comment = raw.partition("  #")
            cmd = " ".join(cmd.split())
            program = re.sub(r"^(\w+=\S*\s+)+", "", cmd)  # past the variables it sets: VAR=value python -m pytest
            if not cmd or program.startswith(NOT_RUN) or cmd in RUN_ELSEWHERE:
                continue
            if "GPU" in comment:
                cases.append(Case(f"{doc}:{line}", [cmd], gpu=True, mark=comment))
                continue
            if "refused" in comment:
                cases.append(Case(f"{doc}:{line}", [cmd], refused=True))
                continue
            cmds.append(cmd)
        if cmds:
            cases.append(Case(f"{doc}:{line}", cmds))
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for m in re.finditer(r"`((?:pipetrain|torchrun|python -m pipetrain)\b[^`]*)`", prose):
        cmd = " ".join(m.group(1).split())  # a command the text wraps is one line
        if cmd in ASIDES or cmd.startswith("pipetrain:") or re.search(r"\b[A-Z]{3,}\b", cmd) or " " not in cmd:
            continue  # a name, an error message, or a template (DIR, NAME)
        cases.append(Case(f"{doc}:{prose[: m.start()].count(chr(10)) + 1}", [cmd]))
    return cases


def recipe_cases() -> list[Case]:
    cases = []
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        lines = path.read_text().splitlines()
        mark = " ".join(ln for ln in lines if "GPU-sized" in ln)
        for i, ln in enumerate(lines):
            m = re.search(r"(pipetrain \S.*)$", ln) if ln.startswith("#") else None
            if m is None:
                continue
            before = ln[: m.start()] + " ".join(lines[max(0, i - 1): i])  # the text that introduces it
            cpu = "CPU" in before or not mark
            cases.append(Case(f"recipes/{path.name}:{i + 1}", [m.group(1).strip()], gpu=not cpu, mark=mark))
    return cases


def once(cases: list[Case]) -> list[Case]:
    """A command written in two places (the README repeats a recipe's CPU check) runs once."""
    seen, out = set(), []
    for c in cases:
        key = (tuple(c.commands), c.gpu)
        if len(c.commands) == 1 and key in seen:
            continue
        seen.add(key)
        out.append(c)
    return out


CASES = once([c for doc in DOCS for c in doc_cases(doc)] + recipe_cases())


def missing_paths(cmd: str, cwd: Path) -> list[str]:
    """Paths a command names that are not there (the user's own files)."""
    out = []
    for word in shlex.split(cmd):
        value = word.split("=", 1)[1] if "=" in word and not word.startswith("-") else word
        value = os.path.expandvars(os.path.expanduser(value))
        if re.search(r"(/|\.bin$|\.jsonl$)", value) and not value.startswith(("runs/", "out/")) \
                and not (cwd / value).exists() and "." not in value.split("/")[0][:1]:
            out.append(value)
    return out


def test_the_docs_have_commands_to_check():
    where = [c.where.split(":")[0] for c in CASES]
    assert (sum(w.endswith(".md") for w in where) >= 15
            and len({w for w in where if w.startswith("docs/")}) >= 8
            and len({w for w in where if w.startswith("recipes/")}) >= 4)
    assert any(c.gpu for c in CASES)  # and each is checked: test_a_command_bigger_than_a_laptop_says_so_and_only_then


@pytest.mark.parametrize("case", [c for c in CASES if not c.gpu], ids=lambda c: c.where)
def test_command_runs_as_written(case, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.setdefault("WANDB_MODE", "offline")
    for cmd in case.commands:
        missing = missing_paths(cmd, tmp_path)
        keep = any("trainer.resume" in c for c in case.commands)
        res = subprocess.run(["bash", "-c", PRELUDE + shorten(cmd, keep_checkpoints=keep)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        err = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("USDT:")]
        no_slurm = not any(Path(p, "sbatch").exists() for p in os.environ["PATH"].split(":"))
        if cmd.startswith("pipetrain ") and "cluster=slurm" in cmd and no_slurm:
            # says it needs SLURM
            assert res.returncode == 2 and len(err) == 1 and "sbatch" in err[0], (cmd, res.stderr)
        elif case.refused:
            assert res.returncode != 0 and len(err) == 1 and "error" in err[0], (cmd, res.stderr)
        elif missing:
            assert res.returncode != 0 and len(err) == 1 and "error" in err[0], (cmd, res.stderr)
            assert any(p in err[0] or Path(p).name in err[0] for p in missing), (cmd, missing, err)
        else:
            assert res.returncode == 0, (cmd, res.stderr[-3000:])
            assert "Traceback" not in res.stderr, (cmd, res.stderr[-3000:])


LAPTOP_GB = 16.0  # more than this, predicted by the planner, and a command must say it is GPU-sized
WEIGHTS_SHARE = StateBytes().param / StateBytes().total  # what mode=eval keeps of a rank's training states
NOT_SIZED = ("mode=simulate", "mode=plan", "mode=export", "schedule=auto", "schedule=custom")
# where a rank's memory does not depend on the value: the data's source, the output, the resumed step
UNSIZED_KEYS = ("data", "data.path", "data.val_path", "data.tokenizer_dir", "hydra.run.dir", "trainer.resume",
                "data.split", "data.text_field", "data.val_split", "data.packing", "data.add_bos", "data.sources",
                "data.streaming", "data.document_mask", "data.loss_on", "data.truncate")


def _preset(folder: str) -> str:
    """The model preset a Hugging Face folder's name implies (`$HOME/hf/Llama-3.2-1B` -> llama3.2-1b):
    the planner sizes the shape, which the folder's config.json would set."""
    from pipetrain.compose import CONF_DIR

    key = lambda s: re.sub(r"[^a-z0-9.]", "", s.lower())  # noqa: E731
    presets = {key(p.stem): p.stem for p in Path(CONF_DIR, "model").glob("*.yaml")}
    name = key(Path(folder).name)
    assert name in presets, f"{folder}: no model preset has its name; name the folder after one or mark the command"
    return presets[name]


def _needed_gb(cmd: str, compose) -> tuple[float, float] | None:
    """The planner's prediction for a training or eval command: (the fullest rank's GB, the GB of one
    machine: every rank's under the local launcher, which puts them all on it). None: nothing to size
    (not a run that builds the model, a sweep, options)."""
    from pipetrain.planner.predict import predict

    words = shlex.split(cmd)
    if words[0] != "pipetrain" or any(w.startswith("-") for w in words[1:]) or any(w in words for w in NOT_SIZED):
        return None
    overrides, evaluating = [], "mode=eval" in words
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if not eq or "," in value:
            return None  # a sweep
        if key == "model.pretrained":  # its config.json sets the shape, over model=
            overrides = [o for o in overrides if not o.startswith("model=")] + [f"model={_preset(value)}"]
        elif key == "model" and any(w.startswith("model.pretrained=") for w in words):
            continue
        elif key not in UNSIZED_KEYS and word != "mode=eval":
            overrides.append(word)
    config = compose(overrides)
    got = predict(config)
    per_rank = [m["states_gb"] * WEIGHTS_SHARE if evaluating else m["total_gb"] for m in got["memory_per_rank"]]
    if config.cluster.name not in ("local", "submitit_local"):
        return max(per_rank), max(per_rank)  # one rank per machine at the least
    return max(per_rank), sum(per_rank) * (config.layout.world // len(per_rank))  # dp and tp copies of each


def _sized(compose) -> dict[str, tuple[Case, tuple[float, float]]]:
    """Every command the planner can size (those of a block too), with its case."""
    return {cmd: (c, gb) for c in CASES if not c.refused for cmd in c.commands
            for gb in [_needed_gb(cmd, compose)] if gb is not None}


def test_a_command_bigger_than_a_laptop_says_so_and_only_then(compose):
    """A training or eval command the planner predicts at more than LAPTOP_GB (on its fullest rank, or
    on one machine under the local launcher) carries the GPU-sized mark and is not run; one marked
    in a page quotes the GB the planner predicts (within 10%); a marked one that fits is a wrong mark."""
    sized = _sized(compose)
    assert len(sized) >= 12 and sum(c.gpu for c, _ in sized.values()) >= 4, sized  # the check sees the commands
    assert _needed_gb("pipetrain model=llama3.1-8b data=tokens data.path=x.bin", compose)[0] > LAPTOP_GB  # it can tell
    unmarked, wrong, misquoted = {}, {}, {}
    for cmd, (case, (rank_gb, machine_gb)) in sized.items():
        need = max(rank_gb, machine_gb)
        if need > LAPTOP_GB and not case.gpu:
            unmarked[cmd] = (round(rank_gb, 1), round(machine_gb, 1))
        elif case.gpu and need <= LAPTOP_GB:
            wrong[cmd] = (round(rank_gb, 1), round(machine_gb, 1))
        elif case.gpu and case.where.split(":")[0].endswith(".md"):
            quoted = [float(x) for x in re.findall(r"(\d+(?:\.\d+)?) GB", case.mark)]
            if not any(abs(q - gb) <= 0.1 * gb for q in quoted for gb in (rank_gb, machine_gb)):
                misquoted[cmd] = (case.mark, round(rank_gb, 1), round(machine_gb, 1))
    unchecked = [c.commands[0] for c in CASES if c.gpu and c.commands[0] not in sized
                 and "trainer.device=cuda" not in c.commands[0]]  # a mark is memory or CUDA itself
    assert not unchecked, f"GPU-sized but neither sized by the planner nor asking for CUDA: {unchecked}"
    assert not unmarked, f"mark these GPU-sized (GB per rank, per machine): {unmarked}"
    assert not wrong, f"these fit a laptop, drop their GPU-sized mark: {wrong}"
    assert not misquoted, f"these marks must quote the planner's GB (per rank or per machine): {misquoted}"


def _slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_lands():
    """README.md and docs/*.md link to each other's sections: each file exists and each #anchor is a
    heading there (a page moved or a heading renamed breaks a link silently otherwise)."""
    broken = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([\w\-]+))?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path = (REPO / doc).parent / target if target else REPO / doc
            if not path.exists():
                broken.append(f"{doc}: {target}")
            elif anchor and path.suffix == ".md":
                body = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
                if anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", body, flags=re.M)}:
                    broken.append(f"{doc}: {target}#{anchor}")
    assert not broken, broken
