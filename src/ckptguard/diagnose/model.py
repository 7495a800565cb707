"""The diagnosis's data: events read from the log, and the answer that the reports render.

Kept apart from the code that fills them so that the extractor, the attribution, the scoring and
the reports share one vocabulary (and one set of Enums) without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ckptguard.diagnose.kb import Match

SCHEMA_VERSION = 1


class EventKind(StrEnum):
    """What an event was read from; decides how much it can say on its own."""

    EXCEPTION = "exception"  # a Python exception (with its traceback when the log has it)
    LINE = "line"  # a log line that matches a signature
    EXIT = "exit"  # a process exit reported by a launcher, with no message of its own
    CUT = "cut-traceback"  # a traceback whose exception line the log does not hold
    HINT = "hint"  # a warning or a retried error: it names a cause but did not stop the run


class RankSource(StrEnum):
    """Where an event's rank came from, from the most to the least direct."""

    NONE = ""
    PREFIX = "prefix"
    FILE = "file"
    MESSAGE = "message"
    PID = "pid"
    LAUNCHER = "launcher"
    LAUNCHER_ROOT_CAUSE = "launcher-root-cause"
    ONLY_FAILING_RANK = "only-failing-rank"
    LOCAL_PREFIX = "local-prefix"
    DEVICE = "device"
    REPORT = "report"
    SPAWN_INDEX = "spawn-index"
    ONLY_RANK = "only-rank"
    INFERRED = "inferred"

    @property
    def text(self) -> str:
        """How the report explains this source."""
        return _RANK_TEXT[self]


_RANK_TEXT = {
    RankSource.NONE: "unknown",
    RankSource.PREFIX: "from the rank prefix of the failing line",
    RankSource.FILE: "from the name of the per-rank log file",
    RankSource.MESSAGE: "from the rank that the failing message names as its own ([Rank N])",
    RankSource.PID: "from the pid of the failing process, mapped to its rank by NCCL/launcher lines",
    RankSource.LAUNCHER: "from the launcher's failure summary",
    RankSource.LAUNCHER_ROOT_CAUSE: "the traceback has no rank prefix; torchrun's Root Cause block names this rank "
    "as the first failure with a non-signal exit code",
    RankSource.ONLY_FAILING_RANK: "the failing lines have no rank prefix; this is the only rank that failed "
    "(its own traceback, or the launcher's report)",
    RankSource.LOCAL_PREFIX: "from a local-rank prefix ([defaultN]:), taken as the global rank",
    RankSource.DEVICE: "from the GPU index in the message (one GPU per process, GPU N = rank N assumed)",
    RankSource.REPORT: "from a report that names the failing rank (torch's lagging-rank report, another rank's error)",
    RankSource.SPAWN_INDEX: (
        "from the process index that torch.multiprocessing.spawn names for the traceback (the rank on a single node)"
    ),
    RankSource.ONLY_RANK: "the only rank that the log shows at all",
    RankSource.INFERRED: "inferred from which ranks reported consequences",
}


class OrderingBasis(StrEnum):
    """What the order between failing ranks rests on (its confidence factor is KB data)."""

    ONLY_ONE = "only one rank failed on its own"
    TIMESTAMPS = "timestamps of the failure lines"
    LOG_ORDER = "order in the log (the failure lines carry no timestamps)"
    ROOT_CAUSE = "the launcher's first observed failure (torchrun Root Cause)"
    FILE_ORDER = "order of the input files (weak: no timestamps)"
    CAUSALITY = "causality: the other failures are known consequences of this one"
    UNATTRIBUTED = "order in the log"
    NO_PRIMARY = "no rank failed on its own"
    JOB = "the whole job was stopped from outside"


@dataclass
class Evidence:
    """A line of the log that supports a finding."""

    source: int
    line: int
    text: str
    rank: int | None = None


@dataclass
class Event:
    """One failure observation: an exception, a matching log line, a process exit, a hint."""

    seq: int
    kind: EventKind
    class_id: str
    weight: float
    matches: list[Match]
    evidence: list[Evidence]
    rank: int | None
    rank_via: RankSource
    pid: int | None = None
    host: str | None = None
    ts: float | None = None
    ts_own: bool = False
    exc_type: str | None = None
    message: str | None = None
    frames: list[str] = field(default_factory=list)
    code: list[str] = field(default_factory=list)
    operation: str | None = None  # what the frames show was being done, when that decided the class
    operation_basis: str = ""  # why that operation's failure is this class, beyond its frames
    blames: int | None = None  # the rank that this error's own message says failed first

    @property
    def source(self) -> int:
        return self.evidence[0].source

    @property
    def line(self) -> int:
        return self.evidence[0].line

    @property
    def text(self) -> str:
        """Everything the event says: message, evidence lines, frames and code (for rules)."""
        return "\n".join([self.message or "", *(e.text for e in self.evidence), *self.frames, *self.code])


@dataclass
class LauncherFailure:
    """A worker exit as a launcher reported it (torchrun, mp.spawn, srun, DeepSpeed, mpirun)."""

    rank: int | None
    local_rank: int | None
    pid: int | None
    exitcode: int | None
    host: str | None
    time: float | None
    root_cause: bool
    evidence: Evidence
    signal_note: str = ""
    rank_reliable: bool = True
    launcher: str = ""
    class_id: str | None = None  # when the launcher's words name the class (srun's "Out Of Memory")
    weight: float | None = None


@dataclass
class EvidenceLine:
    """An evidence line as reported: where it is and what it says."""

    file: str
    line: int
    text: str
    rank: int | None
    role: str  # "initiating" | "collateral" | "launcher" | "context"

    def as_dict(self) -> dict[str, object]:
        return {"file": self.file, "line": self.line, "rank": self.rank, "role": self.role, "text": self.text}


@dataclass
class Hypothesis:
    """A competing explanation, with the evidence for it and why it ranks lower."""

    failure_class: str
    title: str
    score: float
    ranks: list[int]
    evidence: list[EvidenceLine]
    why_not: str
    kind: str | None = None  # the finer KB class, when failure_class is its family

    def as_dict(self) -> dict[str, object]:
        return {
            "failure_class": self.failure_class,
            "kind": self.kind or self.failure_class,
            "title": self.title,
            "score": self.score,
            "ranks": self.ranks,
            "evidence": [e.as_dict() for e in self.evidence],
            "why_not": self.why_not,
        }


@dataclass
class TimelineEvent:
    """One failure event placed on the per-rank timeline of the HTML report."""

    rank: int | None
    t: float | None
    order: int
    failure_class: str
    collateral: bool
    file: str
    line: int
    text: str
    kind: str | None = None  # the finer KB class, when failure_class is its family


@dataclass
class Diagnosis:
    """The result of `diagnose`: everything the text, JSON and HTML reports show."""

    found: bool
    failure_class: str | None = None
    kind: str | None = None  # the KB class that matched; failure_class is its family (users' class)
    title: str = ""
    category: str = ""
    confidence: float = 0.0
    initiating_rank: int | None = None
    initiating_host: str | None = None
    rank_attribution: str = ""
    ordering_basis: str = ""
    collateral_ranks: list[int] = field(default_factory=list)
    also_failed_ranks: list[int] = field(default_factory=list)
    world_size: int | None = None
    evidence: list[EvidenceLine] = field(default_factory=list)
    root_cause: str = ""
    mechanism: str = ""
    fix: str = ""
    prevention: list[str] = field(default_factory=list)
    confirm: list[str] = field(default_factory=list)
    verify_command: str = ""
    checkpointer_switch: str | None = None
    alternatives: list[Hypothesis] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timeline: list[TimelineEvent] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def confidence_label(self) -> str:
        return "high" if self.confidence >= 0.8 else "medium" if self.confidence >= 0.5 else "low"

    def to_dict(self) -> dict[str, object]:
        """The stable JSON object (schema_version 1)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "found": self.found,
            "failure_class": self.failure_class,
            "kind": self.kind,
            "title": self.title,
            "category": self.category,
            "confidence": self.confidence,
            "confidence_label": self.confidence_label,
            "initiating_rank": self.initiating_rank,
            "initiating_host": self.initiating_host,
            "rank_attribution": self.rank_attribution,
            "ordering_basis": self.ordering_basis,
            "collateral_ranks": self.collateral_ranks,
            "also_failed_ranks": self.also_failed_ranks,
            "world_size": self.world_size,
            "evidence": [e.as_dict() for e in self.evidence],
            "root_cause": self.root_cause,
            "mechanism": self.mechanism,
            "fix": self.fix,
            "checkpointer_switch": self.checkpointer_switch,
            "prevention": self.prevention,
            "confirm": self.confirm,
            "verify_command": self.verify_command,
            "alternatives": [a.as_dict() for a in self.alternatives],
            "notes": self.notes,
            "timeline": [
                {
                    "rank": t.rank,
                    "t": t.t,
                    "order": t.order,
                    "failure_class": t.failure_class,
                    "kind": t.kind or t.failure_class,
                    "collateral": t.collateral,
                    "file": t.file,
                    "line": t.line,
                    "text": t.text,
                }
                for t in self.timeline
            ],
            "sources": self.sources,
            "stats": self.stats,
        }


def ranges(ranks: list[int] | set[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(f"{rs[i]}-{rs[j]}" if j > i else str(rs[i]))
        i = j + 1
    return ", ".join(parts)
