"""The package says Python >= 3.10, and CI runs 3.11: nothing stops a 3.11-only
standard-library call from landing (hashlib.file_digest did, and broke data
preparation on 3.10). This reads the source of trainlib, scripts and tests and
refuses the 3.11+ names a 3.11 run cannot notice. Syntax newer than 3.11
(`type X = ...`, nested f-string quotes) already fails to parse on CI's 3.11.
The whole suite was also run by hand on 3.10 (README, "Supported versions")."""

import ast

from tests.helpers import REPO

# module -> names added after 3.10 (the version that added them)
NEWER = {
    "hashlib": {"file_digest": "3.11"},
    "datetime": {"UTC": "3.11"},
    "typing": {n: "3.11" for n in ("Self", "LiteralString", "Never", "assert_never", "reveal_type", "Required",
                                    "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform")}
    | {"override": "3.12"},
    "enum": {"StrEnum": "3.11", "verify": "3.11", "ReprEnum": "3.11"},
    "contextlib": {"chdir": "3.11"},
    "asyncio": {"TaskGroup": "3.11", "timeout": "3.11"},
    "math": {"cbrt": "3.11", "exp2": "3.11"},
    "operator": {"call": "3.11"},
    "logging": {"getLevelNamesMapping": "3.11"},
    "sys": {"exception": "3.11"},
    "itertools": {"batched": "3.12"},
    "os": {"process_cpu_count": "3.13"},
}
NEWER_BUILTINS = {"ExceptionGroup": "3.11", "BaseExceptionGroup": "3.11"}
NEWER_MODULES = {"tomllib": "3.11"}  # only under an `if sys.version_info ...` guard


def _newer_uses(tree: ast.AST) -> list[str]:
    found = []

    def visit(node, guarded):
        if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
            guarded = True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.attr in NEWER.get(node.value.id, {}):
                found.append(f"{node.value.id}.{node.attr} ({NEWER[node.value.id][node.attr]}+)")
        elif isinstance(node, ast.ImportFrom):
            found.extend(f"from {node.module} import {a.name} ({NEWER[node.module][a.name]}+)"
                         for a in node.names if a.name in NEWER.get(node.module, {}))
            if node.module in NEWER_MODULES and not guarded:
                found.append(f"from {node.module} import ... ({NEWER_MODULES[node.module]}+, unguarded)")
        elif isinstance(node, ast.Import):
            found.extend(f"import {a.name} ({NEWER_MODULES[a.name]}+, unguarded)"
                         for a in node.names if a.name in NEWER_MODULES and not guarded)
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            found.append(f"{node.id} ({NEWER_BUILTINS[node.id]}+)")
        elif type(node).__name__ == "TryStar":  # by name: ast.TryStar itself is 3.11+
            found.append("except* (3.11+)")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return found


def test_no_standard_library_name_newer_than_python_3_10():
    bad = {}
    for folder in ("trainlib", "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if uses := _newer_uses(ast.parse(path.read_text(), str(path))):
                bad[str(path.relative_to(REPO))] = uses
    assert not bad, f"needs a newer Python than pyproject's >=3.10 (guard it or use a 3.10 way): {bad}"


def test_the_check_sees_each_kind_of_use():
    src = """
import hashlib, tomllib
from typing import Self
from tomllib import loads
if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
hashlib.file_digest(f, "sha256")
raise ExceptionGroup("x", [])
"""
    assert _newer_uses(ast.parse(src)) == [
        "import tomllib (3.11+, unguarded)", "from typing import Self (3.11+)",
        "from tomllib import ... (3.11+, unguarded)", "hashlib.file_digest (3.11+)", "ExceptionGroup (3.11+)"]
