"""One command-line grammar for every entry point that reads a recipe.

    python -m trainlib.<tool> [--recipe NAME|FILE] [tool flags] [--section.key=value | --section.key value ...]

`train`, `plan`, `parity` (and any later tool) build a `RecipeArgumentParser`,
add their own flags, and get back the namespace plus the recipe overrides in
one normalised form (`--section.key=value`), which `load_job_config` checks
against the schema. `--set section.key=value` is accepted as an alias (the
planner's older form). Every parse error is a one-line `ConfigError`, the same
as a bad recipe key, so each tool reports it the same way (exit 2, no
traceback).

Stdlib only, like the loader: launchers and `--help` import this.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from trainlib.config.loader import ConfigError, parse_overrides

__all__ = ["RecipeArgumentParser", "print_to_reader"]


def print_to_reader(text: str) -> None:
    """Print `text` to stdout, quietly when the reader stops early (`--help | head`): a closed pipe is
    not an error of this command. stdout then points at /dev/null, so that the interpreter's last flush
    does not raise again."""
    import os
    import sys

    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class RecipeArgumentParser(argparse.ArgumentParser):
    """argparse with `--recipe`, `--set` and free `--section.key` overrides."""

    def __init__(self, prog: str, description: str = "", *, epilog: str | None = None):
        super().__init__(prog=prog, description=description, epilog=epilog, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_argument("--recipe", default=None, metavar="NAME|FILE",
                          help="a shipped recipe's name (e.g. debug; --list-recipes lists them) or a TOML file's path "
                               "(default: the built-in defaults: the debug model on the shipped corpus)")
        self.add_argument("--set", action="extend", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                          help="recipe overrides; --set a.b=1 c.d=2 is the same as --a.b=1 --c.d=2")

    def help_requested(self, argv: Sequence[str]) -> bool:
        """Print the help and return True when `argv` asks for it: the mains
        return 0 themselves instead of argparse's SystemExit."""
        if "-h" in argv or "--help" in argv:
            print_to_reader(self.format_help())
            return True
        return False

    def error(self, message: str):  # argparse would print usage and exit; one line instead
        raise ConfigError(f"{message} (see {self.prog} --help)")

    def parse_recipe_args(self, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
        """(the tool's namespace, recipe overrides as ["--section.key=value", ...])."""
        argv = list(argv)
        for i, tok in enumerate(argv):
            if tok == "--recipe" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                raise ConfigError("--recipe needs a recipe name or file path, e.g. --recipe debug")
        ns, rest = self.parse_known_args(argv)
        pairs = []
        for item in ns.set:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
            pairs.append("--" + item.removeprefix("--"))
        pairs += [f"--{k}={v}" for k, v in parse_overrides(rest)]
        # Validate the --set forms with the same rules as the free ones.
        return ns, [f"--{k}={v}" for k, v in parse_overrides(pairs)]
