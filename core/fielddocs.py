"""What `--fields` and `--help` say of a config's fields: each field's description, read from
the `# comment` at the end of its line in the source (else the comment lines right above it), so
it lives in one place, beside the field; the section headings above fields; and the table of
every leaf with its default, the preset's value and its choices.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing
from collections.abc import Callable, Sequence
from typing import Any

from core.config import Presets, field_choices, set_value
from core.tree import field_default, leaves, shown, spelt

# comments that are tool pragmas, not descriptions
_PRAGMAS = ("fmt:", "noqa", "type:", "pragma", "ruff:")


def _class_comments(cls: type) -> dict[str, tuple[str, str]]:
    """{field: (description, section)} for the fields annotated in `cls`'s own body, from its
    source. The comment block right above a field heads a section (`# recipe`, `# data`) when
    the field has a comment of its own, or when it is one line and the next line is a field
    too; else it describes the field."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen app, a class made at run time)
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number -> comment text
    whole_line: set[int] = set()  # lines that are only a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            text = tok.string.lstrip("#").strip()
            if text.startswith(_PRAGMAS):
                continue
            comments[row] = text
            if not lines[row - 1][:col].strip():
                whole_line.add(row)
    node = ast.parse(source).body[0]
    fields = {
        item.lineno: item
        for item in getattr(node, "body", [])
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }
    found: dict[str, tuple[str, str]] = {}
    for item in fields.values():
        end = item.end_lineno or item.lineno
        rows = range(item.lineno, end + 1)
        own = " ".join(comments[r] for r in rows if r in comments and r not in whole_line)
        row, above = item.lineno - 1, []
        while row in whole_line:
            above.insert(0, comments[row])
            row -= 1
        heading = bool(above) and (bool(own) or (len(above) == 1 and end + 1 in fields))
        section = " ".join(above) if heading else ""
        found[item.target.id] = (own or ("" if heading else " ".join(above)), section)
    return found


@functools.cache
def _comments(config_cls: type) -> dict[str, tuple[str, str]]:
    """`_class_comments` over the classes that declare the fields (a redeclaration wins)."""
    found: dict[str, tuple[str, str]] = {}
    for cls in reversed(config_cls.__mro__):
        if cls is not object and dataclasses.is_dataclass(cls):
            found.update(_class_comments(cls))
    fields = dataclasses.fields(config_cls)  # one with no source line says it (core/parts.py)
    return {f.name: found.get(f.name, f.metadata.get("comment", ("", ""))) for f in fields}


def field_docs(config_cls: type) -> dict[str, str]:
    """Each field's one-line description, read from the source of the class that declares it
    (a subclass's redeclaration wins): the `# comment` at the end of the field's line, else the
    comment lines right above it (unless they head a section); "" when there is none."""
    return {name: doc for name, (doc, _) in _comments(config_cls).items()}


def field_sections(config_cls: type) -> dict[str, str]:
    """{field: the section heading above it} for each field that starts a section of the class
    body (`# recipe (docs/methods.md §3)` above `epochs`): how --fields and --help group the fields."""
    return {name: section for name, (_, section) in _comments(config_cls).items() if section}


def _section_doc(cls: type, name: str) -> str:
    """`name`: the first line of the section class's docstring (a section's --fields heading)."""
    doc = (cls.__doc__ or "").strip()
    own = doc and not doc.startswith(f"{cls.__name__}(")  # not the one @dataclass writes
    return f"{name}: {doc.splitlines()[0]}" if own else name


def _with_choices(doc: str, choices: Sequence[Any]) -> str:
    """A field's description, ending in its choices unless the comment names them all."""
    names = [set_value(c) for c in choices]
    # named = as a word of its own ("redrawn" does not name `redraw`)
    if all(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", doc) for name in names):
        return doc  # also: a field without choices
    listed = "one of: " + ", ".join(names)
    return f"{doc}; {listed}" if doc else listed


def other_spellings(config_cls: type) -> dict[str, list[str]]:
    """{path: the other keys --set takes for that leaf}: its flat name (config.json's, `LEGACY`)
    and a section of parts' shorthands, the part named (`objective.fedlas-ls.alpha`) or the
    picked part's (`objective.alpha (objective=fedlas-ls)`), then the same under the section's
    old name (`method.alpha (objective=fedlas-ls)`: the pick said by its new name), in the
    order core.config.parse_sets spells them."""
    found: dict[str, list[str]] = {}
    for flat, path in getattr(config_cls, "LEGACY", {}).items():
        found.setdefault(path, []).append(flat)
    for section in getattr(config_cls, "SECTIONS", ()):
        heads = [section.name, *([section.formerly] if section.formerly else [])]
        for part in section.names:
            for param, path in section.paths_of(part).items():
                # the shorthand is the picked part's parameter: say which picks make it this one
                pickers = [p for p in section.names if section.paths_of(p).get(param) == path]
                picks = f"({section.name}={'|'.join(pickers)})"
                words = found.setdefault(path, [])
                for head in heads:
                    for word in (f"{head}.{part}.{param}", f"{head}.{param} {picks}"):
                        if word.partition(" ")[0].replace("-", "_") != path and word not in words:
                            words.append(word)
    return found


def describe_fields(
    config_cls: type,
    presets: Presets | None = None,
    preset: str | None = None,
    spell: Callable[[str], str] = str,
    skip: Sequence[str] = (),
) -> list[str]:
    """One line per field (except `preset`, which --preset sets, and `skip`): its name as --set
    spells it, its default, the preset's value where it differs (values that apply `when`
    another field has a value say so), and its description (`field_docs`) with the field's
    choices (`field_choices`) where the description does not name them. A header first."""
    chosen: dict[str, Any] = {}
    label = ""
    if preset is not None and presets is not None:
        label, chosen = presets.lookup(preset)
    when = {
        c: {spelt(config_cls, k): v for k, v in values.items()}
        for c, values in chosen.pop("when", {}).items()
    }
    choices = field_choices(config_cls, {**chosen, **({"preset": label} if label else {})})
    chosen = {spelt(config_cls, k): v for k, v in chosen.items()}
    spellings = other_spellings(config_cls)
    rows, heads = [], set()
    for leaf in leaves(config_cls):
        head = leaf.path.partition(".")[0]
        if head in ("preset", *skip) or leaf.path in skip:
            continue
        doc, heading = _comments(leaf.owner).get(leaf.field.name, ("", ""))
        if "." in leaf.path and head not in heads:  # a section's first leaf: its heading
            heads.add(head)
            held = typing.get_type_hints(config_cls)[
                head
            ]  # the section's class, not a subsection's
            heading = " ".join(x for x in (_section_doc(held, head), heading) if x)
        name, default, named = leaf.path, field_default(leaf.field), shown(config_cls, leaf.path)
        own = [set_value(chosen[name])] if name in chosen and chosen[name] != default else []
        own += [f"{set_value(v[name])} when {c}" for c, v in when.items() if name in v]
        doc = _with_choices(doc, choices.get(named, ()))
        if spellings.get(name):  # the other words --set takes for it (a flat one says its path)
            doc = f"{doc}; also: {', '.join(spellings[name])}".lstrip("; ")
        rows.append((spell(named), set_value(default), "; ".join(own), doc, heading or None))
    header = ("field", "default", label, "description", None)
    # columns: name, default, the preset's value (only when some field has one), description
    columns = (0, 1, 2) if any(r[2] for r in rows) else (0, 1)
    width = {i: min(max(len(r[i]) for r in [header, *rows]), 40 if i == 0 else 24) for i in columns}

    def lines(row: tuple[str, str, str, str, str | None]) -> list[str]:
        cells = "  ".join([*(row[i].ljust(width[i]) for i in columns), row[3]]).rstrip()
        return [f"  -- {row[4]}"] * bool(row[4]) + [f"  {cells}"]  # a section's heading first

    return [text for row in [header, *rows] for text in lines(row)]
