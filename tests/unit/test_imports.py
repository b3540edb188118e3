"""Every trainlib module imports; no import cycle among them; no module imports
from a higher layer (the layers are listed in docs/architecture.md).

Imports are read from the source, function-level (lazy) ones included: a lazy
import is still a dependency, and hiding a cycle in a function body is how the
old config -> checkpoint -> convert -> config cycle went unnoticed. Importing
`a.b.c` also runs the package `a.b`'s `__init__`, so that counts as an import
of `a.b` too, unless `a.b` is a package of the importing module itself (it is
being initialised already). The root `trainlib/__init__.py` is the public
facade, at the top layer; Python runs it before any submodule, so it is not
counted as imported by them.
"""

import ast
import importlib
from fnmatch import fnmatch
from pathlib import Path

import trainlib

ROOT = Path(trainlib.__file__).parent

# Lowest first. A module may import from its own layer and the layers below.
# A module named exactly in a layer belongs to it; otherwise the first pattern
# it matches decides (so a command-line tool inside a package, like
# checkpoint.bench, can sit above its package).
LAYERS = [
    ("core: single-process parts, each usable alone",
     ["trainlib.errors", "trainlib.compat", "trainlib.guard", "trainlib.optimizer_kind", "trainlib.config.loader", "trainlib.config.cli", "trainlib.config.recipes", "trainlib.hardware", "trainlib.loss", "trainlib.distributed", "trainlib.metrics", "trainlib.profiling",
      "trainlib.resilience",
      "trainlib.optim", "trainlib.adamw", "trainlib.muon", "trainlib.precision", "trainlib.float8", "trainlib.data", "trainlib.data.*", "trainlib.models",
      "trainlib.params", "trainlib.blocks", "trainlib.blocks.*", "trainlib.models.layers", "trainlib.models.spec", "trainlib.models.roles", "trainlib.models.*.model", "trainlib.models.*.state_dict_adapter",
      # the torch-free recipe sections and model shapes (the command line is read before torch is imported)
      "trainlib.sections", "trainlib.models.lazy", "trainlib.models.*.args"]),
    ("parallel: the mesh, one module per axis, per-model parallelization",
     ["trainlib.parallel", "trainlib.parallel.*", "trainlib.models.*", "trainlib.step", "trainlib.build",
      "trainlib.validation",
      # Qwen3-MoE's model reuses Qwen3's attention: importing trainlib.models.qwen3.model runs the
      # trainlib.models.qwen3 package (its ModelSpec and parallel plan) too
      "trainlib.models.qwen3_moe.model", "trainlib.models.qwen3_moe.state_dict_adapter", "trainlib.models.qwen3_moe.args"]),
    ("checkpoint: DCP save/load of Stateful parts, HF/Meta interop",
     ["trainlib.checkpoint", "trainlib.checkpoint.*"]),
    ("job config: composes every component's config; cross-field validation",
     ["trainlib.config", "trainlib.config.*"]),
    ("entry points", ["trainlib", "trainlib.train", "trainlib.launch", "trainlib.ft", "trainlib.plan", "trainlib.plan.*", "trainlib.parity",
                      "trainlib._parity_worker",
                      "trainlib.convert", "trainlib.checkpoint.bench", "trainlib.report"]),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _layer(name: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if name in patterns:
            return i
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch(name, p) for p in patterns):
            return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS here and to docs/architecture.md")


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]  # without the root facade


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """trainlib modules that importing `name` runs."""
    is_pkg = path.name == "__init__.py"
    direct = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            direct |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            direct |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
    own = set(_ancestors(name)) | ({name} if is_pkg else set())
    deps = set()
    for d in direct:
        if d in mods:
            deps |= {d} | {a for a in _ancestors(d) if a not in own}
    return deps - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_every_module_imports():
    for name in sorted(_modules()):
        importlib.import_module(name)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    def name(m: str) -> str:
        return LAYERS[_layer(m)][0].split(":")[0]

    return [f"{m} ({name(m)}) imports {d} ({name(d)})"
            for m, deps in sorted(graph.items()) for d in sorted(deps) if _layer(d) > _layer(m)]


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_upward_import():
    bad = _upward(_graph())
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_a_lazy_upward_import_is_caught(tmp_path):
    """The old cycle: the checkpoint manager imported trainlib.convert inside a
    method, and convert imported trainlib.config, whose job.py imports the manager."""
    mods, graph = _modules(), _graph()
    fake = tmp_path / "manager.py"
    fake.write_text(mods["trainlib.checkpoint.manager"].read_text()
                    + "\n\ndef _export():\n    from trainlib.convert import main\n")
    graph["trainlib.checkpoint.manager"] = _imports("trainlib.checkpoint.manager", fake, mods)
    graph["trainlib.convert"] = graph["trainlib.convert"] | {"trainlib.config"}
    assert "trainlib.checkpoint.manager (checkpoint) imports trainlib.convert (entry points)" in _upward(graph)
    cycle = _cycle(graph)
    assert cycle and {"trainlib.checkpoint.manager", "trainlib.convert"} <= set(cycle)


def test_every_public_name_of_a_lazy_package_loads():
    """The packages load most of their names on first use (PEP 562 `__getattr__`, so that the command line
    is read before torch is imported): each name in `__all__` must resolve, and `import trainlib` alone
    must not import torch."""
    import subprocess
    import sys

    code = "import sys, trainlib, trainlib.config\nassert 'torch' not in sys.modules, 'import trainlib imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    for package in ("trainlib", "trainlib.checkpoint", "trainlib.data", "trainlib.parallel", "trainlib.plan",
                    "trainlib.models.llama3", "trainlib.models.qwen3", "trainlib.models.qwen3_moe"):
        module = importlib.import_module(package)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{package}.{name}"
    assert {"ModelParts", "JobConfig", "Transformer", "ParallelDims", "build_model_parts"} <= set(trainlib.__all__)


def test_the_parallel_axes_import_no_model_room():
    """`trainlib/parallel/` finds what it shards and routes by the classes in `trainlib.blocks` (the attention
    base, the MoE parts), one room below both: the arrows run from the families to the axes, never back."""
    graph = _graph()
    back = [f"{m} imports {d}" for m, deps in sorted(graph.items()) if m.startswith("trainlib.parallel")
            for d in sorted(deps) if d == "trainlib.models" or d.startswith("trainlib.models.")]
    assert not back, "the parallel axes import the model room:\n" + "\n".join(back)
