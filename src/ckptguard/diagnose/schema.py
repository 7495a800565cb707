"""The format of a knowledge-base class file (``kb/<class>.toml``), as one msgspec schema.

A KB file is data that contributors edit by hand: a misspelt key or a string where a list
belongs must stop the engine with the file and the field named, not be read as a default. The
schema decodes each file strictly (unknown keys refused); ``kb.py`` then compiles the regexes
and checks what a type cannot say (snake_case ids, weights in (0, 1], related classes exist).
This module imports nothing of the engine: ``kb`` and ``rules`` both depend on it, not on each
other's internals.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class KBError(ValueError):
    """A knowledge-base file is malformed: the engine refuses to run on a broken KB."""


class SignatureEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[[signatures]]``: one way the class shows in an exception or a log line."""

    pattern: str
    on: Literal["exception", "line", "any"] = "any"
    weight: float = 0.5
    anchor: str | None = None
    context: str | None = None
    prefilter: bool = False


class UnprovenEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[unproven]``: how to report the class when the log only implies it."""

    proof_weight: float
    title: str
    root_cause: str
    confidence_cap: float
    confirm: list[str] = []
    fix: str = ""


class RestartEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[restart]``: whether restarting the job as it is can succeed, and why."""

    transient: bool
    why: str


class ClassEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One failure class: what the report explains, and its signatures."""

    id: str
    title: str
    category: str
    collateral: bool
    summary: str
    root_cause: str
    mechanism: str
    symptoms: list[str]
    affected: list[str]
    confirm: list[str]
    fix: str
    prevention: list[str]
    verify_command: str
    related: list[str]
    weak: bool = False
    checkpointer_prevents: bool = False
    family: str | None = None
    restart: RestartEntry | None = None
    references: list[str] = []
    signatures: list[SignatureEntry] = []
    unproven: UnprovenEntry | None = None


def decode_class(raw: bytes, where: str) -> ClassEntry:
    """Decode one class file; any malformation is a KBError naming the file and the field."""
    try:
        return msgspec.toml.decode(raw, type=ClassEntry)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise KBError(f"{where}: {exc}") from exc


def convert_class(data: dict[str, object], where: str) -> ClassEntry:
    """The same check for an entry that is already a table (tests, generated KBs)."""
    try:
        return msgspec.convert(data, type=ClassEntry)
    except msgspec.ValidationError as exc:
        raise KBError(f"{where}: {exc}") from exc
