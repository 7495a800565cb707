"""The engine's knowledge that is not one failure class, read from ``kb/_rules.toml``.

Launcher exit formats, the signal table, causality between classes, the cross-rank rules and
the confidence factors are data: a new launcher or a new cause-and-consequence pair is a TOML
edit, checked here against the classes of the knowledge base.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path

from ckptguard.diagnose.prefixes import parse_timestamp
from ckptguard.diagnose.schema import KBError


@dataclass(frozen=True)
class Alternative:
    """A competing explanation that an exit by this signal always leaves open."""

    class_id: str
    label: str
    title: str
    score: float
    why_not: str


@dataclass(frozen=True)
class SignalRule:
    """What an exit by one signal, with no message of its own, most likely means."""

    number: int
    name: str
    class_id: str
    weight: float
    alternatives: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class ExitWord:
    """A word srun / mpirun / shells print for how a task ended."""

    word: str
    signal: int
    class_id: str | None = None
    weight: float | None = None


@dataclass(frozen=True)
class LauncherFormat:
    """A line in which a launcher reports a worker's exit."""

    name: str
    anchor: str
    pattern: re.Pattern[str]
    rank_reliable: bool = True
    # the rank it names is the *last* local rank started (DeepSpeed, torch.distributed.launch):
    # it is the failed one only when it is local rank 0, i.e. the only process there was
    last_local: bool = False
    code_cut: bool = False  # the line is the report with its exit code cut off (a pasted excerpt)


@dataclass(frozen=True)
class RankHint:
    """A message that names its writer's rank (``source`` is a RankSource value)."""

    source: str
    anchor: str
    pattern: re.Pattern[str]


@dataclass(frozen=True)
class RankReport:
    """torch's own statement of which ranks held the others up."""

    anchor: str
    pattern: re.Pattern[str]


@dataclass(frozen=True)
class RaceRule:
    """Several ranks working on, or failing on, one checkpoint path."""

    class_id: str
    upgrade_from: frozenset[str]
    min_ranks: int
    weight: float
    anchors: tuple[str, ...]
    announce: re.Pattern[str]
    same_error: re.Pattern[str]


@dataclass(frozen=True)
class Operation:
    """What a traceback's frames show was being done (saving, rotating, loading a checkpoint,
    passing file descriptors, scaling the loss...), and the failure of that operation that is the
    most likely when the exception line itself names nothing specific: a traceback cut before its
    exception line, or a generic exception type of the operation's ``errors`` family."""

    name: str
    frames: re.Pattern[str] | None  # None: only a line announcing it names the operation
    class_id: str
    weight: float
    depth: int = 0  # innermost frames (and their source lines) looked at; 0 = all
    errors: re.Pattern[str] | None = None  # "Type: message" of generic exceptions that count
    nonleader_class: str | None = None  # the class when a rank other than 0 did it
    # a log line announcing the operation (``Restoring states from ...``): it names what a cut
    # traceback right after it was doing when its frames show nothing
    announce: re.Pattern[str] | None = None
    announce_anchors: tuple[str, ...] = ()
    # the class when the log's own dates are on or after ``since`` (a library's changed default)
    since: float | None = None
    since_class: str | None = None
    # the class when the frames are Windows paths (where a write fails with EACCES, not ENOSPC)
    windows_class: str | None = None

    def matches(self, frames: list[str], code: list[str]) -> bool:
        """Do these frames (``file:func``) and source lines show this operation?"""
        if self.depth:
            frames, code = frames[-self.depth :], code[-self.depth :]
        return (
            bool(frames or code)
            and self.frames is not None
            and self.frames.search("\n".join([*frames, *code])) is not None
        )

    def class_for(self, rank: int | None, *, latest: float | None = None, windows: bool = False) -> str:
        """Several ranks doing what one leader should do is the race, whatever the errno; a log
        dated after the library's default changed, or a Windows machine, has its own likeliest
        failure of the operation."""
        return self.decide(rank, latest=latest, windows=windows)[0]

    def decide(self, rank: int | None, *, latest: float | None = None, windows: bool = False) -> tuple[str, str]:
        """The class, and what beyond the operation decided it (for the report)."""
        if self.nonleader_class and rank not in (None, 0):
            return self.nonleader_class, f"rank {rank}, not a leader, did it"
        if self.since_class and self.since is not None and latest is not None and latest >= self.since:
            return self.since_class, "the log's own dates are after the library's default changed"
        if self.windows_class and windows:
            return self.windows_class, "the paths are Windows paths"
        return self.class_id, ""


@dataclass(frozen=True)
class SilentExit:
    """A worker that the launcher reports dead, its exit code cut off, after memory figures and
    with no message of its own: what most likely killed it (unless the log shows a deliberate
    stop)."""

    class_id: str
    weight: float
    memory: re.Pattern[str]
    memory_anchors: tuple[str, ...]
    within: int  # lines between the last memory figure and the launcher's report
    deliberate: re.Pattern[str]
    deliberate_anchors: tuple[str, ...]


@dataclass(frozen=True)
class Rules:
    """Everything in ``_rules.toml``, validated."""

    signals: dict[int, SignalRule]
    unknown_signal: tuple[str, float]
    nonzero_exit: tuple[str, float]
    exit_words: tuple[ExitWord, ...]
    launchers: tuple[LauncherFormat, ...]
    launcher_frames: re.Pattern[str]
    rank_hints: tuple[RankHint, ...]
    rank_reports: tuple[RankReport, ...]
    blame_reports: tuple[RankReport, ...]
    causes: dict[str, frozenset[str]]
    race: RaceRule
    desync_class: str
    desync_pattern: re.Pattern[str]
    desync_weight: float
    progress: re.Pattern[str] | None
    progress_anchors: tuple[str, ...]
    progress_requires: frozenset[str]
    collateral_priority: tuple[str, ...]
    alone_means: dict[str, str]
    single_reporter: frozenset[str]
    hints: tuple[re.Pattern[str], ...]
    warning_levels: tuple[re.Pattern[str], ...] = ()
    operations: tuple[Operation, ...] = ()
    traceback_owners: tuple[re.Pattern[str], ...] = ()
    silent_exit: SilentExit | None = None
    confidence: dict[str, float] = field(default_factory=dict)
    rank_factor: dict[str, float] = field(default_factory=dict)
    ordering_factor: dict[str, float] = field(default_factory=dict)
    same_failure_factor: dict[str, float] = field(default_factory=dict)

    def signal_by_name(self, name: str) -> int | None:
        """SIGKILL -> 9 (None for a name the table does not know)."""
        return next((n for n, s in self.signals.items() if s.name == name), None)

    def anchors(self) -> set[str]:
        """Literals that the prefilter must let through for these rules to see their lines."""
        out = {lf.anchor for lf in self.launchers} | {r.anchor for r in self.rank_reports}
        out |= set(self.race.anchors)  # rank hints only read lines that are events already
        out |= set(self.progress_anchors)
        for op in self.operations:
            out |= set(op.announce_anchors)
        if self.silent_exit is not None:
            out |= set(self.silent_exit.memory_anchors) | set(self.silent_exit.deliberate_anchors)
        return out

    def explained(self, cls: str, present: set[str]) -> bool:
        """Is ``cls`` a known consequence of another class in ``present``?"""
        return any(cls in self.causes.get(c, ()) for c in present if c != cls)


def _re(value: object, where: str) -> re.Pattern[str]:
    if not isinstance(value, str):
        raise KBError(f"_rules.toml {where}: a regex string is required")
    try:
        return re.compile(value)
    except re.error as exc:
        raise KBError(f"_rules.toml {where}: bad regex {value!r}: {exc}") from exc


def _date(value: object, where: str) -> float:
    """``YYYY-MM-DD`` as the engine's timestamps count it (naive seconds)."""
    ts, _ = parse_timestamp(f"{value} 00:00:00", 2000)
    if ts is None:
        raise KBError(f"_rules.toml {where}: {value!r} is not a YYYY-MM-DD date")
    return ts


def _need(kb: Container[str], cls: str, where: str) -> str:
    if cls not in kb:
        raise KBError(f"_rules.toml {where}: unknown class {cls!r}")
    return cls


def parse_rules(data: dict[str, object], kb: Container[str]) -> Rules:
    """Validate the rules against the KB's class ids and compile their regexes."""
    d: dict = data  # type: ignore[type-arg]
    try:
        signals = {}
        for s in d["signal"]:
            alts = tuple(
                Alternative(
                    _need(kb, a["class"], "signal alternative"), a["label"], a["title"], float(a["score"]), a["why_not"]
                )
                for a in s.get("alternatives", [])
            )
            signals[int(s["number"])] = SignalRule(
                int(s["number"]), s["name"], _need(kb, s["class"], "signal"), float(s["weight"]), alts
            )
        ex = d["exits"]
        words = tuple(
            ExitWord(
                w["word"],
                int(w["signal"]),
                _need(kb, w["class"], "exit_word") if "class" in w else None,
                float(w["weight"]) if "weight" in w else None,
            )
            for w in d["exit_word"]
        )
        launchers = tuple(
            LauncherFormat(
                x["name"],
                x["anchor"],
                _re(x["pattern"], x["name"]),
                x.get("rank", "reported") == "reported",
                x.get("rank", "reported") == "last-local",
                bool(x.get("code_cut", False)),
            )
            for x in d["launcher"]
        )
        hints = tuple(RankHint(h["source"], h["anchor"], _re(h["pattern"], "rank_hint")) for h in d["rank_hint"])
        reports = tuple(RankReport(r["anchor"], _re(r["pattern"], "rank_report")) for r in d["rank_report"])
        blames = tuple(RankReport(r["anchor"], _re(r["pattern"], "blame_report")) for r in d.get("blame_report", []))
        causes = {
            _need(kb, c["class"], "cause"): frozenset(_need(kb, x, "cause") for x in c["explains"]) for c in d["cause"]
        }
        r = d["race"]
        race = RaceRule(
            _need(kb, r["class"], "race"),
            frozenset(_need(kb, x, "race") for x in r["upgrade_from"]),
            int(r["min_ranks"]),
            float(r["weight"]),
            tuple(r["anchors"]),
            _re(r["announce"], "race.announce"),
            _re(r["same_error"], "race.same_error"),
        )
        operations = tuple(
            Operation(
                o["name"],
                _re(o["frames"], f"operation {o['name']}") if "frames" in o else None,
                _need(kb, o["class"], "operation"),
                float(o["weight"]),
                int(o.get("depth", 0)),
                _re(o["errors"], f"operation {o['name']} errors") if "errors" in o else None,
                _need(kb, o["nonleader_class"], "operation") if "nonleader_class" in o else None,
                _re(o["announce"], f"operation {o['name']} announce") if "announce" in o else None,
                tuple(o.get("announce_anchors", ())),
                _date(o["since"], f"operation {o['name']} since") if "since" in o else None,
                _need(kb, o["since_class"], "operation") if "since_class" in o else None,
                _need(kb, o["windows_class"], "operation") if "windows_class" in o else None,
            )
            for o in d.get("operation", [])
        )
        se = d.get("silent_exit")
        silent = (
            SilentExit(
                _need(kb, se["class"], "silent_exit"),
                float(se["weight"]),
                _re(se["memory"], "silent_exit.memory"),
                tuple(se["memory_anchors"]),
                int(se["within"]),
                _re(se["deliberate"], "silent_exit.deliberate"),
                tuple(se["deliberate_anchors"]),
            )
            if se is not None
            else None
        )
        co = d["collateral_only"]
        conf = d["confidence"]
        return Rules(
            signals=signals,
            unknown_signal=(_need(kb, ex["unknown_signal"]["class"], "exits"), float(ex["unknown_signal"]["weight"])),
            nonzero_exit=(_need(kb, ex["nonzero_exit"]["class"], "exits"), float(ex["nonzero_exit"]["weight"])),
            exit_words=words,
            launchers=launchers,
            launcher_frames=_re(d["launcher_traceback"]["frames"], "launcher_traceback"),
            rank_hints=hints,
            rank_reports=reports,
            blame_reports=blames,
            causes=causes,
            race=race,
            desync_class=_need(kb, d["desync"]["class"], "desync"),
            desync_pattern=_re(d["desync"]["pattern"], "desync"),
            desync_weight=float(d["desync"]["weight"]),
            progress=_re(d["desync"]["progress"], "desync.progress") if "progress" in d["desync"] else None,
            progress_anchors=tuple(d["desync"].get("progress_anchors", ())),
            progress_requires=frozenset(
                _need(kb, c, "desync.progress_requires") for c in d["desync"].get("progress_requires", ())
            ),
            collateral_priority=tuple(_need(kb, c, "collateral_only") for c in co["priority"]),
            alone_means={
                _need(kb, k, "alone_means"): _need(kb, v, "alone_means") for k, v in co["alone_means"].items()
            },
            single_reporter=frozenset(_need(kb, c, "single_reporter") for c in co["single_reporter"]),
            hints=tuple(_re(p, "hints") for p in d["hints"]["patterns"]),
            warning_levels=tuple(_re(p, "hints.warning_levels") for p in d["hints"].get("warning_levels", [])),
            operations=operations,
            silent_exit=silent,
            traceback_owners=tuple(_re(p, "traceback_owner") for p in d.get("traceback_owner", {}).get("patterns", [])),
            confidence={k: float(v) for k, v in conf.items() if not isinstance(v, dict)},
            rank_factor={k: float(v) for k, v in conf["rank_source"].items()},
            ordering_factor={k: float(v) for k, v in conf["ordering"].items()},
            same_failure_factor={k: float(v) for k, v in conf.get("same_failure_ordering", {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, KBError):
            raise
        raise KBError(f"_rules.toml: missing or malformed entry: {exc!r}") from exc


def load_rules(path: Path, kb: Container[str]) -> Rules:
    """Read and validate ``_rules.toml``."""
    with path.open("rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise KBError(f"{path.name}: {exc}") from exc
    return parse_rules(data, kb)
