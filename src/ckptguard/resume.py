"""Which step is safe to resume from, which are not and why, and the line that resumes.

Answered from what `list_root` and `verify_checkpoint` read (no process group, no torch tensors):
the step is the checkpoint committed last whose manifest reads and whose files are all there with
their recorded sizes (the quick checks), or, with ``deep=True``, whose every byte matches its
checksum. Steps committed after it that fail those checks, steps rolled back past, and save
attempts that never committed are the unsafe ones, each with its reason.

A root that belongs to a framework integration (``.ckptguard-hf`` under a Trainer's output_dir, ...:
the registry ``ckptguard.frameworks``) is found when the directory given is the framework's, and the
hint is then the framework's own resume call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptguard.discover import find_roots
from ckptguard.errors import CheckpointError
from ckptguard.frameworks import ResumePoint, resume_hint
from ckptguard.protocol.layout import CheckpointName
from ckptguard.protocol.root import open_root
from ckptguard.storage import Backend, backend_for, local_path, open_storage
from ckptguard.verify import CheckpointInfo, RootListing, list_root, verify_checkpoint


@dataclass
class UnsafeStep:
    step: int
    reason: str


@dataclass
class ResumeInfo:
    """The resume section of a report; ``to_json`` is the documented ``resume`` object."""

    step: int | None
    root: str
    unsafe: list[UnsafeStep] = field(default_factory=list)
    resume_hint: str = ""
    checked: str = "quick"  # "quick" (manifests and sizes) or "deep" (every byte checksummed)
    framework: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "root": self.root,
            "unsafe": [{"step": u.step, "reason": u.reason} for u in self.unsafe],
            "resume_hint": self.resume_hint,
        }


def _unreachable(root: str, backend: Backend) -> str | None:
    """Why the object store holding ``root`` cannot be read (None: it answered), from one quick request
    (the backend's ``quick_options``): an endpoint that cannot be reached is said in seconds, not after
    every request's retries (minutes)."""
    try:
        storage = open_storage(root, backend.quick_options)
        storage.listdir(storage.root)
    except (OSError, CheckpointError, ValueError) as e:
        return str(e)
    return None


def _framework_root(root: str) -> tuple[str, str | None, list[str]]:
    """(the ckptguard root to read, the framework it belongs to or None, every root found): the root
    itself, or the one a framework's directory (or a directory of runs) holds (``ckptguard.discover``)."""
    try:
        found = find_roots(root)
    except CheckpointError:
        return root, None, []  # missing or unreadable: resume_info says so
    if not found:
        return root, None, []
    return found[0].path, found[0].framework, [f.path for f in found]


def _quick_problem(root: str, info: CheckpointInfo) -> str | None:
    """What the quick checks find wrong with one committed checkpoint (None: nothing)."""
    if info.manifest_error:
        return f"bad manifest: {info.manifest_error}"
    croot = open_root(root)
    storage = croot.storage
    name = CheckpointName(info.step, info.version)
    try:
        manifest = croot.read_manifest(name)
    except CheckpointError as e:
        return f"bad manifest: {e}"
    base = croot.data_dir(name, manifest)
    for f in manifest.files:
        path = storage.join(base, f.path)
        actual = storage.size(path)
        if actual is None:
            return f"missing file {path}"
        if actual != f.size:
            return f"corrupt file {path}: {actual} bytes, the manifest says {f.size}"
    return None


def _listed_problem(info: CheckpointInfo) -> str | None:
    """What `ckptguard ls` shows wrong with a committed checkpoint without reading its files."""
    if info.manifest_error:
        return f"bad manifest: {info.manifest_error}"
    if info.quarantined:
        return f"quarantined: a load found it corrupt ({info.quarantined})"
    if info.abandoned:
        return "rolled back: a lower step was committed after it"
    return None


def _deep_problem(root: str, info: CheckpointInfo) -> str | None:
    result = verify_checkpoint(root, CheckpointName(info.step, info.version))
    if result.intact:
        return None
    if result.retired:
        return "retired (by the job's retention or a delete) while it was checked"
    errors = result.errors
    p = errors[0]
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"corrupt file {p.path}: {p.kind}: {p.detail}{more}"


def _hint(framework: str | None, ck_root: str, step: int, info: CheckpointInfo) -> str:
    """A line that resumes: it names the root that holds the step (``ck_root``, found under the directory
    given), never the directory given, from which ``Checkpointer`` would load nothing."""
    return resume_hint(framework, ResumePoint(ck_root, step, info.user_metadata or {}))


def resume_info(root: str, *, deep: bool = False) -> ResumeInfo:
    """The step to resume from in ``root`` (POSIX path or s3:// URL). Never raises for a root that
    is missing, empty or unreadable: the answer is then ``step=None`` and the hint says why."""
    checked = "deep" if deep else "quick"
    try:
        backend = backend_for(root)
        local = local_path(root) if backend.filesystem else None
    except CheckpointError as e:
        return ResumeInfo(None, root, checked=checked, resume_hint=f"no answer: {e}")
    if local is None:
        unreachable = _unreachable(root, backend)
        if unreachable is not None:
            return ResumeInfo(None, root, checked=checked, resume_hint=f"no answer: cannot read {root}: {unreachable}")
    ck_root, framework, roots = _framework_root(root)
    info = ResumeInfo(None, root, checked=checked, framework=framework)
    if len(roots) > 1:  # which one the job saved to is not ours to guess
        info.resume_hint = (
            f"no answer: {root} holds {len(roots)} checkpoint roots ({', '.join(roots)}); give "
            "the one this job saved to with --checkpoints"
        )
        return info
    if local is not None and not os.path.exists(local):
        info.resume_hint = (
            f"no answer: {root} does not exist (the job saved no checkpoint there); it starts from scratch"
        )
        return info
    try:
        listing: RootListing = list_root(ck_root)
    except CheckpointError as e:
        info.resume_hint = f"no answer: cannot read {root} as a checkpoint root: {e}"
        return info
    current = [c for c in listing.checkpoints if c.current]
    for a in listing.attempts:
        if a.step is not None:
            info.unsafe.append(UnsafeStep(a.step, f"uncommitted attempt ({a.state}) in {a.dir}: never committed"))
    chosen: CheckpointInfo | None = None
    for c in reversed(current):  # commit order: the last committed comes last
        # Older than the answer, rolled back, quarantined or unreadable: what the listing alone shows (no reads).
        if chosen is not None or c.abandoned or c.manifest_error or c.quarantined:
            problem = _listed_problem(c)
        else:
            try:
                problem = _deep_problem(ck_root, c) if deep else _quick_problem(ck_root, c)
            except CheckpointError as e:
                problem = f"cannot be read: {e}"
        if problem is not None:
            info.unsafe.append(UnsafeStep(c.step, problem))
        elif chosen is None:
            chosen = c
    info.unsafe.sort(key=lambda u: u.step)
    if chosen is None:
        if current:
            info.resume_hint = (
                f"no answer: none of the {len(current)} committed checkpoints in {root} passes "
                f"the {info.checked} checks; it starts from scratch"
            )
        else:
            info.resume_hint = f"no answer: {root} holds no committed checkpoint; it starts from scratch"
        return info
    info.step = chosen.step
    info.resume_hint = _hint(framework, ck_root, chosen.step, chosen)
    return info
