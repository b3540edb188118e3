"""A family package's names, loaded on first use (torch-free to import).

The command line and recipes are checked against a family's flavors (its
torch-free args.py) before torch is imported; importing args.py runs the
package's __init__, so that file defers everything else to this."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, module_of: dict[str, str | None], make_spec: Callable[[], Any]
                    ) -> Callable[[str], Any]:
    """The package's module `__getattr__`: `SPEC` built once by `make_spec`, and each name of
    `module_of` (name -> the submodule defining it; None: the name is a submodule) imported when
    first asked for."""

    def __getattr__(name: str) -> Any:
        if name == "SPEC":
            spec = make_spec()
            setattr(sys.modules[package], "SPEC", spec)
            return spec
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{module_of[name] or name}")
        return module if module_of[name] is None else getattr(module, name)

    return __getattr__
