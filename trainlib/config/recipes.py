"""Recipes by name: `--recipe llama70b.toml` finds the shipped recipe from any folder.

The shipped recipes are the repository's top-level `recipes/` folder. A wheel
installs it as `trainlib/recipes/` (see setup.py); a source checkout (an
editable install, or the tree on PYTHONPATH) reads the folder in place.
`extends` inside a recipe stays relative to the extending file, so it works
in both places.

Stdlib only, like the loader: launchers and `--help` import this.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainlib.config.loader import ConfigError, aliases, closest_key, recipes_dir

__all__ = ["aliases", "available_recipes", "recipes_dir", "resolve_recipe"]


def available_recipes() -> dict[str, str]:
    """Shipped recipe names (aliases in brackets) -> what the file's first comment line
    says before its first colon (the recipes open with "<model> on <cluster>: <how>")."""
    out, known = {}, aliases()
    for path in sorted(recipes_dir().glob("*.toml")):
        first = path.read_text(encoding="utf-8").splitlines()[:1]
        names = [a for a, stem in known.items() if stem == path.stem]
        name = path.stem + (f" ({', '.join(names)})" if names else "")
        out[name] = first[0].lstrip("# ").split(": ")[0].strip() if first and first[0].startswith("#") else ""
    return out


def _is_path(name: str) -> bool:
    return any(sep and sep in name for sep in ("/", os.sep, os.altsep)) or Path(name).is_file()


def resolve_recipe(name: str | os.PathLike) -> Path:
    """A path stays a path (it has a directory part, or names an existing file);
    anything else is a shipped recipe's name or alias, with or without `.toml`."""
    name = os.fspath(name)
    stem = Path(name).name.removesuffix(".toml")
    known = aliases()
    shipped = recipes_dir() / f"{known.get(stem, stem)}.toml"
    if _is_path(name):
        if not Path(name).is_file() and shipped.is_file():  # e.g. recipes/debug.toml outside the repo
            raise ConfigError(f"recipe file not found: {name}; the shipped recipe of that name is "
                              f"--recipe {stem}")
        return Path(name)
    if shipped.is_file():
        return shipped
    names = [*(p.stem for p in sorted(recipes_dir().glob("*.toml"))), *known]
    near = closest_key(stem, names)
    hint = f"did you mean {near!r}? " if near else ""
    raise ConfigError(f"unknown recipe {name!r}; {hint}shipped recipes: {', '.join(available_recipes())}; "
                      f"or give the path of a .toml file")
