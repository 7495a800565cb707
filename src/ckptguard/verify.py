"""Offline inspection of a checkpoint root: what is committed, what is left over, what is intact.

`list_root` only reads names, manifests and sizes (fast). `verify_checkpoint`
re-reads every byte and checks it against the manifest: files are read by
several threads in bounded chunks, so memory stays at threads x chunk whatever
the size of the checkpoint, and no tensor is ever materialised.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptguard._pool import ExitSafePool
from ckptguard.checksum import Hasher
from ckptguard.errors import CheckpointError, StepNotFoundError
from ckptguard.protocol import latest, layout, quarantine, rootid
from ckptguard.protocol.decisions import Committed, abandoned, order_key
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.layout import is_plain_name as is_plain_name  # for the integrations
from ckptguard.protocol.lease import LeaseRecord, holder_dead_here
from ckptguard.protocol.manifest import Manifest, StoredItem
from ckptguard.protocol.root import Root, open_root
from ckptguard.protocol.rootkit import NOT_A_FILE
from ckptguard.storage import open_storage

SCHEMA_VERSION = 1
CHUNK_BYTES = 8 << 20


@dataclass
class CheckpointInfo:
    step: int
    version: int
    dir: str
    current: bool  # the newest version of its step (older versions are superseded leftovers)
    latest: bool  # what the `latest` pointer names
    seq: int | None = None  # commit sequence number (None: the manifest could not be read)
    abandoned: bool = False  # rolled back past: a checkpoint of a lower step was committed after it
    created_at: float | None = None
    world_size: int | None = None
    files: int | None = None
    bytes: int | None = None
    user_metadata: dict[str, Any] = field(default_factory=dict)
    manifest_error: str | None = None
    #: why a load found this commit corrupt (its quarantine record; None: not quarantined). Loads,
    #: verify and the resume answer skip it without reading it again; the next save of the step replaces it.
    quarantined: str | None = None


@dataclass
class AttemptInfo:
    step: int | None
    attempt: str
    dir: str
    state: str  # "in progress" (a live job holds the lease and touched it recently) or "abandoned"
    age_s: float
    bytes: int


@dataclass
class RootListing:
    root: str
    checkpoints: list[CheckpointInfo]
    attempts: list[AttemptInfo]
    trash: list[str]
    lease: dict[str, Any] | None
    #: Why `latest` could not be read, if it could not. `latest` is a hint for tools: loads and
    #: verify list the checkpoints themselves, so an unreadable pointer makes nothing "not intact".
    latest_error: str | None = None
    #: Why the root's checkpoints could not be listed: a control record that says what is committed
    #: (the object-store index) is damaged. Such a root is "not intact" (exit 1), not a usage error.
    error: str | None = None
    #: Commit objects the root's index does not list (object stores): not loaded, never garbage.
    unlisted: list[str] = field(default_factory=list)
    #: Checkpoint directories that were committed when the listing began and were retired (retention, a
    #: delete) before their manifest was read: gone, not damaged, so not in ``checkpoints``.
    retired: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "root": self.root,
            "checkpoints": [asdict(c) for c in self.checkpoints],
            "attempts": [asdict(a) for a in self.attempts],
            "trash": self.trash,
            "lease": self.lease,
            "latest_error": self.latest_error,
            "error": self.error,
            "unlisted": self.unlisted,
            "retired": self.retired,
        }


def damaged_root(path: str, error: CheckpointError) -> RootListing:
    """The listing of a root whose control records cannot be read: nothing listed, the reason kept."""
    return RootListing(open_root(path).storage.root, [], [], [], None, None, str(error))


@dataclass
class Problem:
    path: str
    kind: str  # missing | size | checksum | layout | extra | manifest | quarantined
    detail: str
    #: "error": the checkpoint is not intact. "warning": reported only; no load reads what it names
    #: (a file the manifest does not list), so the checkpoint stays intact and safe to resume from.
    severity: str = "error"


@dataclass
class VerifyResult:
    step: int
    version: int
    dir: str
    intact: bool
    files_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    #: Retired (by the job's retention or a delete) while it was being read: gone, not damaged. Such a
    #: result has no problems and is not intact; the commands report it apart from the checked ones.
    retired: bool = False

    @property
    def errors(self) -> list[Problem]:
        """The problems that make the checkpoint not intact (warnings left out)."""
        return [p for p in self.problems if p.severity == "error"]

    def to_json(self) -> dict[str, Any]:
        """The fields of one checked step in `verify --json` (``retired`` results are listed apart)."""
        doc = asdict(self)
        del doc["retired"]
        return doc


def _retired(root: Root, name: CheckpointName, seq: int | None) -> bool:
    """Whether ``name`` (listed with commit sequence number ``seq``, if known) was retired since it was
    listed: no longer committed, or committed again as another checkpoint. On a filesystem a retirement
    takes the whole directory away at once: a directory still there without its manifest was damaged."""
    if root.still_committed(name, seq):
        return False
    where = root.dir(name)
    return not (
        root.local_dir() is not None
        and root.storage.exists(where)
        and not root.storage.exists(root.storage.join(where, layout.MANIFEST))
    )


def _dir_bytes(root: Root, path: str) -> int:
    return sum(size for _, size in root.walk(path) if size != NOT_A_FILE)


def list_root(path: str) -> RootListing:
    """What is in a root. Raises CheckpointError if ``path`` is not a checkpoint root one can read."""
    root = open_root(path)
    if root.location() != "ok":
        raise CheckpointError(f"{path} is not a directory", path=path)
    storage = root.storage
    # One listing of the committed names, and everything else derived from it: a live job commits and
    # retires steps between any two reads of the root.
    names = root.committed()
    current = layout.newest_versions(names)
    pointer = root.read_latest()
    lease_rec = None
    with contextlib.suppress(FileNotFoundError, CheckpointError):
        lease_rec = LeaseRecord.from_bytes(storage.read_bytes(storage.path(layout.LEASE)))
    now = time.time()
    holder_gone = lease_rec is not None and holder_dead_here(lease_rec)
    lease_live = lease_rec is not None and now - lease_rec.renewed_at <= lease_rec.ttl_s and not holder_gone
    checkpoints = []
    retired = []
    committed_attempts: set[str] = set()  # on object stores a committed checkpoint's data stays in its attempt
    for name in names:
        info = CheckpointInfo(
            name.step, name.version, name.dirname, current[name.step] == name, latest.names(pointer, name)
        )
        try:
            m = root.read_manifest(name)
            committed_attempts.add(m.attempt)
            info.created_at, info.world_size, info.seq = m.created_at, m.world_size, m.commit_seq
            info.files, info.bytes, info.user_metadata = len(m.files), m.total_bytes, m.user_metadata
        except CheckpointError as e:
            if _retired(root, name, None):
                retired.append(root.dir(name))
                continue
            info.manifest_error = str(e)
        checkpoints.append(info)
    # Commit order, as Checkpointer.steps(): unsequenced (unreadable manifest) first by step, then by sequence.
    listing = {c.step: Committed(c.version, c.seq) for c in checkpoints if c.current}
    rolled_back = abandoned(listing)
    records = root.quarantined()
    for c in checkpoints:
        c.abandoned = c.current and c.step in rolled_back
        record = quarantine.matching(records, CheckpointName(c.step, c.version), c.seq)
        c.quarantined = record.reason if record is not None else None
    checkpoints.sort(key=lambda c: (*order_key(c.step, Committed(c.version, c.seq)), c.version))
    unlisted = root.unlisted_commits()
    committed_attempts.update(unlisted.values())  # their data is a commit's, not an abandoned attempt's
    attempts = []
    staging_root = storage.path(layout.STAGING)
    for entry in sorted(storage.listdir(staging_root)):
        full = os.path.join(staging_root, entry)
        parsed = layout.parse_staging(entry)
        if parsed is not None and parsed[1] in committed_attempts:
            continue
        mtime = storage.mtime(full)
        if mtime is None:
            continue
        age = now - mtime
        state = "in progress" if lease_live and lease_rec is not None and age <= lease_rec.ttl_s else "abandoned"
        attempts.append(
            AttemptInfo(
                parsed[0] if parsed else None,
                parsed[1] if parsed else entry,
                full,
                state,
                round(age, 1),
                _dir_bytes(root, full),
            )
        )
    trash = [os.path.join(storage.path(layout.TRASH), e) for e in sorted(storage.listdir(storage.path(layout.TRASH)))]
    lease = None
    if lease_rec is not None:
        lease = {**asdict(lease_rec), "live": lease_live, "holder_gone": holder_gone}
    return RootListing(
        storage.root,
        checkpoints,
        attempts,
        trash,
        lease,
        root.latest_problem(),
        unlisted=[storage.join(root.dir(n), layout.MANIFEST) for n in sorted(unlisted)],
        retired=retired,
    )


def quarantined_result(info: CheckpointInfo, root_path: str) -> VerifyResult:
    """The verdict on a quarantined checkpoint of the root at ``root_path``, from its record alone
    (nothing is read again). Its problem names the checkpoint's full path, as every other problem does."""
    assert info.quarantined is not None
    detail = (
        f"a load found it corrupt ({info.quarantined}); loads skip it, and the next save of step "
        f"{info.step} replaces it (or delete it)"
    )
    where = open_root(root_path).dir(CheckpointName(info.step, info.version))
    return VerifyResult(
        info.step, info.version, info.dir, intact=False, problems=[Problem(where, "quarantined", detail)]
    )


def verify_checkpoint(
    root_path: str,
    name: CheckpointName,
    *,
    threads: int = 4,
    on_bytes: Callable[[int], None] | None = None,
    seq: int | None = None,
) -> VerifyResult:
    """Re-read every byte of one checkpoint and compare with its manifest.

    Args:
        root_path: the checkpoint root.
        name: the checkpoint (step and version) to check.
        threads: files read in parallel.
        on_bytes: called with the number of bytes after each chunk read (progress).
        seq: the commit sequence number ``name`` was listed with, if known: a step retired and saved
            again under the same name since is then reported as retired, not checked.

    Returns:
        The result. A checkpoint retired (retention, a delete) before or while it was read is
        ``retired`` with no problems, never a damaged one: whatever went missing went with it.
    """
    started = time.monotonic()
    root = open_root(root_path)
    result = VerifyResult(name.step, name.version, name.dirname, intact=False)
    try:
        manifest = root.read_manifest(name)
    except CheckpointError as e:
        result.problems.append(Problem(os.path.join(root.dir(name), layout.MANIFEST), "manifest", str(e)))
        manifest = None
    if manifest is not None:
        _check_bytes(root, name, manifest, result, threads, on_bytes)
    listed_seq = seq if seq is not None else manifest.commit_seq if manifest is not None else None
    replaced = manifest is not None and seq is not None and manifest.commit_seq != seq
    # A problem may be the retirement itself (the manifest or files gone): asked after the read.
    if (result.errors or replaced) and _retired(root, name, listed_seq):
        result.problems, result.retired = [], True
    result.intact = not result.errors and not result.retired
    result.seconds = round(time.monotonic() - started, 3)
    return result


def _check_bytes(
    root: Root,
    name: CheckpointName,
    manifest: Manifest,
    result: VerifyResult,
    threads: int,
    on_bytes: Callable[[int], None] | None,
) -> None:
    storage = root.storage
    base = root.data_dir(name, manifest)
    listed = {f.path for f in manifest.files} | {layout.MANIFEST}
    # A load opens only what the manifest lists: anything else is reported, and judged by no reader
    # (a listed file that is missing or not a regular file is an error of its own, below).
    for rel, size in root.walk(base):
        if size == NOT_A_FILE:
            result.problems.append(
                Problem(
                    os.path.join(base, rel),
                    "extra",
                    "not a regular file or directory (a symbolic link, FIFO or device): not followed, "
                    "added after the commit; no load reads it",
                    severity="warning",
                )
            )
        elif rel not in listed:
            result.problems.append(
                Problem(
                    os.path.join(base, rel),
                    "extra",
                    "file not in the manifest: added after the commit; no load reads it",
                    severity="warning",
                )
            )
    items_by_file: dict[str, list[StoredItem]] = {}
    for item in manifest.items:
        items_by_file.setdefault(item.file, []).append(item)
    algorithm = manifest.checksum_algorithm

    def check_file(entry_path: str, size: int, file_checksum: str | None) -> list[Problem]:
        path = os.path.join(base, entry_path)
        actual = storage.size(path)
        if actual is None:
            return [Problem(path, "missing", "file is missing (or not a regular file)")]
        if actual != size:
            return [Problem(path, "size", f"{actual} bytes, the manifest says {size}")]
        found: list[Problem] = []
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        try:
            handle = storage.open_read(path)
        except (OSError, CheckpointError) as e:
            return [Problem(path, "missing", f"cannot be read: {e}")]
        try:
            spans: list[tuple[int, int, str, str]]
            if file_checksum is not None:
                spans = [(0, size, file_checksum, "whole file")]
            else:
                spans = [(i.offset, i.length, i.checksum, i.fqn) for i in items_by_file.get(entry_path, [])]
            for offset, length, expected, what in sorted(spans):
                hasher = Hasher(algorithm)
                pos = 0
                while pos < length:
                    n = min(CHUNK_BYTES, length - pos)
                    try:
                        handle.read_into([view[:n]], offset + pos)
                    except CheckpointError:
                        break
                    hasher.update(view[:n])
                    pos += n
                    if on_bytes is not None:
                        on_bytes(n)
                got = hasher.hexdigest()
                if pos != length or got != expected:
                    found.append(
                        Problem(
                            path,
                            "checksum",
                            f"{what} (bytes {offset}..{offset + length}): checksum {got}, expected {expected}",
                        )
                    )
        finally:
            handle.close()
        return found

    with ExitSafePool(max(1, threads), thread_name_prefix="ckptguard-verify") as pool:
        futures = [pool.submit(check_file, f.path, f.size, f.checksum) for f in manifest.files]
        for fut in futures:
            result.problems.extend(fut.result())
    result.files_checked = len(manifest.files)
    result.bytes_checked = manifest.total_bytes


def checkpoint_bytes(root_path: str, name: CheckpointName) -> int:
    try:
        return open_root(root_path).read_manifest(name).total_bytes
    except CheckpointError:
        return 0


#: Where a root keeps its stable identity, relative to the root: a random id created once and never
#: replaced (integrations bind their pointer files to it; ``Checkpointer.root_id`` creates it).
ROOT_ID_RECORD = layout.ROOT_ID


def read_root_id(root: str) -> str | None:
    """The stable identity of ``root`` (a directory or URL), or None if it has none yet.

    Raises:
        CorruptCheckpointError: The record is damaged.
    """
    return rootid.read(open_storage(root))


def step_binding(root: str, step: int) -> tuple[int | None, str]:
    """What identifies committed ``step`` of ``root`` as it is now, for a pointer bound to it.

    Args:
        root: The checkpoint root.
        step: A committed step.

    Returns:
        The step's commit sequence number and the SHA-256 of its manifest's bytes.

    Raises:
        StepNotFoundError: ``step`` is not committed in ``root``.
        CheckpointError: The manifest cannot be read or parsed.
    """
    where = open_root(root)
    current = where.current()
    if step not in current:
        raise StepNotFoundError(f"step {step} is not a committed checkpoint in {root}", path=root)
    data = where.read_manifest_bytes(current[step])
    return where.parse_manifest(current[step], data).commit_seq, hashlib.sha256(data).hexdigest()
