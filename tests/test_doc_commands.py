"""Every command of the README, of docs/*.md and of the recipes' comments runs as written on this machine
(CPU), with short runs: a training command gets `trainer.max_steps` appended (a written one is
scaled down, N -> max(2, N // 50), so a resume still continues past the first run). A command
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


def shorten(cmd: str, *, keep_checkpoints: bool = True) -> str:
    """Short runs: trainer.max_steps scaled down, or appended to a training command; no final
    checkpoint (GPT-2's is 1.5 GB) unless a later command of the block resumes from it."""
    words = cmd.split()
    if words[0] not in ("pipetrain", "torchrun") or "--help" in words or any(
            w in words for w in ("mode=simulate", "mode=export", "mode=eval")):
        return cmd
    tail = "" if keep_checkpoints or "trainer.ckpt_at_end=" in cmd else " trainer.ckpt_at_end=false"
    if "trainer.max_steps=" in cmd:
        return re.sub(r"trainer\.max_steps=(\d+)",
                      lambda m: f"trainer.max_steps={m.group(1) if int(m.group(1)) <= 5 else max(2, int(m.group(1)) // 50)}",
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
        cmds, gpu = [], False
        for raw in joined.splitlines():
            cmd, _, comment = raw.partition("  #")
            cmd = " ".join(cmd.split())
            if not cmd or cmd.startswith(NOT_RUN) or cmd in RUN_ELSEWHERE:
                continue
            if "GPU" in comment:
                cases.append(Case(f"{doc}:{line}", [cmd], gpu=True))
                continue
            if "refused" in comment:
                cases.append(Case(f"{doc}:{line}", [cmd], refused=True))
                continue
            cmds.append(cmd)
        if cmds:
            cases.append(Case(f"{doc}:{line}", cmds))
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for m in re.finditer(r"`((?:pipetrain|torchrun|python -m pipetrain)\b[^`]*)`", prose):
        cmd = m.group(1)
        if cmd in ASIDES or cmd.startswith("pipetrain:") or re.search(r"\b[A-Z]{3,}\b", cmd) or " " not in cmd:
            continue  # a name, an error message, or a template (DIR, NAME)
        cases.append(Case(f"{doc}:{prose[: m.start()].count(chr(10)) + 1}", [cmd]))
    return cases


def recipe_cases() -> list[Case]:
    cases = []
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        lines = path.read_text().splitlines()
        gpu_sized = any("GPU-sized" in ln for ln in lines)
        for i, ln in enumerate(lines):
            m = re.search(r"(pipetrain \S.*)$", ln) if ln.startswith("#") else None
            if m is None:
                continue
            before = ln[: m.start()] + " ".join(lines[max(0, i - 1): i])  # the text that introduces it
            cpu = "CPU" in before or not gpu_sized
            cases.append(Case(f"recipes/{path.name}:{i + 1}", [m.group(1).strip()], gpu=not cpu))
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
    assert sum(w.endswith(".md") for w in where) >= 15 and len({w for w in where if w.startswith("docs/")}) >= 8 and len({w for w in where if w.startswith("recipes/")}) >= 4
    gpu = [c.commands[0] for c in CASES if c.gpu]
    # only the GPT-2 recipes and the multi-GPU torchrun checks are GPU-sized
    assert gpu and all("+recipe=gpt2" in c or "trainer.device=cuda" in c for c in gpu), gpu


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
            assert res.returncode == 2 and len(err) == 1 and "sbatch" in err[0], (cmd, res.stderr)  # says it needs SLURM
        elif case.refused:
            assert res.returncode != 0 and len(err) == 1 and "error" in err[0], (cmd, res.stderr)
        elif missing:
            assert res.returncode != 0 and len(err) == 1 and "error" in err[0], (cmd, res.stderr)
            assert any(p in err[0] or Path(p).name in err[0] for p in missing), (cmd, missing, err)
        else:
            assert res.returncode == 0, (cmd, res.stderr[-3000:])
            assert "Traceback" not in res.stderr, (cmd, res.stderr[-3000:])


LAPTOP_GB = 16.0  # more per rank than this, predicted by the planner, and a command must say it is GPU-sized


def _predicted_gb(cmd: str, compose) -> float | None:
    """The planner's predicted peak per rank of a training or eval command (None: nothing to size:
    not a run that builds the model, a sweep, or one that needs the user's files)."""
    from pipetrain.planner.predict import predict

    words = shlex.split(cmd)
    if words[0] != "pipetrain" or any(w.startswith("-") for w in words[1:]) or \
            any(w in words for w in ("mode=simulate", "mode=plan", "mode=export", "schedule=auto", "schedule=custom")):
        return None
    # the data's source does not change what a rank holds: sized on the built-in corpus
    overrides = [w for w in words[1:] if "=" in w and "," not in w.split("=", 1)[1]
                 and not w.startswith(("data=", "data.path="))]
    if len(overrides) != len(words) - 1 - sum(w.startswith(("data=", "data.path=")) for w in words) or \
            any("pretrained=" in w for w in overrides):
        return None
    return predict(compose(overrides))["total_gb"]


def test_a_command_bigger_than_a_laptop_says_so(compose):
    """Every unmarked command of the docs fits a laptop: the planner's own prediction per rank is at
    most LAPTOP_GB (a GPU-sized one carries the mark and is not run)."""
    sized = {c.commands[0]: _predicted_gb(c.commands[0], compose) for c in CASES if not c.gpu and not c.refused
             and len(c.commands) == 1}
    assert sum(gb is not None for gb in sized.values()) >= 8, sized  # the check sees the commands
    assert _predicted_gb("pipetrain model=llama3.1-8b data=tokens data.path=x.bin", compose) > LAPTOP_GB  # it can tell
    too_big = {cmd: round(gb, 1) for cmd, gb in sized.items() if gb is not None and gb > LAPTOP_GB}
    assert not too_big, f"mark these GPU-sized in the docs: {too_big}"


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
