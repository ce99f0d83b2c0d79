"""A part's own config (a loss, a generator backend): its parameters stated once, at the part.

A part declares its parameters as a frozen dataclass deriving from `Params`, each field made
with `param()`: the default, the bounds its check enforces, a one-line description. `Literal`
annotations are the choices. Building one checks it (`check_params`), so a bad value fails in
one line whoever builds it: the stage config, a test, a user's own code.

A stage config holds a section per kind of part (`Section`): train has `loss`, whose parts are
the losses' registry (models/objectives.OBJECTIVES), generate has `backend`, the generator
backends' (models/generators/registry.GENERATORS), annotate has `encoder`. The section derives
the config's leaves from the parts' parameters, so adding a loss or a backend adds its leaves,
checks, `--fields` rows and `--set` spellings with no table to edit: `Section.tree` makes the
section class (`cfg.loss.name`, then one subsection per loss, `cfg.loss.focal.gamma`),
`Section.within` adds the parameters to a section class of the config's own (finetune's
`maccal.q0`). A section names each leaf by its path; config.json records it under the key
the part declares, `<prefix>_<param>` (`focal_gamma`), as it has since the first run, so a
run's identity keeps its bytes: that key reaches the stage's LEGACY through `Section.legacy`
and is read by the codec alone (core/codec.py).
On the command line a section also takes `loss.gamma=2` (the parameter of the loss the config
picks: its last --set, else the preset's, else the default) and `loss.focal.gamma=2` (a named
loss's, whichever is picked); core.config.parse_sets asks the config class's `SECTIONS` to
spell those as paths.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from core.config import (
    IDENTITY,
    OFF_DEFAULT,
    ConfigError,
    check_choice,
    check_range,
    did_you_mean,
    renamed,
)
from core.tree import PICK, get


def param(
    default: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    high_open: bool = False,
    doc: str = "",
    field: str = "",
    section: str = "",
    data: bool = False,
    identity: str = "",
) -> Any:
    """One parameter of a part. `low`/`high`: the range `check_params` enforces (closed;
    `high_open`: high excluded, label smoothing's α < 1); `doc`:
    its description in --fields; `field`: the key config.json records it under when that is not
    `<prefix>_<name>` (names older than the parts: `mbls_margin` for MbLS' m); `section`: a
    heading --fields shows above it; `data`: the stage reads it (how it loads the mixed set:
    csm's sharpening) and the part's builder does not; `identity`: its leaf's rule in
    config.json (core.config: OFF_DEFAULT for a parameter added after runs were recorded)."""
    meta: dict[str, Any] = dict(low=low, high=high, doc=doc, field=field, section=section)
    meta["high_open"] = high_open
    meta |= {"data": data, **({IDENTITY: identity} if identity else {})}
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def choices(cls: type, name: str) -> tuple[Any, ...]:
    """The values a `Literal[...]` parameter takes; () for any other."""
    hint = _hints(cls)[name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def check_params(cls: type, values: Mapping[str, Any], spell: Callable[[str], str] = str) -> None:
    """The checks `param()` and `Literal` declare, on `values` {param: value}; errors name each
    parameter as `spell(name)` (its leaf's path)."""
    for f in dataclasses.fields(cls):
        value = values[f.name]
        if choices(cls, f.name):
            check_choice(spell(f.name), value, choices(cls, f.name))
        if f.metadata.get("low") is not None or f.metadata.get("high") is not None:
            low, high = f.metadata["low"], f.metadata["high"]
            check_range(spell(f.name), value, low, high, high_open=f.metadata["high_open"])
    check_values = getattr(cls, "check_values", None)
    if check_values is not None:
        check_values(values, spell)


@dataclass(frozen=True)
class Params:
    """Base of a part's parameters: a frozen dataclass whose fields are `param()`s."""

    def __post_init__(self) -> None:
        check_params(type(self), vars(self))

    @classmethod
    def check_values(cls, values: Mapping[str, Any], spell: Callable[[str], str]) -> None:
        """A part's checks that `param()` cannot state (sd's prompt template must name the
        class), run after the declared ones: raise a one-line ConfigError naming the parameter
        as `spell(name)`. None by default."""

    @classmethod
    def build(cls, part: str, **values: Any) -> Params:
        """`cls(**values)`, an unknown name refused naming the part's parameters."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{part} takes params {known or 'none'}; got unknown {unknown}")
        return cls(**values)


class Part(Protocol):
    """What a section needs of a registry entry (models/objectives.LossEntry,
    models/generators/registry.Backend)."""

    params: type[Params]
    prefix: str  # config.json records its parameters as `<prefix>_<param>`
    # its parameters recorded in every run's config.json (the parts older than this rule); else only
    # off their default (core.config OFF_DEFAULT), so registering a part keeps the bytes, and the
    # identity, of every run recorded before
    every_run: bool


@dataclass(frozen=True)
class Derived:
    """One leaf a section derives: a parameter of one or more parts."""

    param: str
    hint: Any
    field: dataclasses.Field
    parts: tuple[str, ...]  # the parts that have it (mmce's λ: mmce and mmce_weighted)
    # the key config.json records it under (`focal_gamma`): the parts' one word for a parameter
    # they share, read by the codec through `Section.legacy` (core/codec.py)
    recorded: str
    path: str = ""  # its leaf in the config tree (`loss.focal.gamma`), once `tree`/`within` put it


class Section:
    """A stage config's section for one kind of part: `name` is both the config field that
    holds it (`loss`) and its --set prefix (`loss.gamma=2`); `parts` is the registry, read once,
    when the section is made (plugins register first: pipeline/plugins.py). `tree` or `within`
    puts the parts' parameters in the config tree; from then on `derived` holds each leaf by its
    path (`loss.focal.gamma`), and `legacy` {config.json's key: path} is all the section says of
    the recorded names (the stage's LEGACY: the codec's, and the rename table of old --set
    spellings)."""

    def __init__(self, name: str, parts: Mapping[str, Part], heading: str = "") -> None:
        self.name, self.heading = name, heading
        self.default: Any = None  # the config's default part
        self.parts: dict[str, Part] = dict(parts)
        self.derived: dict[str, Derived] = {}  # {path: leaf}, once placed (`tree`, `within`)
        self.legacy: dict[str, str] = {}  # {config.json's key: path}, once placed
        self.picking = False  # its tree section has a `name` leaf that picks the part (`tree`)
        # the name --set knew the section by before (finetune's `method`, now `objective`):
        # `method.q0=0.7` is still taken, saying the new name once (`unnest`)
        self.formerly = ""
        # the parts' parameters, one per recorded key: two parts' parameters recorded under one
        # key are one leaf (a shared one sits with its last part, as it always has)
        shared: dict[str, Derived] = {}
        for part, entry in self.parts.items():
            for f in dataclasses.fields(entry.params):
                recorded = f.metadata.get("field") or f"{entry.prefix}_{f.name}"
                hint = _hints(entry.params)[f.name]
                seen = shared.pop(recorded, None)
                if seen and (seen.param, seen.field.default, seen.hint) != (
                    f.name,
                    f.default,
                    hint,
                ):
                    raise TypeError(
                        f"{recorded}: {seen.parts} and {part!r} differ in name, type or default"
                    )
                owners = (*seen.parts, part) if seen else (part,)
                shared[recorded] = Derived(f.name, hint, f, owners, recorded)
        self._params = tuple(shared.values())

    @classmethod
    def joined(cls, name: str, *sections: Section, formerly: str = "") -> Section:
        """A section over the parts of `sections`, each already placed, whose leaves stay where
        those put them: finetune's `objective` spells `objective.q0` as MaC-Cal's `maccal.q0`
        and `objective.alpha` as the picked FeDLaS loss's `loss.fedlas_ls.alpha`; `formerly`:
        the section's old name, still taken (`method.q0`)."""
        joined = cls(name, {part: entry for s in sections for part, entry in s.parts.items()})
        joined.formerly = formerly
        for s in sections:
            joined.derived |= s.derived
            joined.legacy |= s.legacy
        return joined

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.parts)

    def _place(self, at: Mapping[str, Derived]) -> None:
        """Put the parameters at their leaves {path: parameter}: `derived` lists them in the
        parts' order (a shared one with its last part), so a part's parameters keep the order
        they have always come in (`params()`)."""
        self.legacy |= {d.recorded: path for path, d in at.items()}
        where = {d.recorded: path for path, d in at.items()}
        self.derived |= {
            where[d.recorded]: dataclasses.replace(d, path=where[d.recorded])
            for d in self._params
            if d.recorded in where
        }

    def paths_of(self, part: str, data: bool = True) -> dict[str, str]:
        """{param: its leaf's path} of a part (`data=False`: what its builder takes)."""
        return {
            d.param: path
            for path, d in self.derived.items()
            if part in d.parts and (data or not d.field.metadata["data"])
        }

    def tree(self, default: str, module: str, doc: str = "", pick: bool = True) -> type:
        """The section class a config holds this section in (train's `loss`): `name` picks the
        part (its docs `doc`; set as `loss=focal`, recorded as `loss`: core.tree.PICK), then a
        subsection per part, the part's name with `_` for `-`, holding the parameters it
        declares first (`loss.focal.gamma`): a parameter that several parts share (mmce's λ) is
        one leaf, at its first part. Building one runs every part's checks. `module` assigns
        the class to its name, the section's titled (`Loss`), so a config pickles (its
        subsections: `Loss.Csm`). `pick=False`: no `name` leaf, another field picks the part
        (finetune's `loss` holds the FeDLaS losses' parameters at train's paths; its `objective`
        picks)."""
        self.default, self.picking, section = default, pick, self
        subsections, placed = [], {}
        for part in self.parts:
            key = part.replace("-", "_")
            if key == PICK:
                raise TypeError(f"a {self.name} named {part!r} would hide {self.name}.{PICK}")
            own = [d for d in self._params if d.parts[0] == part]
            if not own:  # ce: no parameters, no subsection
                continue
            placed |= {f"{self.name}.{key}.{d.param}": d for d in own}
            leaves = [(d.param, d.hint, self._leaf(d)) for d in own]
            sub = dataclasses.make_dataclass(key.title().replace("_", ""), leaves, frozen=True)
            sub.__doc__ = f"{self.name}={part}'s parameters" if pick else f"{part}'s parameters"
            subsections.append((key, sub, dataclasses.field(default_factory=sub)))
        self._place(placed)

        def __post_init__(picked: Any) -> None:
            section.check_tree(picked)

        def params(held: Any, data: bool = False, part: str = "") -> dict[str, Any]:
            """A part's parameters {param: value}: the picked one's, else `part`'s
            (`data=False`: what its builder takes)."""
            paths = section.paths_of(part or held.name, data)
            return {p: section.read(held, path) for p, path in paths.items()}

        name = (PICK, str, dataclasses.field(default=default, metadata={"comment": (doc, "")}))
        namespace: dict[str, Any] = {"__post_init__": __post_init__, "params": params}
        if pick:
            namespace["PARTS"] = self.parts  # core.tree.picks: `loss=focal` is loss.name
        cls = dataclasses.make_dataclass(
            self.name.title(), [name] * pick + subsections, frozen=True, namespace=namespace
        )
        cls.__doc__, cls.__module__ = self.heading or self.name, module
        for _, sub, _ in subsections:
            sub.__module__, sub.__qualname__ = module, f"{cls.__name__}.{sub.__name__}"
            setattr(cls, sub.__name__, sub)
        return cls

    def within(self, path: str) -> Callable[[type], type]:
        """A class decorator, under `@dataclass`: the parts' parameters as leaves of the
        decorated section class, after its own fields, each under its parameter's name
        (finetune's `maccal` section: its epochs, lr and r, then the retention schedule's q0,
        `maccal.q0`); `path` is the section's field in the config. Building one runs the parts'
        checks, each parameter named by its path."""
        section = self

        def insert(cls: type) -> type:
            own = inspect.get_annotations(cls)
            for d in self._params:
                if d.param in own:
                    raise TypeError(f"{cls.__name__} already has a field {d.param!r}")
                own[d.param] = d.hint
                setattr(cls, d.param, self._leaf(d))
            self._place({f"{path}.{d.param}": d for d in self._params})
            cls.__annotations__ = own
            checked = cls.__dict__.get("__post_init__")

            def __post_init__(built: Any) -> None:
                if checked is not None:
                    checked(built)
                section.check_tree(built)

            cls.__post_init__ = __post_init__
            return cls

        return insert

    def _leaf(self, d: Derived) -> dataclasses.Field:
        """A derived leaf: its part's metadata, what --fields shows, its rule in config.json."""
        meta = dict(d.field.metadata, part=self.name, parts=d.parts)
        meta["comment"] = (meta["doc"], meta["section"])  # what --fields shows (core.fielddocs)
        if not any(self.parts[p].every_run for p in d.parts):
            meta.setdefault(IDENTITY, OFF_DEFAULT)
        return dataclasses.field(default=d.field.default, metadata=meta)

    @staticmethod
    def read(held: Any, path: str) -> Any:
        """The leaf `path` of the section object `held`, the config's field that holds it (its
        path less the field's name: `loss.focal.gamma` of a config's `loss`)."""
        return get(held, path.partition(".")[2])

    def check_tree(self, held: Any) -> None:
        """The section's checks: its `name` one of the parts (a picking one), every part's
        parameters as their dataclasses declare, each named by its path."""
        if self.picking:
            check_choice(self.name, held.name, self.names)
        for part, entry in self.parts.items():
            paths = self.paths_of(part)
            values = {p: self.read(held, path) for p, path in paths.items()}
            check_params(entry.params, values, paths.__getitem__)

    def unnest(
        self, sets: Sequence[str], known: Mapping[str, Any], spell: Callable[[str], str]
    ) -> list[str]:
        """--set values with this section's dotted keys spelt as paths: `loss.name` (or
        `objective.name`: the field `objective`, which picks but is no tree section), `loss.gamma`
        -> the picked loss's `loss.focal.gamma` (`known`: the preset's values, by path), and
        `objective.fedlas-ls.alpha` -> `loss.fedlas_ls.alpha`. The section's old name
        (`formerly`) is taken for its name, in a dotted key or as the picking field, saying the
        new name once (`method.q0=0.7`: `method is now objective`; the picking field `method=`
        itself is the stage's LEGACY, said by core.config.parse_sets under the same name).
        Other values pass as they are."""
        heads = (self.name, self.formerly) if self.formerly else (self.name,)
        picking = {*heads, *(f"{head}.{PICK}" for head in heads)}
        items = [(item.partition("=")[0].strip().replace("-", "_"), item) for item in sets]
        picked = str(known.get(self.name, known.get(f"{self.name}.{PICK}", self.default)))
        for key, item in items:
            if key in picking:
                picked = item.partition("=")[2]
        spelt = []
        for key, item in items:
            head, dot, rest = key.partition(".")
            if head in heads and dot and "=" in item:
                if head != self.name:
                    renamed(head, spell(head), spell(self.name))
                item = f"{self._path(rest, picked, spell, head)}={item.partition('=')[2]}"
            spelt.append(item)
        return spelt

    def _path(self, rest: str, picked: str, spell: Callable[[str], str], typed: str = "") -> str:
        """The leaf `<section>.<rest>` names: `rest` a parameter of the picked part, or
        `<part>.<param>`; a one-line ConfigError naming the key as typed (`typed`: the
        section's name as typed, its old one or its own) when there is none."""
        if rest == PICK:
            return f"{self.name}.{PICK}" if self.picking else self.name
        part, dot, p = rest.rpartition(".")
        by_key = {name.replace("-", "_"): name for name in self.parts}
        part = by_key.get(part, part) if dot else picked
        key = f"{spell(typed or self.name)}.{rest}"
        if not dot and part not in self.parts:
            raise ConfigError(f"{key}: {self.name}={part} has no parameters to set this way")
        if part not in self.parts:
            raise ConfigError(
                f"{key}: no {self.name} {part!r}; {did_you_mean(part, self.names)}choose one "
                f"of: {', '.join(self.names)}"
            )
        paths = self.paths_of(part)
        if p not in paths:
            has = ", ".join(paths) or "none"
            raise ConfigError(
                f"{key}: {self.name} {part!r} has no parameter {p!r}; "
                f"{did_you_mean(p, paths)}its parameters: {has}"
            )
        return paths[p]
