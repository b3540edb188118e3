"""The model contract (trainlib/models/spec.py): generic code names no family and no family's module.

Read from the code, not from a list: the families are the registry's, and the
module names are every submodule name of each family's model (its debug
flavor, built on the meta device), less what the contract itself names
(`layers`, and `moe`, the [moe] section and MoE args field). The generic modules' code (identifiers, attribute accesses,
imports, string constants; docstrings and comments are prose and not read)
must not mention any of them. Then a second family runs through the whole
runtime: Qwen3 trains, checkpoints, converts and parallelizes by its spec alone.
"""

import ast
import re
from pathlib import Path

import torch

import trainlib
from trainlib.models.roles import PARAM_ROLES
from trainlib.models.registry import MODELS

ROOT = Path(trainlib.__file__).parent
GENERIC = [*sorted((ROOT / "parallel").glob("*.py")), *sorted((ROOT / "plan").glob("*.py")),
           *sorted((ROOT / "checkpoint").glob("*.py")), *sorted((ROOT / "config").glob("*.py")),
           *(ROOT / name for name in ("train.py", "validation.py", "build.py", "loss.py", "optim.py", "optimizer_kind.py", "adamw.py", "muon.py",
                                      "precision.py", "convert.py", "parity.py", "float8.py", "metrics.py", "sections.py",
                                      "guard.py", "step.py", "params.py")),
           *sorted((ROOT / "data").glob("*.py"))]
# Named by the contract itself: the blocks' ModuleDict; `moe`, the [moe] recipe section and the args field an
# MoE family's shape carries (trainlib.blocks.moe.MoEArgs), which generic code reads by that name (it finds the
# MoE modules by class, trainlib.blocks.moe.moe_layers, never by a block's attribute).
CONTRACT_NAMES = {"layers", "moe"}
# Strings the contract defines: block_forward_flops names the attention scores' op "attention" (the planner
# prices that kind of work by it); attribute access to a module of that name stays a hit.
# The parameter roles (ModelSpec.param_role, trainlib.models.roles.PARAM_ROLES: "norm", "router", "output",
# ...) are the contract's vocabulary too: the optimizers group parameters by them.
CONTRACT_STRINGS = {"attention", *PARAM_ROLES}


def _family_words() -> tuple[set[str], set[str]]:
    """(family names and their stems, every submodule name of every family's model)."""
    families, modules = set(), set()
    for spec in MODELS.values():
        families |= {spec.name, re.sub(r"\d+$", "", spec.name)}  # "llama3" and "llama"
        with torch.device("meta"):
            model = spec.model_cls(spec.get_args("debug"), rope_len=8)
        for name, _ in model.named_modules():
            modules |= set(name.split(".")) if name else set()
    modules = {m for m in modules if not m.isdigit()} - CONTRACT_NAMES
    return families, modules


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _mentions(path: Path, families: set[str], modules: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    prose = _docstrings(tree)
    found = []

    def family_in(text: str) -> bool:
        return any(f in text.lower() for f in families)

    shown = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path.name
    for node in ast.walk(tree):
        where = f"{shown}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and (node.attr in modules or family_in(node.attr)):
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Name) and family_in(node.id):
            found.append(f"{where}: {node.id}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                                                      else [])
            found += [f"{where}: import {n}" for n in names if family_in(n)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            # A module path segment ("attention.wq", "layers.0.feed_forward.w1.weight") or a family name; prose
            # in messages ("the output projection") is not a dotted path and is allowed.
            segments = set(re.split(r"[.\[\]'\"]", node.value))
            hits = [m for m in modules - CONTRACT_STRINGS
                    if m in segments and ("." in node.value or node.value == m)]
            if hits or family_in(node.value):
                found.append(f"{where}: {node.value[:60]!r}")
    return found


def test_generic_code_names_no_family_and_no_family_module():
    families, modules = _family_words()
    assert {"llama3", "qwen3"} <= families and {"wq", "q_norm", "tok_embeddings", "feed_forward"} <= modules
    found = [hit for path in GENERIC for hit in _mentions(path, families, modules)]
    assert not found, "generic code names a family or a family's module:\n" + "\n".join(found)


def test_the_check_sees_a_family_or_module_name_written_into_generic_code(tmp_path):
    families, modules = _family_words()
    bad = tmp_path / "bad.py"
    for line in ("x = model.tok_embeddings", 'plan = {"attention.wq": 1}', "from trainlib.models import qwen3",
                 "spec = get_model_spec('llama3')", "y = getattr(block, 'feed_forward')", "z = block.attention"):
        bad.write_text(f'"""A docstring may say Llama and wq."""\n{line}\n')
        assert _mentions(bad, families, modules), line
    bad.write_text('"""Mentions of llama3 and q_norm in prose are fine."""\n# so is a comment on wq\nx = 1\n')
    assert not _mentions(bad, families, modules)


def _family_classes() -> set[str]:
    """Class names a family defines for its model's modules (its attention, its blocks, MTP modules, the
    model class), less the names the shared rooms define (`trainlib.blocks`, `trainlib.models.layers`:
    generic code finds the attention base and the MoE parts by those classes)."""
    import trainlib.blocks.attention
    import trainlib.blocks.moe
    import trainlib.models.layers

    shared = {name for mod in (trainlib.blocks.attention, trainlib.blocks.moe, trainlib.models.layers)
              for name, obj in vars(mod).items() if isinstance(obj, type)}
    names = set()
    for spec in MODELS.values():
        with torch.device("meta"):
            model = spec.model_cls(spec.get_args("debug"), rope_len=8)
        names |= {type(m).__name__ for m in model.modules()
                  if type(m).__module__.startswith(f"trainlib.models.{spec.name}")}
    return names - shared


def test_generic_code_names_no_family_class():
    """The axes, the step, the planner and the checkpoint find blocks by position (`block_paths`) and modules by
    the shared rooms' classes, never by a family's own classes (an MoE block, MLA, an MTP module)."""
    classes = _family_classes()
    assert {"MLA", "MTPModule"} <= classes and not {"Attention", "MoEBlock"} & classes  # those two are shared
    found = []
    for path in GENERIC:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in classes:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name}")
    assert not found, "generic code names a family's class:\n" + "\n".join(found)
