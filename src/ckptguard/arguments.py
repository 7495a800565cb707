"""The Checkpointer's arguments, checked at the door: a wrong type or value is refused naming the
argument, rather than failing later, on some ranks, in the middle of a collective; and
:class:`Settings`, the ones that may be assigned after it is opened, checked the same way.
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptguard.checksum import ALGORITHMS
from ckptguard.errors import InvalidArgumentError, UnsupportedValueError
from ckptguard.protocol import records
from ckptguard.protocol.session import Session


def check_kinds(root: Any, *, read_only: Any, progress: Any, job_id: Any, process_group: Any) -> None:
    """The arguments that are only of a kind (a flag, a name, a group, a path): refused if not."""
    for flag, value in (("read_only", read_only), ("progress", progress)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be True or False, got {value!r}")
    if job_id is not None and not isinstance(job_id, str):
        raise TypeError(f"job_id must be a str or None, got {job_id!r}")
    check_process_group(process_group)
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path or a URL (str or os.PathLike), got {type(root).__name__}")


def count(name: str, value: Any, minimum: int, why: str = "", *, optional: bool = False) -> int | None:
    """``value`` checked to be an int >= ``minimum`` (or None where ``optional``): refused at the door,
    naming the argument, rather than failing later in a comparison (``keep_last='3'``)."""
    if value is None and optional:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # int, numpy integers; not float, str or bool
    except TypeError:
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}" + (f" ({why})" if why else "") + f", got {number}")
    return number


def check_process_group(group: Any) -> None:
    """None, "local" or a torch ProcessGroup; anything else (a typo "locl", a list of ranks) would
    otherwise quietly give a Checkpointer over the whole world."""
    if group is None or (isinstance(group, str) and group == "local"):
        return
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return
    hint = " (a list of ranks? pass torch.distributed.new_group(ranks, backend='gloo'))" \
        if isinstance(group, (list, tuple, range)) else ""
    raise TypeError(f"process_group must be None (all ranks), \"local\" (this rank alone) or a "
                    f"torch.distributed ProcessGroup, got {group!r} ({type(group).__name__}){hint}")


def required(value: int | None) -> int:
    assert value is not None  # count without optional=True never returns None
    return value


def seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, "
                         f"got {value}")
    return float(value)


def checksum_name(value: Any) -> str:
    if value not in ALGORITHMS:
        raise ValueError(f"checksum must be one of {', '.join(ALGORITHMS)}, got {value!r}")
    return str(value)


def json_object(metadata: Mapping[str, Any] | None, rank: int | None = None) -> dict[str, Any]:
    """``metadata=`` as the JSON object a manifest stores, or refused naming the value at fault (and
    ``rank``): UnsupportedValueError (a TypeError) for metadata that is not a mapping,
    InvalidArgumentError (a ValueError) for a value JSON cannot hold, a key that is not a str (JSON
    would turn it into one), NaN, infinity or nesting deeper than a load reads. Both cross ranks as
    themselves: every rank raises the same error."""
    on = f" on rank {rank}" if rank is not None else ""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise UnsupportedValueError(
            f"metadata must be a mapping of str to JSON values (metadata={{'loss': 1.5}}), got "
            f"{metadata!r} ({type(metadata).__name__}){on}", rank=rank)
    _check_json_value(dict(metadata), "metadata", on, rank)
    text = json.dumps(dict(metadata), allow_nan=False)
    # Bounded as a load will bound it: a manifest that no load could read is never written.
    result: dict[str, Any] = records.parse_json(text, "metadata=", "user metadata", max_bytes=None,
                                                max_depth=records.MAX_MANIFEST_DEPTH - 2)
    return result


#: metadata= deeper than this is refused before it is walked further (a load reads MAX_MANIFEST_DEPTH - 2).
_MAX_METADATA_DEPTH = records.MAX_MANIFEST_DEPTH - 2


def _check_json_value(value: Any, where: str, on: str, rank: int | None) -> None:
    """Refuse the first value under ``value`` that JSON cannot give back as it was (iterative: a value
    nested thousands deep is refused, not a RecursionError)."""
    todo: list[tuple[Any, str, int]] = [(value, where, 1)]
    while todo:
        v, at, depth = todo.pop()
        if depth > _MAX_METADATA_DEPTH:
            raise InvalidArgumentError(f"{at}{on} is nested more than {_MAX_METADATA_DEPTH} deep: a load reads "
                                       "metadata= at most that deep; store something flatter", rank=rank)
        if isinstance(v, bool) or v is None or isinstance(v, (str, int)):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                raise InvalidArgumentError(
                    f"{at}{on} is {v!r}: JSON has no NaN or Infinity, so a load could not give it back; "
                    "store it as a string (str(x)) or leave it out", rank=rank)
            continue
        if isinstance(v, Mapping):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise InvalidArgumentError(
                        f"{at}{on} has the key {k!r} ({type(k).__name__}): metadata keys must be str (JSON "
                        "keys are strings, so a load would not give it back as it was)", rank=rank)
                todo.append((item, f"{at}[{k!r}]", depth + 1))
            continue
        if isinstance(v, (list, tuple)):
            todo.extend((item, f"{at}[{i}]", depth + 1) for i, item in enumerate(v))
            continue
        raise InvalidArgumentError(f"{at}{on} is a {type(v).__name__}, not a JSON value (str, int, float, bool, "
                                   "None, list or dict of them)", rank=rank)


class Settings:
    """The Checkpointer's settings that may be assigned after it is opened, each checked as its argument
    is; what is read here is what the next save or load uses. Any other assignment is refused: a typo
    (``ck.keep_lst = 1``) or a setting fixed when it was opened would otherwise be silently ignored."""

    _session: Session
    _read_only: bool
    _progress: bool

    @property
    def root(self) -> str:
        """The root as given (a directory or a URL)."""
        return self._session.url

    @property
    def keep_last(self) -> int | None:
        """How many committed checkpoints retention keeps (None: all); applied at the next save."""
        return self._session.options.keep_last

    @keep_last.setter
    def keep_last(self, value: int | None) -> None:
        self._set_option(keep_last=count("keep_last", value, 1, "the newest checkpoint is always kept",
                                         optional=True))

    @property
    def keep_every(self) -> int | None:
        """Steps that are multiples of this are kept whatever ``keep_last`` says."""
        return self._session.options.keep_every

    @keep_every.setter
    def keep_every(self, value: int | None) -> None:
        self._set_option(keep_every=count("keep_every", value, 1, optional=True))

    @property
    def io_threads(self) -> int:
        """Files each rank writes or reads in parallel."""
        return self._session.options.io_threads

    @io_threads.setter
    def io_threads(self, value: int) -> None:
        self._set_option(io_threads=required(count("io_threads", value, 1)))

    @property
    def checksum(self) -> str:
        """The checksum the next save records (a load uses the one each manifest names)."""
        return self._session.options.checksum

    @checksum.setter
    def checksum(self, value: str) -> None:
        self._set_option(checksum=checksum_name(value))

    @property
    def visibility_timeout_s(self) -> float:
        """How long the leader waits for another rank's files to become visible (NFS caches)."""
        return self._session.options.visibility_timeout_s

    @visibility_timeout_s.setter
    def visibility_timeout_s(self, value: float) -> None:
        self._set_option(visibility_timeout_s=seconds("visibility_timeout_s", value))

    @property
    def load_memory_bytes(self) -> int | None:
        """Per rank, how much of a load is verified in host memory before it is copied into place."""
        return self._session.options.load_memory_bytes

    @load_memory_bytes.setter
    def load_memory_bytes(self, value: int | None) -> None:
        self._set_option(load_memory_bytes=count("load_memory_bytes", value, 0, optional=True))

    @property
    def read_only(self) -> bool:
        """Opened to load and list only: no lease was taken, so it cannot be changed afterwards."""
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        raise AttributeError(f"read_only is fixed when a Checkpointer is opened (it decides whether the root's "
                             f"lease is taken): open a new Checkpointer({self.root!r}, read_only={value!r})")

    @property
    def progress(self) -> bool:
        """Whether save and load show a progress bar on rank 0 (unless given ``progress=`` themselves)."""
        return self._progress

    @progress.setter
    def progress(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"progress must be True or False, got {value!r}")
        self._progress = value

    def __setattr__(self, name: str, value: Any) -> None:
        # Only the settings above may be assigned: a typo (ck.keep_lst = 1) or a setting fixed at
        # construction (collective_timeout_s, async_budget_bytes) would otherwise be silently ignored.
        if name.startswith("_") or isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)  # a property without a setter raises AttributeError
            return
        fixed = ("job_id", "lease_ttl_s", "lease_wait_s", "async_budget_bytes", "collective_timeout_s",
                 "process_group", "storage_options")
        how = (f"{name} is fixed when a Checkpointer is opened: open a new Checkpointer({self.root!r}, "
               f"{name}=...)" if name in fixed else f"Checkpointer has no setting {name!r}")
        raise AttributeError(f"{how}; the settings that may be assigned are {', '.join(SETTABLE)}")

    def _set_option(self, **change: Any) -> None:
        self._session.options = replace(self._session.options, **change)



SETTABLE = tuple(name for name, attr in vars(Settings).items()
                 if isinstance(attr, property) and attr.fset is not None and name != "read_only")
