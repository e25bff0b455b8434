"""Reading a YAML file that a user wrote (a config or a data YAML): bounded, strict, and every failure a
Problem.

What is refused, each with the file (and line or byte where known) and the fix:
- a file over MAX_YAML_BYTES (a config or data YAML holds settings and a list of sources, never records),
  a folder or a special file, a file that cannot be read;
- bytes that are not UTF-8 text (a NUL byte: a binary file; a UTF-16 byte-order mark; an invalid byte);
- YAML syntax errors, tags the safe loader does not know, values it cannot build (a date like 2024-13-45);
- a key defined twice in one mapping (YAML's last-wins would drop the first silently): both lines named;
- aliases (`*name`) that would expand the document by more than MAX_ALIAS_NODES values ("billion laughs"),
  nesting deeper than MAX_DEPTH, and an alias inside its own anchor: measured on the composed node graph,
  where an alias is one shared node, so the check takes time and memory in proportion to the file;
- an empty file, or a top level that is not a mapping.

The limits are constants, not settings: a real config is a few kilobytes, tens of values deep at most, and
uses aliases a handful of times (`<<: *defaults`). The pure-Python loader is used on purpose: libyaml's
composer recurses in C and crashes the process (segmentation fault) on deeply nested input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from vlmexp.errors import Problem

MAX_YAML_BYTES = 1 << 20  # 1 MiB
MAX_ALIAS_NODES = 100_000  # values that aliases may add to the document, in all
MAX_DEPTH = 64  # nested mappings and lists

Loc = tuple[str | int, ...]


class YamlProblems(Exception):
    """Problems found while reading one YAML file (the caller raises its own error class with them)."""

    def __init__(self, problems: list[Problem]):
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems


class _Refused(Exception):
    def __init__(self, node: yaml.Node, message: str):
        self.node, self.message = node, message


def read_yaml_mapping(path: str | Path, expected: str) -> tuple[dict[str, Any], dict[Loc, int]]:
    """The top-level mapping of a YAML file and the 1-based line of every key and list item.

    `expected` says what the top level should hold, for the messages ("the sections of a config").
    Raises YamlProblems.
    """
    p = Path(path)
    raw, node = parse_yaml(_read_text(p), str(p))
    if node is None:
        raise YamlProblems([Problem(str(p), "", f"the file is empty; write {expected} in it")])
    if not isinstance(raw, dict):
        raise YamlProblems([Problem(f"{p}:{node.start_mark.line + 1}", "", f"the top level must be a mapping "
                                    f"(key: value lines) holding {expected}, got a {type(raw).__name__}")])
    lines: dict[Loc, int] = {}
    _collect_lines(node, (), lines)
    return raw, lines


def parse_yaml(text: str, where: str) -> tuple[Any, yaml.Node | None]:
    """(value, its node) of one YAML document, with the checks above; `where` names it in problems
    (a file, or the override it came from). An empty document is (None, None). Raises YamlProblems."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # reads the text once: a control character is refused here
        node = loader.get_single_node()
        if node is None:
            return None, None
        _check_graph(where, node)
        return loader.construct_document(node), node
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or str(e)
        raise YamlProblems([Problem(f"{where}{line}", "",
                                    f"YAML syntax error: {reason}; fix the YAML there")]) from None
    except RecursionError:
        raise YamlProblems([Problem(where, "",
                                    f"nesting too deep to read (over {MAX_DEPTH} levels of mappings "
                                    f"and lists); flatten it")]) from None
    except (ValueError, TypeError, OverflowError) as e:  # a scalar the safe constructor cannot build
        raise YamlProblems([Problem(where, "",
                                    f"a value cannot be read ({e}); quote it to keep it as text")]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _read_text(p: Path) -> str:
    def refuse(message: str, where: str = str(p)) -> YamlProblems:
        return YamlProblems([Problem(where, "", message)])

    if not p.exists():
        raise refuse("file not found: check the path (relative paths start at the current directory)")
    if p.is_dir():
        raise refuse("is a folder, not a file: give the path of the YAML file")
    if not p.is_file():
        raise refuse("is not a regular file (a pipe or a device): give the path of a YAML file")
    try:
        size = p.stat().st_size
        if size > MAX_YAML_BYTES:
            raise refuse(f"the file has {size} bytes, over the {MAX_YAML_BYTES} bytes a config or data YAML "
                         "may have (it holds settings and a list of sources; records go in .jsonl files)")
        with p.open("rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or e}); check the file's permissions") from None
    if len(data) > MAX_YAML_BYTES:
        raise refuse(f"the file grew past {MAX_YAML_BYTES} bytes while being read; give a finished file")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise refuse("the file is UTF-16 text; save it as UTF-8")
    if (nul := data.find(b"\x00")) >= 0:
        raise refuse(f"a binary file, not YAML text (a NUL byte at byte {nul}); give the YAML file's path",
                     f"{p}:{_line_of(data, nul)}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise refuse(f"not UTF-8 text: byte 0x{data[e.start]:02x} at byte {e.start} cannot be decoded; save "
                     "the file as UTF-8", f"{p}:{_line_of(data, e.start)}") from None


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _check_graph(p: str, root: yaml.Node) -> None:
    """Duplicate keys, alias expansion, depth and self-reference, on the composed graph (aliases shared)."""
    memo: dict[int, int] = {}
    problems: list[Problem] = []
    try:
        expanded = _expanded(root, (), memo, set(), problems, p)
    except _Refused as r:
        raise YamlProblems([Problem(f"{p}:{r.node.start_mark.line + 1}", "", r.message)]) from None
    if expanded - len(memo) > MAX_ALIAS_NODES:
        problems.append(Problem(p, "",
                                f"aliases (*name) expand the document by {expanded - len(memo)} values, over "
                                f"the limit of {MAX_ALIAS_NODES}; write the values out or use fewer aliases"))
    if problems:  # in file order (the walk meets a mapping's duplicates before those nested inside it)
        raise YamlProblems(sorted(problems, key=_line_in))


def _line_in(problem: Problem) -> int:
    line = problem.where.rpartition(":")[2]
    return int(line) if line.isdigit() else 0


def _expanded(node: yaml.Node, loc: Loc, memo: dict[int, int], open_: set[int], problems: list[Problem],
              p: str) -> int:
    """How many values `node` stands for once every alias is written out (memoised per shared node)."""
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in open_:
        raise _Refused(node,
                       "an alias refers to the anchor that contains it (a recursive structure); remove it")
    if len(loc) > MAX_DEPTH:
        raise _Refused(node, f"nested more than {MAX_DEPTH} levels deep; flatten the file")
    children: list[tuple[yaml.Node, Loc]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], yaml.Node] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                first = seen.setdefault((key.tag, key.value), key)
                if first is not key:
                    problems.append(Problem(f"{p}:{key.start_mark.line + 1}",
                                            ".".join(map(str, (*loc, key.value))),
                                            "key defined twice in one mapping (lines "
                                            f"{first.start_mark.line + 1} and {key.start_mark.line + 1}); "
                                            "YAML would keep only the last: remove one"))
            sub = (*loc, key.value if isinstance(key, yaml.ScalarNode) else "?")
            children += [(key, sub), (value, sub)]
    elif isinstance(node, yaml.SequenceNode):
        children = [(item, (*loc, i)) for i, item in enumerate(node.value)]
    open_.add(id(node))
    total = 1 + sum(_expanded(child, sub, memo, open_, problems, p) for child, sub in children)
    open_.discard(id(node))
    memo[id(node)] = total
    return total


def _collect_lines(node: yaml.Node, loc: Loc, out: dict[Loc, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = loc + (key_node.value,)
            out[sub] = key_node.start_mark.line + 1
            _collect_lines(value_node, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[loc + (i,)] = item.start_mark.line + 1
            _collect_lines(item, loc + (i,), out)
