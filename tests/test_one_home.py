"""One home per concept (issue #45), checked from the source: private APIs only through the doors,
declared capabilities read without getattr, no helper written twice, every module named in
docs/architecture.md, no class swapped at run time, the layer contract read with isinstance, the
executor reaching node mode through one interface, an MoE layer composed once. Each rule also
catches a planted violation. The import-graph rules are tests/test_architecture.py's.
"""

from __future__ import annotations

import ast
import functools

import pytest

from test_architecture import ROOT, imported_modules, modules

pytestmark = pytest.mark.pure


DOORS = {"compat.py", "compat_hydra.py"}
PRIVATE_OWNERS = {"torch", "omegaconf", "hydra"}
# underscore names the standard library documents as public: namedtuple's methods, os._exit
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_field_defaults", "_make", "_exit"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def names_pipetrain_defines(trees: list[ast.AST]) -> set[str]:
    """Every name pipetrain binds: functions, classes, arguments, variables and attributes it assigns."""
    out: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
    return out


def private_api_uses(tree: ast.AST, defined: set[str] | frozenset[str]) -> list[tuple[int, str]]:
    """(line, what) for each private torch / OmegaConf / Hydra API a module reaches, read from its source:
    - an import of a private module or name of theirs (`from hydra._internal... import`, `import torch._C`,
      `from torch.x import _y`);
    - an underscore attribute of a name bound to one of their modules or objects by an import
      (`torch._foreach_mul_`, `dist._x`, `Variable._execution_engine`, `OmegaConf._y`);
    - an underscore attribute, or a getattr/hasattr/setattr of an underscore string, on any other object
      but self/cls, of a name pipetrain defines nowhere (`t._base`, `node._get_node(...)`): such a name can
      only be a library's, and the libraries pipetrain reaches into are these three.
    The receiver's type is unknown to `ast`; a name built at run time (a `dir()` scan) is not seen."""
    owned: set[str] = set()  # names this module binds to torch / omegaconf / hydra by import
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in PRIVATE_OWNERS:
                    owned.add(a.asname or parts[0])
                    if any(map(_private, parts)):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] in PRIVATE_OWNERS:
                owned.update(a.asname or a.name for a in node.names)
                if any(map(_private, parts)) or any(_private(a.name) for a in node.names):
                    found.append((node.lineno, ast.unparse(node)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            name = root.id if isinstance(root, ast.Name) else None
            if name in owned or (name not in ("self", "cls") and node.attr not in defined | PUBLIC_UNDERSCORE):
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in defined
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


@functools.cache
def pipetrain_names() -> frozenset[str]:
    return frozenset(names_pipetrain_defines([ast.parse(p.read_text()) for p in sorted(ROOT.rglob("*.py"))]))


def private_api_leaks() -> list[str]:
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(ROOT.rglob("*.py"))}
    defined = pipetrain_names()
    return [f"{path.relative_to(ROOT.parent)}:{line} {what}"
            for path, tree in trees.items() if path.relative_to(ROOT).as_posix() not in DOORS
            for line, what in private_api_uses(tree, defined)]


def test_private_torch_omegaconf_and_hydra_apis_only_through_the_doors():
    """A private API outside compat.py / compat_hydra.py goes into a named, documented function there."""
    assert private_api_leaks() == []


PLANTED = [
    ("import torch\ntorch._foreach_mul_(xs, 2.0)\n", "torch._foreach_mul_"),
    ("import torch.distributed as dist\ndist.distributed_c10d._set_pg_timeout(t, g)\n", "_set_pg_timeout"),
    ("from torch.autograd import Variable\nVariable._execution_engine.run_backward()\n", "_execution_engine"),
    ("def f(t):\n    return t._base\n", "t._base"),
    ("def f(t):\n    return t.grad_fn._raw_saved_self\n", "_raw_saved_self"),
    ("def f(cfg):\n    return cfg._get_node('a')._is_missing()\n", "_is_missing"),
    ("def f(node):\n    return getattr(node, '_raw_saved_other')\n", "getattr(node, '_raw_saved_other')"),
    ("def f():\n    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper\n", "hydra._internal"),
    ("import torch._C\n", "import torch._C"),
    ("from torch.distributed.distributed_c10d import _set_pg_timeout\n", "import _set_pg_timeout"),
    ("from omegaconf import OmegaConf\nOmegaConf._x()\n", "OmegaConf._x"),
]


@pytest.mark.parametrize("text, what", PLANTED, ids=[w for _, w in PLANTED])
def test_a_planted_private_api_use_is_caught(text, what):
    found = private_api_uses(ast.parse(text), pipetrain_names())
    assert [line for line, w in found if what in w], (text, found)


def test_pipetrains_own_underscore_names_are_not_flagged():
    text = ("import os\nclass A:\n    def __init__(self):\n        self._seen = 1\n"
            "def f(a, p, t):\n    os._exit(0)\n    return a._seen, p._replace(x=1), t.__class__\n")
    assert private_api_uses(ast.parse(text), names_pipetrain_defines([ast.parse(text)])) == []


# ---- one home per concept (issue 45): each rule is a checker over source text, run on the package
# and on a planted violation, so a checker that silently finds nothing fails too.

def reflective_reads(source: str, names: set[str]) -> list[str]:
    """`getattr(x, "name", ...)` / `hasattr(x, "name")` calls of a constant name in `names`."""
    return [f"{n.lineno} {n.func.id}(..., {n.args[1].value!r})" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
            and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value in names]


def model_config_declares() -> set[str]:
    """The properties config/models.py's ModelConfig declares: what every model config answers."""
    tree = ast.parse((ROOT / "config" / "models.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)}


def test_model_configs_declare_what_is_read_of_them():
    from pipetrain.config.llama import LlamaModelConfig
    from pipetrain.config.models import GPT2ModelConfig, MLPModelConfig, SleepModelConfig

    assert {"hidden_size", "vocab_size", "pretrained", "num_layers"} <= model_config_declares()
    widths = {type(c).__name__: (c.hidden_size, c.vocab_size, c.pretrained) for c in (
        SleepModelConfig(hidden=7), MLPModelConfig(d_hidden=8), GPT2ModelConfig(n_embd=24, n_head=2, vocab_size=50),
        LlamaModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=60))}
    assert widths == {"SleepModelConfig": (7, None, None), "MLPModelConfig": (8, None, None),
                      "GPT2ModelConfig": (24, 50, None), "LlamaModelConfig": (32, 60, None)}


def test_no_declared_model_attribute_is_read_by_getattr():
    """What ModelConfig declares is read as an attribute: a getattr with a default would hide a family
    that forgot it, or a renamed knob, behind a silent 0 or None (the 13 duck-typed reads of issue 45)."""
    names = model_config_declares()
    assert reflective_reads('w = getattr(config.model, "vocab_size", 0)\nhasattr(m, "hidden_size")', names) == [
        "1 getattr(..., 'vocab_size')", "2 hasattr(..., 'hidden_size')"]
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in sorted(ROOT.rglob("*.py"))
             for hit in reflective_reads(p.read_text(), names)]
    assert found == []


def function_bodies(source: str, where: str) -> dict[str, list[str]]:
    """Body (docstring dropped, ast.dump) -> where it is defined, for functions of two or more statements."""
    out: dict[str, list[str]] = {}
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = n.body[1:] if ast.get_docstring(n) is not None else n.body
            if sum(isinstance(s, ast.stmt) for b in body for s in ast.walk(b)) >= 2:
                out.setdefault(ast.dump(ast.Module(body=body, type_ignores=[])), []).append(
                    f"{where}:{n.lineno} {n.name}")
    return out


def written_twice(sources: dict[str, str]) -> list[list[str]]:
    seen: dict[str, list[str]] = {}
    for where, source in sources.items():
        for body, defs in function_bodies(source, where).items():
            seen.setdefault(body, []).extend(defs)
    return [defs for defs in seen.values() if len(defs) > 1]


def test_no_function_body_is_written_twice():
    """One home per helper: `_dtensor_type` was written in runtime/sync.py and parallel/split_weights.py."""
    helper = ('def _dtensor_type():\n    """{}"""\n    module = sys.modules.get("torch.distributed.tensor")\n'
              '    return None if module is None else module.DTensor\n')
    planted = {"a.py": helper.format("one"), "b.py": "x = 1\n\n" + helper.format("two")}
    assert written_twice(planted) == [["a.py:1 _dtensor_type", "b.py:3 _dtensor_type"]]
    assert written_twice({str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}) == []


def test_the_architecture_doc_names_every_module():
    """#45: docs/architecture.md's layout names each module's job; a module added without a line
    there fails here (its file name must appear in its folder's paragraph of the layout)."""
    import re

    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    layout = doc.split("## Layout\n\n```\n", 1)[1].split("```", 1)[0]
    paragraphs = re.split(r"\n(?=\S)", layout)  # one per folder: it starts at column 0
    by_folder = {para.split()[0].rstrip("/"): para for para in paragraphs if para.strip()}
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__init__.py" or "corpus" in path.parts:
            continue
        folder = str(path.parent.relative_to(ROOT.parent))
        if not re.search(rf"\b{re.escape(path.name)}\b", by_folder.get(folder, "")):
            missing.append(str(path.relative_to(ROOT.parent)))
    assert missing == [], missing


def class_swaps(tree: ast.AST) -> list[int]:
    """Lines where a module's class is replaced at run time (`obj.__class__ = ...`)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets)]


def test_no_class_is_swapped_at_run_time():
    """#45: expert parallel made a stacked-experts module dispatch and combine by swapping its class
    for a subclass, which node execution then probed with getattr(ex, "ep_group"). The experts now
    declare their group (models/moe.py Experts.ep_group) and keep their class. A planted swap is caught."""
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(ROOT.rglob("*.py"))
             for line in class_swaps(ast.parse(path.read_text()))]
    assert found == []
    assert class_swaps(ast.parse("m.__class__ = type('X', (Mixin, type(m)), {})\n")) == [1]


def layer_contract() -> set[str]:
    """The methods parallel/layer_spec.py's protocols declare (what a layer offers), and BlockRule's."""
    tree = ast.parse((ROOT / "parallel" / "layer_spec.py").read_text())
    methods = {f.name for c in tree.body if isinstance(c, ast.ClassDef) and c.name.endswith("Planned")
               for f in c.body if isinstance(f, ast.FunctionDef)}
    return methods | {"init_block"}


def test_the_layer_contract_is_read_with_isinstance_not_getattr():
    """#45: what a layer offers to tp, ep, cp and node-level execution is declared in one pure file
    (parallel/layer_spec.py) and read with isinstance of its protocols; `getattr(layer, "nodes", None)`
    (models/split.py) and `hasattr(rule, "init_block")` (models/init.py) hid a misspelt method as a
    silent fallback. A planted read is caught."""
    names = layer_contract()
    assert {"tp_plan", "ep_plan", "cp_plan", "nodes"} <= names
    assert reflective_reads('n = getattr(layer, "nodes", None)\n', names) == ["1 getattr(..., 'nodes')"]
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in sorted(ROOT.rglob("*.py"))
             for hit in reflective_reads(p.read_text(), names)]
    assert found == []


# node-by-node execution: the executor reaches it only through runtime/stage_passes.py's interface
NODE_MODE = {"pipetrain.runtime.nodes"}


def node_mode_in_executor(text: str) -> list[str]:
    """What of node mode the executor reaches past the StagePasses interface: imports of runtime/nodes.py
    (NodeForward, NodeBackward) and of overlap.py beyond `stage_passes`, the one constructor."""
    path = ROOT / "runtime" / "executor.py"
    found = sorted(imported_modules(path, "pipetrain.runtime.executor", set(modules()), text) & NODE_MODE)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module == "pipetrain.runtime.overlap":
            found += [f"overlap.{a.name}" for a in node.names if a.name != "stage_passes"]
    return found


def test_the_executor_runs_every_pass_through_one_interface():
    """#45: the executor held three ways of running a stage (whole, node by node, an interleaved F&B
    pair) behind two flags. It now calls runtime/stage_passes.py's StagePasses (forward, backward, pair);
    node mode is runtime/overlap.py's NodeExecution. executor.py stays under 300 lines, every file under
    400. A planted import of node mode and a planted long file are caught."""
    executor = (ROOT / "runtime" / "executor.py").read_text()
    assert node_mode_in_executor(executor) == []
    planted = executor + ("\nfrom pipetrain.runtime.nodes import NodeForward\n"
                          "from pipetrain.runtime.overlap import fb_order\n")
    assert node_mode_in_executor(planted) == ["pipetrain.runtime.nodes", "overlap.fb_order"]
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sorted(ROOT.rglob("*.py"))}
    assert lines["runtime/executor.py"] < 300
    assert [f for f, n in lines.items() if n > 400] == []


EP_PHASES = {"exchange", "expert_major", "source_major", "all_to_all"}  # runtime/ep_comm.py's MoE phase pieces


def ep_phase_uses(text: str) -> set[str]:
    """The runtime/ep_comm.py phase functions a module's source imports or calls as `ep_comm.<name>`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module == "pipetrain.runtime.ep_comm":
            found |= {a.name for a in node.names} & EP_PHASES
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ep_comm"
              and node.attr in EP_PHASES):
            found.add(node.attr)
    return found


def test_an_moe_layer_is_composed_once():
    """#45: dispatch -> experts -> combine was written twice, in Experts.forward (ep_comm.dispatch and
    combine) and in node execution's closures (models/moe_nodes.py). It is composed in models/moe.py
    (MoE.phases) alone, which whole stages and nodes both run: no other module uses ep_comm's pieces of
    it (node execution's async `start` is not one). A planted use is caught."""
    users = sorted(name for name, path in modules().items()
                   if name != "pipetrain.runtime.ep_comm" and ep_phase_uses(path.read_text()))
    assert users == ["pipetrain.models.moe"]
    assert ep_phase_uses("from pipetrain.runtime.ep_comm import exchange, start\n") == {"exchange"}
    assert ep_phase_uses("y = ep_comm.source_major(x, r)\n") == {"source_major"}
