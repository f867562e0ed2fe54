"""The shape of the package, checked from its source: which module imports which.

Every `import` statement counts, wherever it stands (module level, inside a function, under
`if TYPE_CHECKING:`): a lazy import is still a dependency, it only moves the cost. An edge goes
to the module named (`from pipetrain.launch.rank import run_rank` -> pipetrain.launch.rank;
`from pipetrain.launch import launch` -> pipetrain.launch, its __init__).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import assert_torch_free

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1] / "pipetrain"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_modules(path: Path, name: str, mods: set[str], text: str | None = None) -> set[str]:
    """The pipetrain modules a file imports (relative imports resolved); `text`: its source, where
    it is not the file's (a planted violation)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from a.b import c`: a.b.c where that is a module, else a.b
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    return {m for m in out if m in mods and m != name}


def import_graph() -> dict[str, set[str]]:
    """pipetrain module -> the pipetrain modules it imports."""
    mods = modules()
    return {name: imported_modules(path, name, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        for w in graph.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_no_import_circles_among_pipetrain_modules():
    assert cycles(import_graph()) == []


def third_party(path: Path) -> set[str]:
    """Top-level names of what a file imports from outside pipetrain (any import statement)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out - {"pipetrain"}


def closure(prefix: str) -> set[str]:
    """The modules under `prefix` and every pipetrain module they reach."""
    graph = import_graph()
    roots = {m for m in graph if m == prefix or m.startswith(prefix + ".")}
    return roots.union(*(reachable(graph, m) for m in roots))


@pytest.mark.parametrize("prefix", ["pipetrain.schedules", "pipetrain.config"])
def test_schedules_and_config_schemas_reach_no_torch(prefix):
    mods = modules()
    offenders = {m: sorted(third_party(mods[m]) & {"torch", "numpy"}) for m in closure(prefix)}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_runtime_depends_on_the_stage_protocol_not_on_models():
    reached = {m for m in closure("pipetrain.runtime") if m.startswith("pipetrain.models")}
    assert reached == set()


def test_config_schemas_import_nothing_of_the_runtime():
    runtime = ("runtime", "train", "launch", "loggers", "metrics", "models", "cli", "compose", "plan")
    reached = {m for m in closure("pipetrain.config") if m.split(".")[1] in runtime}
    assert reached == set()


def test_importing_the_config_loads_no_torch_and_registers_nothing():
    assert_torch_free(
        "from omegaconf import OmegaConf\n"
        "import pipetrain.config, pipetrain.config.cluster\n"
        "assert not OmegaConf.has_resolver('pipetrain.now'), 'a resolver was registered at import'\n"
        "from pipetrain.compose import register_all\n"
        "register_all()\n"
        "assert OmegaConf.has_resolver('pipetrain.now')\n"
    )


def test_stage_module_is_a_stage():
    """models/split.py's StageModule satisfies the protocol the executor can depend on."""
    from pipetrain.models.factory import build_model
    from pipetrain.models.split import split_model
    from pipetrain.runtime.stage_protocol import Stage

    first, last = split_model(build_model("mlp", n_layer=4), [range(0, 2), range(2, 4)])
    assert isinstance(first, Stage) and isinstance(last, Stage)
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False, True)


def test_parallel_imports_nothing_of_models():
    """The model families declare their tensor-parallel plans (parallel/layer_spec.py, imported
    downward by models/); parallel/ applies them without knowing a model class."""
    reached = {m for m in closure("pipetrain.parallel") if m.startswith("pipetrain.models")}
    assert reached == set()


def stage_attributes() -> set[str]:
    """What runtime/stage_protocol.py declares a stage carries, read from its source."""
    tree = ast.parse((ROOT / "runtime" / "stage_protocol.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Stage")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_no_stage_attribute_is_read_around_the_contract():
    """runtime/, parallel/ and train/ read a stage's attributes directly: a `getattr(x, "name", default)`
    or `hasattr(x, "name")` of a name a stage carries (declared or one a stage once had bolted on)
    would let an undeclared attribute travel again (the assembly review's six)."""
    names = stage_attributes() | {"fused_backward", "compiled", "tp", "dp"}
    assert {"tied", "layers", "tp_shards", "tp_partial", "checkpoint_layers"} <= names
    found = []
    for pkg in ("runtime", "parallel", "train"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert found == []


TRAIN_DOORS = {"pipetrain.parallel.mesh", "pipetrain.parallel.timeouts", "pipetrain.parallel.parallelize"}


def train_reaches_parallel(sources: dict[str, str]) -> dict[str, set[str]]:
    """train/ module -> the parallel/ modules its source imports outside the three doors."""
    mods = set(modules())
    out = {}
    for name, text in sources.items():
        path = ROOT / (name.removeprefix("pipetrain.").replace(".", "/") + ".py")
        bad = {m for m in imported_modules(path, name, mods, text)
               if m.startswith("pipetrain.parallel") and m not in TRAIN_DOORS}
        if bad:
            out[name] = bad
    return out


def test_train_reaches_parallel_through_three_doors():
    """#45: a rank's parallel setup is built in one place (parallel/parallelize.py: Parallelize.build,
    local_batch, split_weights, take_stats); train/ names no single parallelism and imports parallel/
    only through mesh (groups), timeouts (bounded waits) and parallelize. A planted train module that
    imports parallel/cp.py directly, as the trainer did before, is caught."""
    sources = {name: path.read_text() for name, path in modules().items() if name.startswith("pipetrain.train")}
    assert train_reaches_parallel(sources) == {}
    planted = {"pipetrain.train.planted": "from pipetrain.parallel.cp import local_positions\n"}
    assert train_reaches_parallel(planted) == {"pipetrain.train.planted": {"pipetrain.parallel.cp"}}


# The doors to private APIs: pipetrain/compat.py (torch) and pipetrain/compat_hydra.py (Hydra,
# OmegaConf; torch-free, as composing a config must be). Each function there says what it wraps and why.
def arrows_up(below: str, above: str) -> list[str]:
    """Imports of pipetrain.`above` by the modules of pipetrain.`below`."""
    graph = import_graph()
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if m == f"pipetrain.{below}"
                  or m.startswith(f"pipetrain.{below}.") for t in targets if t.split(".")[:2] == ["pipetrain", above])


def test_runtime_imports_nothing_of_parallel():
    """runtime/ stands below parallel/ (parallel/ builds on runtime/ep_comm.py, sync.py, the stage
    protocol): what runtime/ needs of the layout it is given (comm.name_ranks takes Layout.rank_name)."""
    mods = set(modules())
    planted = "from pipetrain.parallel.layout import DIMS, Layout\nfrom ..parallel import tp\n"
    assert imported_modules(ROOT / "runtime" / "comm.py", "pipetrain.runtime.comm", mods, planted) == {
        "pipetrain.parallel.layout", "pipetrain.parallel.tp"}
    assert arrows_up("runtime", "parallel") == []


def layout_reads(source: str) -> list[str]:
    """Reads of a rank's coordinates: `DIMS` and `.coords(...)` calls."""
    return [f"{n.lineno} {'DIMS' if isinstance(n, ast.Name) else '.coords()'}" for n in ast.walk(ast.parse(source))
            if (isinstance(n, ast.Name) and n.id == "DIMS")
            or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "coords")]


def test_only_parallel_reads_a_ranks_coordinates():
    """A rank's place in the layout is asked of the Layout (rank_name, pp_rank, dp_index, ...): the
    rank name was built twice from coords and DIMS (runtime/comm.py, launch/errors.py)."""
    planted = "c = layout.coords(g)\nnames = [d for d in DIMS]\n"
    assert layout_reads(planted) == ["1 .coords()", "2 DIMS"]
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in sorted(ROOT.rglob("*.py"))
             if p.parent.name != "parallel" for hit in layout_reads(p.read_text())]
    assert found == []
