"""The Checkpointer's settings: one frozen dataclass, every field documented and checked in one place.

``Checkpointer(root, settings=CheckpointerSettings(keep_last=3))`` and ``Checkpointer(root, keep_last=3)``
are the same; keyword arguments given beside ``settings=`` replace its fields. A wrong type or value is
refused at construction naming the field (TypeError or ValueError), before any collective: never later,
on some ranks, in the middle of one. Assigning a setting on an open Checkpointer (``ck.keep_last = 3``)
builds a new, validated settings object; the settings fixed when it was opened (the lease, the process
group, the budgets) refuse assignment with AttributeError, as does a name that is no setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar, overload

from ckptguard.arguments import check_process_group, checksum_name, count, flag, optional_str, required, seconds
from ckptguard.comm import DEFAULT_TIMEOUT_S
from ckptguard.protocol.session import Options


@dataclass(frozen=True)
class CheckpointerSettings:
    """How a :class:`~ckptguard.Checkpointer` saves, loads and holds its root.

    Every field is checked when the object is made; ``dataclasses.replace`` checks again. Numpy
    integers are accepted where an int is and stored as ``int``.
    """

    keep_last: int | None = None
    """How many committed checkpoints retention keeps (>= 1; None: all). The newest is always kept;
    applied at the next save. Assignable."""
    keep_every: int | None = None
    """Steps that are multiples of this (>= 1) are kept whatever ``keep_last`` says. Assignable."""
    process_group: Any = None
    """None (every rank, through a gloo group ckptguard creates), ``"local"`` (this rank alone: no
    collective at all, for code that checkpoints from one rank) or a gloo ``ProcessGroup`` whose every
    member calls every method. Fixed when opened."""
    read_only: bool = False
    """Load and list only: no lease is taken, so a writer may hold the root meanwhile. Fixed when opened."""
    job_id: str | None = None
    """This job's name in the root's lease (default: host and pid). Fixed when opened."""
    lease_ttl_s: float = 30.0
    """Seconds a lease stays valid without renewal: a job that stops renewing loses the root after it.
    Fixed when opened."""
    lease_wait_s: float | None = None
    """Seconds to wait for another job's lease to expire (>= 0; None: its whole remaining time).
    Fixed when opened."""
    io_threads: int = 4
    """Files each rank writes or reads in parallel (>= 1). Assignable."""
    checksum: str | None = None
    """The checksum the next save records (``xxh3-64``, ``crc32c``, ...; None: xxh3-64 on filesystems,
    crc32c on object stores). A load uses the one each manifest names. Assignable."""
    visibility_timeout_s: float = 60.0
    """Seconds the leader waits for another rank's files to become visible (NFS caches). Assignable."""
    async_budget_bytes: int | None = None
    """Per rank, the host memory that ``blocking=False`` saves and the device copy of blocking ones may
    keep (>= 0; None: half of MemAvailable shared by the host's ranks); a state over it is copied tensor
    by tensor as it is written. Fixed when opened."""
    load_memory_bytes: int | None = None
    """Per rank, how much of a load is read once, verified and held until every rank agreed (>= 0); the
    rest is verified in a first pass and read into place in a second. None: on filesystems 0 while the
    rank's bytes times the host's ranks fit half of MemAvailable, else 256 MiB; on object stores half of
    MemAvailable shared by the host's ranks (the Performance page). Assignable."""
    progress: bool = False
    """Whether save and load show a progress bar on rank 0 (unless given ``progress=``). Assignable."""
    collective_timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds ranks wait for a rank that died or stalled, on the group ckptguard creates (a group passed
    in keeps its own). Fixed when opened."""
    storage_options: Mapping[str, Any] | None = field(default=None, hash=False)
    """Passed to the storage backend (``endpoint_url``, credentials, ...). Fixed when opened."""

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {
            "keep_last": count("keep_last", self.keep_last, 1, "the newest checkpoint is always kept", optional=True),
            "keep_every": count("keep_every", self.keep_every, 1, optional=True),
            "io_threads": required(count("io_threads", self.io_threads, 1)),
            "load_memory_bytes": count("load_memory_bytes", self.load_memory_bytes, 0, optional=True),
            "async_budget_bytes": count("async_budget_bytes", self.async_budget_bytes, 0, optional=True),
            "visibility_timeout_s": seconds("visibility_timeout_s", self.visibility_timeout_s),
            "lease_ttl_s": seconds("lease_ttl_s", self.lease_ttl_s),
            "collective_timeout_s": seconds("collective_timeout_s", self.collective_timeout_s),
            "lease_wait_s": None
            if self.lease_wait_s is None
            else seconds("lease_wait_s", self.lease_wait_s, allow_zero=True),
            "checksum": None if self.checksum is None else checksum_name(self.checksum),
            "read_only": flag("read_only", self.read_only),
            "progress": flag("progress", self.progress),
            "job_id": optional_str("job_id", self.job_id),
        }
        check_process_group(self.process_group)
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping or None, got {self.storage_options!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def options(self, default_checksum: str) -> Options:
        """The protocol's part of these settings, the checksum resolved against the storage's default."""
        return Options(
            self.keep_last,
            self.keep_every,
            self.io_threads,
            self.checksum or default_checksum,
            self.visibility_timeout_s,
            self.load_memory_bytes,
        )


class SettingsKwargs(TypedDict, total=False):
    """``CheckpointerSettings``' fields as keyword arguments of ``Checkpointer(...)``."""

    keep_last: int | None
    keep_every: int | None
    process_group: Any
    read_only: bool
    job_id: str | None
    lease_ttl_s: float
    lease_wait_s: float | None
    io_threads: int
    checksum: str | None
    visibility_timeout_s: float
    async_budget_bytes: int | None
    load_memory_bytes: int | None
    progress: bool
    collective_timeout_s: float
    storage_options: Mapping[str, Any] | None


FIELDS = tuple(f.name for f in dataclasses.fields(CheckpointerSettings))
SETTABLE = (
    "keep_last",
    "keep_every",
    "io_threads",
    "checksum",
    "visibility_timeout_s",
    "load_memory_bytes",
    "progress",
)
FIXED = tuple(name for name in FIELDS if name not in SETTABLE)


def combine(settings: CheckpointerSettings | None, overrides: Mapping[str, Any]) -> CheckpointerSettings:
    """``settings`` (default: the defaults) with ``overrides`` replacing its fields, validated.

    Args:
        settings: The base settings, or None for the defaults.
        overrides: Keyword arguments naming fields of :class:`CheckpointerSettings`.

    Returns:
        A new validated :class:`CheckpointerSettings`.

    Raises:
        TypeError: ``settings`` is not a CheckpointerSettings, an override names no field, or a value is
            of the wrong type.
        ValueError: A value is out of its range.
    """
    if settings is not None and not isinstance(settings, CheckpointerSettings):
        raise TypeError(f"settings must be a CheckpointerSettings or None, got {settings!r}")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise TypeError(
            f"Checkpointer() got an unexpected keyword argument {unknown[0]!r}; its settings are {', '.join(FIELDS)}"
        )
    base = settings if settings is not None else CheckpointerSettings()
    return dataclasses.replace(base, **overrides) if overrides else base


_T = TypeVar("_T")


class Setting(Generic[_T]):
    """One setting of a Checkpointer, read from its settings object; ``assignable`` ones replace it."""

    def __init__(self, assignable: bool) -> None:
        self.assignable = assignable
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[_T]: ...
    @overload
    def __get__(self, obj: SettingsAttributes, owner: type) -> _T: ...

    def __get__(self, obj: SettingsAttributes | None, owner: type) -> Setting[_T] | _T:
        if obj is None:
            return self
        value: _T = getattr(obj._settings, self.name)
        return value

    def __set__(self, obj: SettingsAttributes, value: _T) -> None:
        if not self.assignable:
            raise fixed_error(self.name, getattr(obj, "root", "..."), value)
        obj._assign(self.name, value)


def fixed_error(name: str, root: str, value: Any = ...) -> AttributeError:
    """The refusal of an assignment to ``name``: fixed when opened, or no setting at all."""
    if name == "read_only":
        return AttributeError(
            f"read_only is fixed when a Checkpointer is opened (it decides whether the root's "
            f"lease is taken): open a new Checkpointer({root!r}, read_only={value!r})"
        )
    how = (
        f"{name} is fixed when a Checkpointer is opened: open a new Checkpointer({root!r}, {name}=...)"
        if name in FIXED
        else f"Checkpointer has no setting {name!r}"
    )
    return AttributeError(f"{how}; the settings that may be assigned are {', '.join(SETTABLE)}")


class SettingsAttributes:
    """Every setting as an attribute of a Checkpointer (``ck.keep_last``), read from its settings object.

    Assigning an assignable one replaces the settings object with a new, validated one (``_assign``); any
    other assignment of a public name is refused: a typo (``ck.keep_lst = 1``) or a setting fixed when
    opened would otherwise be silently ignored.
    """

    _settings: CheckpointerSettings

    keep_last = Setting[int | None](assignable=True)
    keep_every = Setting[int | None](assignable=True)
    io_threads = Setting[int](assignable=True)
    checksum = Setting[str](assignable=True)
    visibility_timeout_s = Setting[float](assignable=True)
    load_memory_bytes = Setting[int | None](assignable=True)
    progress = Setting[bool](assignable=True)
    read_only = Setting[bool](assignable=False)
    process_group = Setting[Any](assignable=False)
    job_id = Setting[str | None](assignable=False)
    lease_ttl_s = Setting[float](assignable=False)
    lease_wait_s = Setting[float | None](assignable=False)
    async_budget_bytes = Setting[int | None](assignable=False)
    collective_timeout_s = Setting[float](assignable=False)
    storage_options = Setting[Mapping[str, Any] | None](assignable=False)

    @property
    def settings(self) -> CheckpointerSettings:
        """The current settings (the checksum resolved against the storage's default)."""
        return self._settings

    @property
    def root(self) -> str:
        raise NotImplementedError

    def _assign(self, name: str, value: Any) -> None:
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or isinstance(getattr(type(self), name, None), Setting | property):
            object.__setattr__(self, name, value)  # a property without a setter raises AttributeError
            return
        raise fixed_error(name, self.root, value)
