"""Safe YAML for configs: duplicate keys, keys that are not strings and exponential aliases refused,
YAML 1.2 scalars (`1e-3` is a float, `yes` a string), symbolic link loops named as such."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import yaml

from normexp.config.errors import ConfigError

PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # package data: a checkout's configs/ links here


def packaged_config(name: str) -> Path | None:
    """The sweep file shipped with normexp that `name` names (`warmup`, `depth.yaml`: configs/NAME.yaml,
    then configs/studies/NAME.yaml), or None."""
    stem = name.removesuffix(".yaml")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", stem):
        return None
    found = [path for path in (PACKAGED_CONFIGS / f"{stem}.yaml", PACKAGED_CONFIGS / "studies" / f"{stem}.yaml")
             if path.is_file()]
    return found[0] if found else None


MAX_YAML_NODES = 100_000  # a config is a few hundred values; aliases must not expand past this


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars, string keys only, no duplicate keys, and a bound on what aliases
    expand to.

    Scalars follow the YAML 1.2 core schema where YAML 1.1 surprises: `010` is ten (not octal eight),
    `yes`/`no`/`on`/`off` are strings, `1:30` is a string (not 90), `1e-3` is a float. Merge keys
    (`<<: *defaults`) work, and a key written after them overrides the merged value; a key written
    twice is an error. A document whose aliases expand past MAX_YAML_NODES values is refused before
    anything is built from it (a few hundred bytes of nested aliases can expand to gigabytes)."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _expanded_size(node, {})
            _refuse_keys_not_strings(node, "", set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes `node` stands for once every alias in it is expanded (each node counted once
    per path that reaches it, each shared node computed once)."""
    if id(node) in sizes:
        if sizes[id(node)] < 0:
            raise ConfigError(f"line {node.start_mark.line + 1}: an alias refers to the node that contains it")
        return sizes[id(node)]
    sizes[id(node)] = -1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    total = 1 + sum(_expanded_size(child, sizes) for child in children)
    if total > MAX_YAML_NODES:
        raise ConfigError(f"line {node.start_mark.line + 1}: expands to more than {MAX_YAML_NODES} values "
                          "(aliases inside aliases?); refused")
    sizes[id(node)] = total
    return total


MERGE_TAG = "tag:yaml.org,2002:merge"
STR_TAG = "tag:yaml.org,2002:str"


def _refuse_keys_not_strings(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Refuse a mapping with a key YAML reads as other than a string (`1`, `null`, `true`, a list), naming
    the mapping by its key path. Every key of a config is a string; and checked here, before Python
    builds the dict, `{1: a, true: b}` (1 == True in Python) cannot pass for a duplicate key."""
    if id(node) in seen:  # a node that aliases share is checked once, where it is first reached
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, child in enumerate(node.value):
            _refuse_keys_not_strings(child, _join_path(path, str(index)), seen)
    if not isinstance(node, yaml.MappingNode):
        return
    bad = [key for key, _ in node.value if key.tag not in (STR_TAG, MERGE_TAG)]
    if bad:
        shown = ", ".join(_key_text(key) for key in bad[:5]) + (", ..." if len(bad) > 5 else "")
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}keys must be strings (got {shown}; line {bad[0].start_mark.line + 1})")
    for key, value in node.value:  # a merged mapping's keys are this mapping's keys
        _refuse_keys_not_strings(value, path if key.tag == MERGE_TAG else _join_path(path, key.value), seen)


def _join_path(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def _key_text(node: yaml.Node) -> str:
    """A key as written (`1`, `null`, `true`), cut short; a list or mapping used as a key by its kind."""
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    text = node.value or "null"  # an empty key (`? ` alone) is null
    return text if len(text) <= 20 else text[:19] + "…"


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping: merged keys first (`<<`: an earlier source wins), then the keys written here, which
    override merged ones but must not repeat each other."""
    mapping: dict = {}
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            for source in reversed(_merge_sources(value_node)):
                mapping.update(loader.construct_object(source, deep=True))
    written: set = set()
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=deep)  # a string: _refuse_keys_not_strings ran first
        if key in written:
            raise ConfigError(f"{str(key)[:60]}: duplicate key (line {key_node.start_mark.line + 1})")
        written.add(key)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


def _merge_sources(node: yaml.Node) -> list[yaml.MappingNode]:
    sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
    if not all(isinstance(source, yaml.MappingNode) for source in sources):
        raise ConfigError(f"line {node.start_mark.line + 1}: '<<' merges a mapping or a list of mappings")
    return sources


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.2 integers: decimal (leading zeros too), 0o octal, 0x hexadecimal; '_' separates digits."""
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


def _yaml_12_resolvers() -> dict:
    """PyYAML's implicit resolvers without its YAML 1.1 booleans and integers (replaced below)."""
    dropped = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int"}
    return {first: [(tag, regexp) for tag, regexp in resolvers if tag not in dropped]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


_StrictLoader.yaml_implicit_resolvers = _yaml_12_resolvers()
_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML safely; every failure is a ConfigError naming the source and line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader derives from SafeLoader
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{source}: unsupported or unsafe YAML: {exc.problem}{where}") from None
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: malformed YAML: {where}{problem}") from None


SYMLINK_LOOP = "a symbolic link loop (too many levels of symbolic links)"  # ELOOP, said as such


def is_symlink_loop(path: Path) -> bool:
    """Whether resolving `path` (or a folder on its way) runs into a loop of symbolic links (ELOOP).
    Path.exists() and is_dir() say False there, as for a missing file: check this first."""
    try:
        path.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def read_mapping(path: str | Path) -> dict:
    """Read a YAML file that must hold a mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:  # a dangling symbolic link too
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:  # the path is already named: the reason alone, not errno's repr of it
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path}: {SYMLINK_LOOP}") from None
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    data = parse_yaml(text, str(path))
    if data is None:
        raise ConfigError(f"{path}: the file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of keys to values, got {type(data).__name__}")
    return data


