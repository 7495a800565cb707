"""Arbitrary bytes in every stored record of a root: the control records (``latest``, a tag, the lease,
a quarantine record, the root identity, an object-store index where a filesystem root has none) and a
manifest's head and row section spliced with raw bytes and resealed (the checksum is not a signature).
Bytes that are not UTF-8 inside a string of an otherwise valid record are generated on purpose.

The properties: ``ls`` and ``verify`` answer (exit 0 or 1, never an exception); only ``CheckpointError``
subclasses escape ``list_root``, ``verify_checkpoint`` and the loads; and ``verify``'s "safe to resume
from" is the step ``load(step=None)`` gives. A record that does not parse is a hint that does not hold
(``latest``, a tag, the lease) or quarantines nothing, so the two steps stay loadable. The CI slice runs
a fixed, derandomized set of examples; ``-m long`` runs ``CKPTGUARD_FUZZ_EXAMPLES``."""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from ckptguard import Checkpointer, CheckpointError
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.manifest import seal
from ckptguard.verify import list_root, verify_checkpoint

from tests.fuzz.harness import base_state, bounded, fresh_copy, kept_until_exit, make_base, scratch
from tests.fuzz.mutate import manifest_path
from tests.fuzz.support import cli

CI_EXAMPLES = int(os.environ.get("CKPTGUARD_FUZZ_CI_EXAMPLES", "60"))
LONG_EXAMPLES = int(os.environ.get("CKPTGUARD_FUZZ_EXAMPLES", "100000"))
LONG_SEED = int(os.environ.get("CKPTGUARD_FUZZ_SEED", "0"))
_COMMON = settings(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_DEAD_LEASE = {
    "holder": "0123456789abcdef",
    "job": "j",
    "host": "h",
    "pid": 1,
    "boot_id": "b",
    "epoch": 1,
    "acquired_at": 0.0,
    "renewed_at": 0.0,
    "ttl_s": 1.0,
}
#: Each record, by where it is in the root, and a valid record of its kind to mutate (one that names or
#: holds nothing, so the valid template changes no answer). The lease is left out of the writing load:
#: a lease that does not parse is held for its TTL by its age (a writer waits 30 s).
RECORDS: dict[str, bytes] = {
    "latest": b'{"step":2,"dir":"step-00000002","updated_at":1.0,"seq":2,"high_seq":2}\n',
    "tags/best": b'{"step":1,"tag":"best","dir":"step-00000001","updated_at":1.0}\n',
    ".ckptguard/lease.json": json.dumps(_DEAD_LEASE, separators=(",", ":")).encode() + b"\n",
    ".ckptguard/quarantine/step-00000002.json": (
        b'{"format":"ckptguard-quarantine","step":2,"version":1,"seq":999,"reason":"caf\xc3\xa9","at":1.0}\n'
    ),
    ".ckptguard/root-id": b"0123456789abcdef0123456789abcdef\n",
    ".ckptguard/index.json": b'{"format":"ckptguard-index","epoch":1,"next_seq":3,"entries":[]}\n',
}
MANIFEST_PARTS = ("manifest head", "manifest rows")
#: Byte sequences that are not UTF-8 (a Latin-1 letter, a stray continuation, a surrogate, overlong).
NOT_UTF8 = [b"\xe9", b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\xc0\xaf", b"caf\xe9"]


@functools.cache
def _base() -> Path:
    """Steps 1 and 2 (tests/fuzz/harness.py) and every record of RECORDS in place; both steps load."""
    root = make_base(kept_until_exit("ckptguard-fuzz-ctl-") / "base")
    for rel, data in RECORDS.items():
        if rel != "latest":  # the save wrote it
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
    return root


def _template(target: str) -> bytes:
    if target in MANIFEST_PARTS:
        data = manifest_path(_base(), 2).read_bytes()
        nl = data.index(b"\n")
        return data[: nl + 1] if target == "manifest head" else data[nl + 1 :]
    return (_base() / target).read_bytes()


def hostile(template: bytes) -> st.SearchStrategy[bytes]:
    """Any bytes; the template with a span replaced by any bytes; the template with bytes that are not
    UTF-8 put inside one of its strings (right after a quote)."""
    quotes = [i + 1 for i, c in enumerate(template) if c == ord('"')] or [0]
    splice = st.tuples(
        st.integers(0, len(template)), st.integers(0, 8), st.binary(max_size=16) | st.sampled_from(NOT_UTF8)
    ).map(lambda t: template[: t[0]] + t[2] + template[t[0] + t[1] :])
    in_string = st.tuples(st.sampled_from(quotes), st.sampled_from(NOT_UTF8)).map(
        lambda t: template[: t[0]] + t[1] + template[t[0] :]
    )
    return st.one_of(st.binary(max_size=200), splice, in_string)


def examples() -> st.SearchStrategy[tuple[str, bytes]]:
    targets = sorted(RECORDS) + list(MANIFEST_PARTS)
    return st.sampled_from(targets).flatmap(lambda t: st.tuples(st.just(t), hostile(_template(t))))


def _put(root: Path, target: str, data: bytes) -> None:
    if target not in MANIFEST_PARTS:
        (root / target).write_bytes(data)
        return
    path = manifest_path(root, 2)
    current = path.read_bytes()
    nl = current.index(b"\n")
    head, rows = current[: nl + 1], current[nl + 1 :]
    if target == "manifest head":
        head = data
    else:
        rows = data
    # Resealed: the body between '"body":' and the head's last '}', whatever the splice left of it.
    start, end = head.find(b'"body":'), head.rfind(b"}")
    body = head[start + 7 : end] if 0 <= start < end else head
    path.write_bytes(seal(body, rows))


def _load(root: Path, read_only: bool) -> int | None:
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base_state().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Checkpointer(root, read_only=read_only) as ck:
            return ck.load(state)


def check(target: str, data: bytes) -> None:
    with scratch("ckptguard-fuzz-ctl-ex-") as where:
        root = fresh_copy(_base(), where / "root")
        _put(root, target, data)
        with bounded():
            code, _ = cli("ls", str(root))  # an exception escaping the command fails the example
            assert code in (0, 1), f"ls exits {code}"
            code, out = cli("verify", str(root), "--json")
            assert code in (0, 1), f"verify exits {code}"
            safe = json.loads(out)["safe_to_resume"]
            list_root(str(root))
            for step in (1, 2):
                verify_checkpoint(str(root), CheckpointName(step), threads=1)
            try:
                loaded = _load(root, read_only=True)
            except CheckpointError:
                loaded = None
            assert loaded == safe, f"verify says resume from {safe}, load(step=None) gives {loaded}"
            if target not in MANIFEST_PARTS:
                assert loaded == 2 or target.startswith(".ckptguard/quarantine/"), f"{target} unloaded step 2"
            if target != ".ckptguard/lease.json":
                assert _load(root, read_only=False) == loaded, "a writing load and a read-only load disagree"


@settings(_COMMON, max_examples=CI_EXAMPLES, derandomize=True)
@given(examples())
def test_hostile_bytes_in_every_stored_record_ci(example: tuple[str, bytes]) -> None:
    check(*example)


@pytest.mark.parametrize("target", sorted(RECORDS) + list(MANIFEST_PARTS))
@pytest.mark.parametrize("bad", [b"\xe9", b"\xed\xa0\x80"])
def test_bytes_that_are_not_utf8_in_a_string_of_each_record(target: str, bad: bytes) -> None:
    """Each record with bytes that are not UTF-8 inside a string value (a record otherwise valid, the
    manifest resealed): refused as a record that does not parse, never a UnicodeDecodeError."""
    template = _template(target)
    if target == "manifest rows":  # MessagePack: the same number of bytes, inside a file path
        data = template.replace(b"data/", (bad + b"xxxx")[:4] + b"/", 1)
    else:
        at = template.rindex(b'":"') + 3 if b'":"' in template else 0
        data = template[:at] + bad + template[at:]
    assert data != template
    check(target, data)


@pytest.mark.long
@seed(LONG_SEED)
@settings(_COMMON, max_examples=LONG_EXAMPLES)
@given(examples())
def test_hostile_bytes_in_every_stored_record_long(example: tuple[str, bytes]) -> None:
    check(*example)


def test_the_templates_are_valid_records_that_change_no_answer() -> None:
    """Without a mutation every record parses and both commands and loads agree on step 2 (else the
    fuzzer would only ever test records that do not parse)."""
    for target in sorted(RECORDS):
        check(target, _template(target))
    msgspec.json.decode(RECORDS[".ckptguard/quarantine/step-00000002.json"])
