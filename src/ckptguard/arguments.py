"""The checks of the Checkpointer's arguments: a wrong type or value is refused naming the argument,
rather than failing later, on some ranks, in the middle of a collective. ``settings.py`` applies them to
every setting; the methods apply them to their own arguments (``metadata=``).
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Mapping
from typing import Any

from ckptguard.checksum import ALGORITHMS
from ckptguard.errors import InvalidArgumentError, UnsupportedValueError
from ckptguard.protocol import records


def check_root(root: Any) -> None:
    """A path or a URL; anything else is refused naming ``root``."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path or a URL (str or os.PathLike), got {type(root).__name__}")


def flag(name: str, value: Any) -> bool:
    """``value`` checked to be True or False (not a truthy string: ``read_only="no"``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {value!r}")
    return value


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
    hint = (
        " (a list of ranks? pass torch.distributed.new_group(ranks, backend='gloo'))"
        if isinstance(group, (list, tuple, range))
        else ""
    )
    raise TypeError(
        f'process_group must be None (all ranks), "local" (this rank alone) or a '
        f"torch.distributed ProcessGroup, got {group!r} ({type(group).__name__}){hint}"
    )


def required(value: int | None) -> int:
    assert value is not None  # count without optional=True never returns None
    return value


def seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, got {value}")
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
            f"{metadata!r} ({type(metadata).__name__}){on}",
            rank=rank,
        )
    _check_json_value(dict(metadata), "metadata", on, rank)
    text = json.dumps(dict(metadata), allow_nan=False)
    # Bounded as a load will bound it: a manifest that no load could read is never written.
    result: dict[str, Any] = records.parse_json(
        text, "metadata=", "user metadata", max_bytes=None, max_depth=records.MAX_MANIFEST_DEPTH - 2
    )
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
            raise InvalidArgumentError(
                f"{at}{on} is nested more than {_MAX_METADATA_DEPTH} deep: a load reads "
                "metadata= at most that deep; store something flatter",
                rank=rank,
            )
        if isinstance(v, bool) or v is None or isinstance(v, (str, int)):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                raise InvalidArgumentError(
                    f"{at}{on} is {v!r}: JSON has no NaN or Infinity, so a load could not give it back; "
                    "store it as a string (str(x)) or leave it out",
                    rank=rank,
                )
            continue
        if isinstance(v, Mapping):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise InvalidArgumentError(
                        f"{at}{on} has the key {k!r} ({type(k).__name__}): metadata keys must be str (JSON "
                        "keys are strings, so a load would not give it back as it was)",
                        rank=rank,
                    )
                todo.append((item, f"{at}[{k!r}]", depth + 1))
            continue
        if isinstance(v, (list, tuple)):
            todo.extend((item, f"{at}[{i}]", depth + 1) for i, item in enumerate(v))
            continue
        raise InvalidArgumentError(
            f"{at}{on} is a {type(v).__name__}, not a JSON value (str, int, float, bool, None, list or dict of them)",
            rank=rank,
        )
