"""Strict, typed TOML recipe loader over nested dataclasses.

A job config is a dataclass whose fields are "section" dataclasses (which may
nest further) holding leaf values. A recipe is a TOML file mirroring that
shape, optionally inheriting from other recipes via ``extends``; CLI overrides
(``--section.key=value``) are applied on top. Every key and value is checked
against the schema so that a typo fails loudly, on one line, with a fix.

Deliberately stdlib-only (no torch): launchers and ``--help`` import this.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import re
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence, TypeVar, Union

from trainlib.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - older interpreters only
    import tomli as tomllib

__all__ = [
    "ConfigError", "load_recipe", "parse_overrides", "load_toml_with_extends",
    "config_to_dict", "dumps_toml", "save_config", "closest_key", "describe",
]

T = TypeVar("T")
_MISSING = dataclasses.MISSING
_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def closest_key(name: str, candidates: Iterable[str]) -> str | None:
    """Best fuzzy match for ``name`` (case-insensitive), or None if nothing is close."""
    by_lower = {c.lower(): c for c in candidates}
    hit = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[hit[0]] if hit else None


# --------------------------------------------------------------------------- schema
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # Cached: a schema's hints never change, and resolving them was a quarter of
    # `python -m trainlib.plan --suggest`, which loads the recipe once per layout.
    # get_type_hints resolves string annotations (``from __future__ import
    # annotations``). An unresolvable hint is a schema bug: fail loudly rather
    # than silently skipping type checks.
    try:
        return typing.get_type_hints(cls)
    except Exception as e:
        raise TypeError(f"cannot resolve type hints of {cls.__qualname__}: {e}") from e


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    # init=False fields are derived state, not user-settable, so not config keys.
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return _MISSING


def _all_paths(cls: type, prefix: tuple = ()) -> dict[tuple, bool]:
    """Every key path the schema accepts, mapped to whether it is a section."""
    out, hints = {}, _hints(cls)
    for name in _fields(cls):
        out[prefix + (name,)] = _is_section(hints[name])
        if out[prefix + (name,)]:
            out.update(_all_paths(hints[name], prefix + (name,)))
    return out


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    return getattr(tp, "__name__", str(tp))


# --------------------------------------------------------------------------- values
def _show(value: Any, from_str: bool) -> str:
    text = repr(value) if from_str else f"{value!r} ({type(value).__name__})"
    return text if len(text) <= 80 else text[:77] + "..."


class _NotFinite(ConfigError):
    """A number of the right type that no key accepts: final, whatever other arm a union has."""


def _finite(value: Any, key: str, src: str) -> Any:
    """No setting of any section means anything by inf or nan (TOML and the CLI both spell them), and
    each passes comparisons such as ``lr > 0`` or fails ``weight_decay < 0`` without a word."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _NotFinite(f"{key}: must be a finite number, got {value} (from {src}); "
                          f"fix the value in the recipe or override")
    return value


def _coerce(value: Any, tp: Any, key: str, src: str, from_str: bool) -> Any:
    """Check/convert one value against ``tp``. ``from_str``: value is CLI text."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def bad() -> ConfigError:
        return ConfigError(f"{key}: expected {_type_name(tp)}, got {_show(value, from_str)} "
                           f"(from {src}); fix the value in the recipe or override")

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if from_str and type(None) in args and value.strip().lower() in _NONE_WORDS:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # plain optional: keep the arm's specific message
            return _coerce(value, arms[0], key, src, from_str)
        for arm in arms:
            try:
                return _coerce(value, arm, key, src, from_str)
            except _NotFinite:
                raise
            except ConfigError:
                continue
        raise bad()
    if origin is Literal:
        for choice in args:
            try:  # compare in the choice's own type so True never equals 1
                got = _coerce(value, type(choice), key, src, from_str)
            except ConfigError:
                continue
            if got == choice and type(got) is type(choice):
                return choice
        hint = closest_key(str(value), [str(a) for a in args]) if isinstance(value, str) else None
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(repr(a) for a in args)} "
                          f"(from {src}); " + (f"did you mean {hint!r}?" if hint else "pick one of them"))
    if origin is list or tp is list:
        elem = args[0] if args else Any
        if from_str:
            text = value.strip()
            if text.startswith("["):
                try:  # TOML array syntax allows quoting strings that contain commas
                    return _coerce(tomllib.loads(f"v = {text}")["v"], tp, key, src, False)
                except (tomllib.TOMLDecodeError, ConfigError):
                    # e.g. "[a, b]" for list[str]: not TOML, but the intent is clear
                    text = text[1:-1] if text.endswith("]") else text[1:]
            items = [t.strip() for t in text.split(",")] if text.strip() else []
            return [_coerce(t, elem, f"{key}[{i}]", src, True) for i, t in enumerate(items)]
        if not isinstance(value, list):
            raise bad()
        return [_coerce(v, elem, f"{key}[{i}]", src, False) for i, v in enumerate(value)]
    if tp in (bool, int, float, str):
        if from_str:
            text = value.strip().lower()
            if tp is str:
                return value
            if tp is bool:
                if text in _TRUE_WORDS + _FALSE_WORDS:
                    return text in _TRUE_WORDS
            else:
                try:  # int() accepts "1_000" and rejects "1.5", exactly the rule we want
                    number = tp(text)
                except ValueError:
                    pass
                else:
                    return _finite(number, key, src)
        # TOML values are already typed: demand the exact type (so no 0/1 for
        # bools, no 1.0 for ints), except that a float field may take an int.
        elif type(value) is tp or (tp is float and type(value) is int):
            return _finite(tp(value), key, src)
        raise bad()
    if isinstance(tp, type):  # e.g. pathlib.Path: build from text, else isinstance
        if isinstance(value, tp):
            return value
        if from_str or isinstance(value, str):
            try:
                return tp(value)
            except Exception:
                pass
        raise bad()
    return value  # unknown typing construct: trust the dataclass itself


# ------------------------------------------------------------------- unknown keys
def _unknown(root: type, parts: tuple, idx: int, is_section: bool, src: str) -> ConfigError:
    """Error for ``parts[idx]`` not being a field, with the best suggestions."""
    cls = root
    for seg in parts[:idx]:
        cls = _hints(cls)[seg]
    valid = _all_paths(root)
    # Cross-section hints must be of the same kind as the last segment given.
    same_kind = [p for p, sec in valid.items() if sec == (is_section and idx == len(parts) - 1)]
    suggestions: list[tuple] = []
    near = closest_key(parts[idx], _fields(cls))
    if near:  # typo inside the right section (keeps the rest of the key if valid)
        fixed = parts[:idx] + (near,) + parts[idx + 1:]
        suggestions.append(fixed if fixed in valid else parts[:idx] + (near,))
    # Right name, wrong place: e.g. training.tp -> parallelism.tp.
    suggestions += sorted(p for p in same_kind if p[-1] == parts[-1] and p != parts)
    if not suggestions:  # typo'd name in the wrong place: fuzzy-match names anywhere
        near = closest_key(parts[-1], {p[-1] for p in same_kind})
        suggestions += sorted(p for p in same_kind if p[-1] == near)
    shown = list(dict.fromkeys("'" + ".".join(s) + "'" for s in suggestions))
    label = ".".join(parts[: idx + 1] if is_section else parts)
    msg = f"unknown {'section' if is_section else 'key'} '{label}' in {src}"
    if shown:
        return ConfigError(f"{msg}; did you mean {' or '.join(shown)}?")
    where = f"'{'.'.join(parts[:idx])}'" if idx else "the top level"
    return ConfigError(f"{msg}; valid keys in {where}: {', '.join(_fields(cls))}")


# --------------------------------------------------------------------- TOML files
def _merge(dst: dict, src: dict, dst_org: dict, src_org: dict, path: tuple = ()) -> None:
    """Deep-merge ``src`` into ``dst`` in place, keeping per-key origin files."""
    for k, v in src.items():
        kp = path + (k,)
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v, dst_org, src_org, kp)
            continue
        # Scalars/lists/tables-replacing-scalars replace wholesale: drop stale origins.
        for old in [p for p in dst_org if p[: len(kp)] == kp]:
            del dst_org[old]
        dst_org.update({p: f for p, f in src_org.items() if p[: len(kp)] == kp})
        dst[k] = copy.deepcopy(v)  # never alias a base file's lists/tables


def _origins(d: dict, file: str, path: tuple = ()) -> dict[tuple, str]:
    out = {}
    for k, v in d.items():
        out[path + (k,)] = file
        if isinstance(v, dict):
            out.update(_origins(v, file, path + (k,)))
    return out


_PARSED: dict[bytes, dict] = {}  # a TOML file's bytes -> its parse (the planner loads a recipe per layout)


def read_toml(path: Path) -> dict:
    """The TOML file at `path`, parsed (a fresh copy: callers merge into it). A file's parse is kept by
    its bytes, which are read each time, so an edited file is parsed anew."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw not in _PARSED:
        if len(_PARSED) > 256:
            _PARSED.clear()
        _PARSED[raw] = tomllib.loads(raw.decode())
    return copy.deepcopy(_PARSED[raw])


def _load(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict]:
    """Load ``path`` with its ``extends`` resolved; ``chain`` is the include stack."""
    if not path.is_file():
        via = f" (extended from {chain[-1]})" if chain else ""
        raise ConfigError(f"recipe file not found: {path}{via}; check the path")
    try:
        data = read_toml(path)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    names = data.pop("aliases", [])  # a shipped recipe's other names (trainlib.config.recipes)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"aliases in {path} must be a list of recipe names, got {names!r}")
    bases = data.pop("extends", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"extends in {path} must be a file name or a list of file names, "
                          f"got {bases!r}")
    merged, org, chain = {}, {}, chain + (path,)
    for base in bases:
        base_path = _base_recipe(path, base)
        if any(base_path.resolve() == p.resolve() for p in chain):
            cycle = " -> ".join(str(p) for p in chain + (base_path,))
            raise ConfigError(f"extends cycle: {cycle}; remove one of the extends entries")
        b_data, b_org = _load(base_path, chain)
        _merge(merged, b_data, org, b_org)
    _merge(merged, data, org, _origins(data, str(path)))
    return merged, org


def recipes_dir() -> Path:
    package = Path(__file__).resolve().parents[1]  # trainlib/
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parent / "recipes"


def aliases() -> dict[str, str]:
    """Other names of the shipped recipes (the design card's, e.g. for the Llama 3.1 recipes), each
    declared by its recipe file as a top-level `aliases = [...]` -> the recipe's stem."""
    out = {}
    for path in sorted(recipes_dir().glob("*.toml")):
        for alias in read_toml(path).get("aliases", []):
            out[alias] = path.stem
    return out


def _base_recipe(path: Path, base: str) -> Path:
    """What `extends = base` in `path` names: a file relative to the extending file (not the CWD) when
    there is one; else, for a bare name, the shipped recipe of that name or alias, so that a user's
    recipe in any folder can say `extends = "llama3_8b"`."""
    local = path.parent / base
    if local.is_file() or any(sep and sep in base for sep in ("/", os.sep, os.altsep)):
        return local
    stem = base.removesuffix(".toml")
    shipped = recipes_dir() / f"{aliases().get(stem, stem)}.toml"
    return shipped if shipped.is_file() else local


def load_toml_with_extends(path: str | os.PathLike) -> dict:
    """The raw recipe dict with every ``extends`` resolved and merged."""
    return _load(Path(path), ())[0]


# ---------------------------------------------------------------- building config
def parse_overrides(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """``["--a.b=1", "--c", "2"]`` -> ``[("a.b", "1"), ("c", "2")]``."""
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        key, eq, value = tok[2:].partition("=")
        if not tok.startswith("--") or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", key):
            raise ConfigError(f"bad override {tok!r}: expected --section.key=value or "
                              f"--section.key value")
        if not eq:  # value is the next token, which must not itself be a flag
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ConfigError(f"override --{key} has no value; write --{key}=VALUE")
            i += 1
            value = tokens[i]
        out.append((key, value))
        i += 1
    return out


def _convert(root: type, cls: type, raw: dict, path: tuple, org: dict) -> dict:
    """Type-check a TOML table against ``cls``; returns a tree of checked values."""
    fields, hints, out = _fields(cls), _hints(cls), {}
    for k, v in raw.items():
        kp = path + (k,)
        src = org.get(kp, "recipe")
        if k not in fields:
            raise _unknown(root, kp, len(path), isinstance(v, dict), src)
        tp, dotted = hints[k], ".".join(kp)
        if _is_section(tp):
            if not isinstance(v, dict):
                raise ConfigError(f"{dotted}: expected a table [{dotted}], got {_show(v, False)} "
                                  f"(from {src}); write its keys under a [{dotted}] header")
            out[k] = _convert(root, tp, v, kp, org)
        else:
            out[k] = _coerce(v, tp, dotted, src, from_str=False)
    return out


def _apply_override(root: type, tree: dict, key: str, value: str) -> None:
    parts, cls, node, src = tuple(key.split(".")), root, tree, f"--{key}"
    for i, seg in enumerate(parts):
        last = i == len(parts) - 1
        if seg not in _fields(cls):
            raise _unknown(root, parts, i, not last, src)
        tp = _hints(cls)[seg]
        if _is_section(tp):
            if last:
                example = next(iter(_fields(tp)), "key")
                raise ConfigError(f"'{key}' is a section, not a key (from {src}); "
                                  f"set one of its keys, e.g. --{key}.{example}=...")
            cls, node = tp, node.setdefault(seg, {})
        elif not last:
            raise ConfigError(f"unknown key '{key}' in {src}; "
                              f"'{'.'.join(parts[:i + 1])}' is a value, not a section")
        else:
            node[seg] = _coerce(value, tp, key, src, from_str=True)


def _build(cls: type, tree: dict, path: tuple, base: Any) -> Any:
    """Instantiate ``cls`` bottom-up so each ``__post_init__`` sees final values.

    ``base`` is the default instance from the parent's field (if any); starting
    from it keeps non-trivial ``default_factory`` values the schema author chose.
    """
    kwargs, hints = {}, _hints(cls)
    for name, f in _fields(cls).items():
        tp = hints[name]
        if _is_section(tp):
            sub = getattr(base, name) if base is not None else None
            if sub is None:
                try:
                    sub = _default(f)
                except Exception:  # invalid defaults: let user values + post_init decide
                    sub = None
            sub = None if sub is _MISSING else sub
            kwargs[name] = _build(tp, tree.get(name, {}), path + (name,), sub)
        elif name in tree:
            kwargs[name] = tree[name]
        elif base is None and f.default is _MISSING and f.default_factory is _MISSING:
            dotted = ".".join(path + (name,))
            raise ConfigError(f"missing required key '{dotted}'; set it in the recipe or "
                              f"with --{dotted}=...")
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ConfigError as e:  # __post_init__ validation: name the section for context
        section, msg = ".".join(path), str(e)
        named = section and re.search(rf"(?<![\w.]){re.escape(section)}\b", msg)
        raise ConfigError(msg if not section or named else f"{section}: {msg}") from e


def load_recipe(schema: type[T], path: str | os.PathLike | None,
                overrides: Sequence[str] = ()) -> T:
    """Defaults <- recipe file (with extends) <- CLI overrides, all type-checked."""
    if not _is_section(schema):
        raise TypeError(f"schema must be a dataclass type, got {schema!r}")
    raw, org = _load(Path(path), ()) if path is not None else ({}, {})
    tree = _convert(schema, schema, raw, (), org)
    for key, value in parse_overrides(overrides):
        _apply_override(schema, tree, key, value)
    return _build(schema, tree, (), None)


# ------------------------------------------------------------------ serialisation
def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict of the settable fields; None is omitted (TOML has no null)."""
    out = {}
    for name in _fields(type(cfg)):
        v = getattr(cfg, name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[name] = config_to_dict(v)
        elif v is not None:
            out[name] = [*v] if isinstance(v, (list, tuple)) else v
    return out


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
            "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    # Control characters must be escaped in basic strings; everything else is UTF-8.
    body = "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F
                                       else c) for c in s)
    return f'"{body}"'


def _toml_key(k: Any) -> str:
    if not isinstance(k, str):
        raise TypeError(f"TOML keys must be str, got {k!r}")
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_str(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):  # before int: bool is an int subclass
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        # shortest repr round-trips exactly and is TOML as it stands: "1e-05", "nan", "inf", "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, os.PathLike):
        return _toml_str(os.fspath(v))
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} to TOML")


def dumps_toml(d: dict) -> str:
    """Minimal TOML writer for config_to_dict output (scalars, lists, nested tables)."""
    lines: list[str] = []

    def emit(table: dict, path: tuple) -> None:
        if path:  # always emit the header so empty tables survive the round-trip
            lines.extend([""] if lines else [])
            lines.append("[" + ".".join(_toml_key(k) for k in path) + "]")
        subs = []
        for k, v in table.items():  # scalars must precede sub-table headers
            if isinstance(v, dict):
                subs.append((k, v))
            else:
                lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        for k, v in subs:
            emit(v, path + (k,))

    emit(d, ())
    return "\n".join(lines) + "\n"


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the config as TOML atomically, so a crash never leaves a torn file."""
    text = dumps_toml(cfg if isinstance(cfg, dict) else config_to_dict(cfg))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp makes the file 0600; a run's config is read by its group's tools like its other files
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)  # same directory, hence same filesystem: atomic
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def describe(schema: type, _base: Any = None, _prefix: str = "") -> str:
    """One line per key: ``section.key = default  # type; help`` (for ``--help``)."""
    lines, hints = [], _hints(schema)
    for name, f in _fields(schema).items():
        tp, key = hints[name], _prefix + name
        try:  # the parent's default instance knows factory-customised defaults
            value = getattr(_base, name) if _base is not None else _default(f)
        except Exception:
            value = _MISSING
        if _is_section(tp):
            lines.append(describe(tp, None if value is _MISSING else value, key + "."))
            continue
        try:
            shown = ("<required>" if value is _MISSING else "none" if value is None
                     else _toml_value(value))
        except TypeError:
            shown = repr(value)
        help_text = f.metadata.get("help")
        lines.append(f"{key} = {shown}  # {_type_name(tp)}" + (f"; {help_text}" if help_text else ""))
    return "\n".join(line for line in lines if line)
