"""The failure knowledge base: one TOML file per failure class under ``kb/``.

Classes are data so that adding a failure mode never touches the engine: a file names the class,
its signatures (regexes with a literal ``anchor`` that the fast prefilter looks for) and the
advice that the report prints.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ckptguard.diagnose.literals import AnchorIndex, searcher
from ckptguard.diagnose.rules import Rules, load_rules
from ckptguard.diagnose.schema import ClassEntry, KBError, convert_class, decode_class

__all__ = [
    "FailureClass",
    "KBError",
    "KnowledgeBase",
    "Match",
    "Restart",
    "Signature",
    "Unproven",
    "load_kb",
    "load_kb_dir",
    "parse_class",
]


@dataclass(frozen=True)
class Signature:
    """One way a failure class shows in a log line or an exception."""

    class_id: str
    pattern: re.Pattern[str]
    on: str
    weight: float
    anchor: str | None = None
    context: re.Pattern[str] | None = None
    prefilter: bool = False
    #: ``bool(pattern.search(text))``, at a fraction of its cost (see `literals`)
    test: Callable[[str], bool] = field(default=lambda _t: False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "test", searcher(self.pattern))


@dataclass(frozen=True)
class Unproven:
    """How to report a class that the log only implies (no signature of ``proof_weight`` or more
    matched, e.g. a SIGKILL with no out-of-memory message): what it cannot show, and a cap on the
    confidence."""

    proof_weight: float
    title: str
    root_cause: str
    confirm: tuple[str, ...]
    confidence_cap: float
    fix: str = ""


@dataclass(frozen=True)
class Restart:
    """Whether a failure of the class is worth restarting (``[restart]``), and why."""

    transient: bool
    why: str
    unproven_transient: bool | None = None


@dataclass(frozen=True)
class FailureClass:
    """A failure class as the report explains it."""

    id: str
    title: str
    category: str
    collateral: bool
    summary: str
    root_cause: str
    mechanism: str
    symptoms: tuple[str, ...]
    affected: tuple[str, ...]
    confirm: tuple[str, ...]
    fix: str
    prevention: tuple[str, ...]
    verify_command: str
    related: tuple[str, ...]
    weak: bool = False
    checkpointer_prevents: bool = False
    references: tuple[str, ...] = ()
    signatures: tuple[Signature, ...] = field(default=(), repr=False)
    unproven: Unproven | None = None
    #: The class of the users' taxonomy that this finer class belongs to (None: its own family).
    #: Users file an argparse error or a missing module under the generic exception, a lost peer
    #: under the network error: the report answers the family and keeps this class as its kind.
    family: str | None = None
    restart: Restart = Restart(False, "")

    @property
    def family_id(self) -> str:
        """The class the report answers for this one (itself unless it declares a family)."""
        return self.family or self.id

    def as_dict(self) -> dict[str, object]:
        """The entry as plain data (for `explain --json`)."""
        return {
            "id": self.id,
            "title": self.title,
            "category": self.category,
            "collateral": self.collateral,
            "weak": self.weak,
            "checkpointer_prevents": self.checkpointer_prevents,
            "summary": self.summary,
            "mechanism": self.mechanism.strip(),
            "symptoms": list(self.symptoms),
            "affected": list(self.affected),
            "confirm": list(self.confirm),
            "fix": self.fix.strip(),
            "prevention": list(self.prevention),
            "verify_command": self.verify_command,
            "related": list(self.related),
            "references": list(self.references),
            "family": self.family_id,
            "restart": {"transient": self.restart.transient, "why": self.restart.why},
            "signatures": [
                {
                    "on": s.on,
                    "pattern": s.pattern.pattern,
                    "anchor": s.anchor,
                    "weight": s.weight,
                    "context": s.context.pattern if s.context else None,
                }
                for s in self.signatures
            ],
        }


@dataclass(frozen=True)
class Match:
    """A signature that matched: which class, how strongly."""

    class_id: str
    weight: float


class KnowledgeBase:
    """All failure classes, plus fast matching of texts against their signatures."""

    def __init__(self, classes: dict[str, FailureClass], rules: Rules | None = None) -> None:
        self.classes = classes
        self._rules = rules
        by_anchor: dict[str | None, list[Signature]] = {}
        for fc in classes.values():
            for sig in fc.signatures:
                by_anchor.setdefault(sig.anchor, []).append(sig)
        # Anchors are checked with `in` before any regex runs: most texts skip most regexes.
        self._groups = sorted(by_anchor.items(), key=lambda kv: kv[0] or "")
        self._always = by_anchor.get(None, [])
        self._anchored = {a: sigs for a, sigs in self._groups if a is not None}
        self._index = AnchorIndex(list(self._anchored))  # in the order of `_groups`

    def __getitem__(self, class_id: str) -> FailureClass:
        return self.classes[class_id]

    def __contains__(self, class_id: object) -> bool:
        return class_id in self.classes

    def family(self, class_id: str) -> str:
        """The users' class that ``class_id`` is answered as (see ``FailureClass.family``)."""
        return self.classes[class_id].family_id

    @property
    def rules(self) -> Rules:
        """The engine rules (``_rules.toml``) that go with these classes."""
        if self._rules is None:
            raise KBError("this knowledge base has no _rules.toml")
        return self._rules

    def anchors(self) -> set[str]:
        """Anchors of signatures marked ``prefilter = true`` and of the rules: lines that carry
        none of the structural anchors (no error, exception, signal...) and must still be read.
        Every line the prefilter lets through costs parsing: generic words are never anchors."""
        out = {s.anchor for _, sigs in self._groups for s in sigs if s.prefilter and s.anchor}
        return out | (self._rules.anchors() if self._rules is not None else set())

    def match(self, text: str, *, exception: bool, context: str = "") -> list[Match]:
        """Best weight per class for ``text`` (an exception ``Type: message`` or a log line)."""
        best: dict[str, float] = {}
        groups = [self._always, *map(self._anchored.__getitem__, self._index.present(text))]
        for sigs in groups:
            for sig in sigs:
                if sig.on == "exception" and not exception:
                    continue
                if sig.on == "line" and exception:
                    continue
                if best.get(sig.class_id, 0.0) >= sig.weight:
                    continue
                if not sig.test(text):
                    continue
                if sig.context is not None and not sig.context.search(f"{text}\n{context}"):
                    continue
                best[sig.class_id] = sig.weight
        return sorted((Match(c, w) for c, w in best.items()), key=lambda m: -m.weight)


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise KBError(f"{where}: bad regex {pattern!r}: {exc}") from exc


def parse_class(data: dict[str, object] | ClassEntry, where: str) -> FailureClass:
    """Validate one KB entry (against the schema, then what a type cannot say) and compile its
    signatures."""
    entry = data if isinstance(data, ClassEntry) else convert_class(data, where)
    cid = entry.id
    if not re.fullmatch(r"[a-z][a-z0-9_]*", cid):
        raise KBError(f"{where}: id {cid!r} is not snake_case")
    sigs = []
    for i, raw in enumerate(entry.signatures):
        swhere = f"{where} signature {i}"
        if not 0.0 < raw.weight <= 1.0:
            raise KBError(f"{swhere}: weight must be in (0, 1]")
        sigs.append(
            Signature(
                cid,
                _compile(raw.pattern, swhere),
                raw.on,
                raw.weight,
                raw.anchor or None,
                _compile(raw.context, swhere) if raw.context is not None else None,
                raw.prefilter,
            )
        )
    if not sigs:
        raise KBError(f"{where}: a class needs at least one signature")
    u = entry.unproven
    unproven = (
        Unproven(u.proof_weight, u.title, u.root_cause, tuple(u.confirm), u.confidence_cap, u.fix)
        if u is not None
        else None
    )
    return FailureClass(
        id=cid,
        title=entry.title,
        category=entry.category,
        collateral=entry.collateral,
        summary=entry.summary,
        root_cause=entry.root_cause,
        mechanism=entry.mechanism,
        symptoms=tuple(entry.symptoms),
        affected=tuple(entry.affected),
        confirm=tuple(entry.confirm),
        fix=entry.fix,
        prevention=tuple(entry.prevention),
        verify_command=entry.verify_command,
        related=tuple(entry.related),
        weak=entry.weak,
        checkpointer_prevents=entry.checkpointer_prevents,
        references=tuple(entry.references),
        signatures=tuple(sigs),
        unproven=unproven,
        family=entry.family,
        restart=_restart(entry, where),
    )


def _restart(entry: ClassEntry, where: str) -> Restart:
    r = entry.restart
    if not r.why.strip():
        raise KBError(f"{where}: [restart] why must say why the class is (or is not) transient")
    if r.unproven_transient is not None and entry.unproven is None:
        raise KBError(f"{where}: [restart] unproven_transient needs an [unproven] table")
    return Restart(r.transient, " ".join(r.why.split()), r.unproven_transient)


def load_kb_dir(directory: Path) -> KnowledgeBase:
    """Load and cross-check every ``*.toml`` in ``directory``."""
    classes: dict[str, FailureClass] = {}
    for path in sorted(directory.glob("*.toml")):
        if path.name.startswith("_"):
            continue  # engine rules, not a class
        fc = parse_class(decode_class(path.read_bytes(), path.name), path.name)
        if fc.id != path.stem:
            raise KBError(f"{path.name}: id {fc.id!r} must match the file name")
        classes[fc.id] = fc
    for fc in classes.values():
        unknown = [r for r in fc.related if r not in classes]
        if unknown:
            raise KBError(f"{fc.id}.toml: related classes {unknown} do not exist")
        if fc.family is not None:
            fam = classes.get(fc.family)
            if fam is None or fam.family is not None or fam.id == fc.id:
                raise KBError(
                    f"{fc.id}.toml: family {fc.family!r} must be another class of the KB that "
                    "declares no family of its own"
                )
    if "python_exception" not in classes:
        raise KBError("the KB needs the fallback class python_exception")
    rules_path = directory / "_rules.toml"
    return KnowledgeBase(classes, load_rules(rules_path, set(classes)) if rules_path.exists() else None)


@lru_cache(maxsize=1)
def load_kb() -> KnowledgeBase:
    """The knowledge base shipped with the package (cached: it is read once per process)."""
    with resources.as_file(resources.files("ckptguard.diagnose") / "kb") as kb_dir:
        return load_kb_dir(Path(kb_dir))
