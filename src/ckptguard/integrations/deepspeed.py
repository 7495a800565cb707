"""DeepSpeed: a checkpoint engine that commits each tag through ckptguard, and an atomic ``latest``.

    engine, optimizer, _, _ = deepspeed.initialize(...)
    from ckptguard.integrations.deepspeed import install
    install(engine)                                    # one line, after deepspeed.initialize
    engine.save_checkpoint(save_dir, tag=...)          # unchanged calls
    engine.load_checkpoint(save_dir)                   # the newest committed, verified tag

DeepSpeed's own ``save_checkpoint`` writes every rank's files straight into ``save_dir/<tag>``
with ``torch.save`` (no fsync), then global rank 0 writes ``latest`` with ``open('w')`` without
waiting for the other ranks' files, so ``latest`` can name a tag whose shards are not all written
(and a crash during that write leaves it empty); ``load_checkpoint()`` trusts ``latest``. Its
NVMe-offload copy (``shutil.copytree`` of each rank's optimizer swap folder into
``save_dir/<tag>/offloaded_tensors/rank<NN>``, ``dirs_exist_ok=False``) bypasses the checkpoint engine and,
with ``use_node_local_storage``, is named by the local rank.

``install(engine)`` replaces ``engine.checkpoint_engine`` (DeepSpeed's ``CheckpointEngine``
interface; DeepSpeed has no configuration key for a custom engine) and wraps the engine's
``save_checkpoint`` / ``load_checkpoint``:

- ``save_checkpoint(save_dir, tag)``: all ranks agree on a fresh attempt directory,
  ``save_dir/.ckptguard-deepspeed-staging/<tag>.<attempt>``, and DeepSpeed's own ``save_checkpoint`` is
  given it as its ``save_dir``: every file it writes for the tag lands in ``<attempt>/<tag>`` (the
  staging directory), the NVMe-offload copy included, and nothing appears under ``save_dir/<tag>``
  before the commit (its ``zero_to_fp32.py``/``zero_to_torch.py`` go to ``save_dir`` at the commit).
  With NVMe offload, a save in which several ranks' copies would share one ``offloaded_tensors/rank<NN>``
  (``use_node_local_storage`` with more than one node) is refused on every rank with
  ``PathCollisionError`` before anything is written;
- ``save``/``makedirs``: every file is created exclusively (``O_EXCL``): two ranks writing one path
  (e.g. ``use_node_local_storage`` on storage that is in fact shared, where every node's local rank 0
  writes ``mp_rank_00_model_states.pt``) is refused with ``PathCollisionError`` instead of one rank's
  file silently replacing another's. (DeepSpeed's own calls of ``create``/``save``/``commit`` outside
  ``save_checkpoint`` stage what they write under ``save_dir/<tag>``.)
- ``commit``: all ranks meet; global rank 0 commits the staging directory as a step of the
  ckptguard root ``save_dir/.ckptguard-deepspeed`` (every file checksummed and fsynced, one
  atomic commit), then ``save_dir/<tag>`` appears (one rename) and ``latest`` is replaced
  atomically (temp file, fsync, rename, directory fsync); DeepSpeed's own ``open('w')`` of
  ``latest`` is switched off (``save_latest=False`` is passed to it);
- ``load_checkpoint(save_dir, tag=None)``: global rank 0 picks the newest committed tag (an older
  one, with a warning, if its bytes do not verify) and broadcasts it; every rank restores that
  tag's files, verified, into a private temporary directory (``restore_dir``) and DeepSpeed's own
  loader reads them from there. ``latest`` is not consulted. A ``tag=`` that was never committed
  raises ``CheckpointError``.

The ckptguard step of a tag is the number at its end (``global_step120`` is step 120), else the next
free step; the tag itself is stored with the checkpoint. Costs: each rank restores the whole tag on
load (DeepSpeed's ZeRO-1/2 loader reads every rank's shard anyway); data is stored twice (the
committed copy and ``save_dir/<tag>``; ``publish=False`` keeps only the committed copy) and written
twice per save. ``save_dir`` must be shared by all ranks.

Tested with deepspeed 0.19.8 built with ``DS_BUILD_OPS=0``, ``DS_ACCELERATOR=cpu``, gloo, ZeRO-2, and
ZeRO-3 with NVMe optimizer offload where DeepSpeed's ``async_io`` op is built (libaio-dev), else a
stand-in for its swapper (from a clone: ``pip install -e '.[deepspeed]'``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist

from ckptguard.integrations._extra import missing_extra

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (  # type: ignore[import-untyped]
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as e:  # the framework is an extra
    raise missing_extra("deepspeed", "deepspeed", e) from e


from ckptguard.checkpointer import Checkpointer
from ckptguard.discover import DEEPSPEED_ROOT, FRAMEWORK_KEY
from ckptguard.errors import CheckpointError, PathCollisionError
from ckptguard.files import replace_file, replacing
from ckptguard.integrations import _dirs
from ckptguard.ranks import all_gather, barrier, broadcast, one_rank_acts

log = logging.getLogger(__name__)

ROOT_NAME = DEEPSPEED_ROOT
STAGING_NAME = ".ckptguard-deepspeed-staging"
_NUMBER_AT_END = re.compile(r"(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class CkptguardCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """DeepSpeed ``CheckpointEngine`` through ckptguard (module docstring). Use ``install(engine)``."""

    def __init__(
        self, config_params: Any = None, *, publish: bool = True, checkpointer_options: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config_params)
        self.name = "CkptguardCheckpointEngine"
        self.publish = publish
        self.checkpointer_options = dict(checkpointer_options or {})
        self.want_latest = True  # what the caller of save_checkpoint asked for (set by install's wrapper)
        self._writers: dict[str, Checkpointer] = {}
        self._begun: tuple[str, str, str] | None = None  # begin(): save_dir, tag, this save's attempt directory
        self._save_dir: str | None = None
        self._tag: str | None = None
        self._staging: str | None = None

    # -- where things go ----------------------------------------------------------------
    def _redirect(self, path: str) -> str:
        """``save_dir/<tag>/x`` -> ``staging/x`` during a save; anything else unchanged."""
        if self._save_dir is None or self._tag is None or self._staging is None:
            return path
        visible = os.path.join(self._save_dir, self._tag)
        p = os.path.abspath(path)
        if p == visible:
            return self._staging
        if p.startswith(visible + os.sep):
            return os.path.join(self._staging, os.path.relpath(p, visible))
        return path

    def _writer(self, save_dir: str) -> Checkpointer:
        root = os.path.join(save_dir, ROOT_NAME)
        ck = self._writers.get(root)
        if ck is None:
            ck = self._writers[root] = Checkpointer(root, process_group="local", **self.checkpointer_options)
        return ck

    def begin(self, save_dir: str, tag: str) -> str:
        """Agree with the other ranks on this save's attempt directory,
        ``save_dir/.ckptguard-deepspeed-staging/<tag>.<attempt>``: ``install``'s wrapper passes it to DeepSpeed's
        ``save_checkpoint`` as its ``save_dir``, so that everything DeepSpeed writes for the tag lands in
        ``<attempt>/<tag>``, its NVMe-offload copy too (a ``copytree`` that bypasses the engine)."""
        save_dir = os.path.abspath(save_dir)
        attempt = os.path.join(save_dir, STAGING_NAME, f"{tag}.{broadcast(uuid.uuid4().hex[:12])}")
        self._begun = (save_dir, tag, attempt)
        return attempt

    # -- CheckpointEngine -----------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        begun, self._begun = self._begun, None
        if begun is not None and (os.path.abspath(info.save_dir), str(info.tag)) == (begun[2], begun[1]):
            save_dir, tag, attempt = begun
        else:  # DeepSpeed's own call (save_16bit_model) or its save_checkpoint without install's wrapper
            save_dir, tag = os.path.abspath(info.save_dir), str(info.tag)
            attempt = os.path.join(save_dir, STAGING_NAME, f"{tag}.{broadcast(uuid.uuid4().hex[:12])}")
        self._save_dir, self._tag, self._staging = save_dir, tag, os.path.join(attempt, tag)
        os.makedirs(self._staging, exist_ok=True)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(self._redirect(path), exist_ok=True if self._staging else exist_ok)

    def _in_this_tag(self, path: str) -> bool:
        if self._save_dir is None or self._tag is None or self._staging is None:
            return False
        p = os.path.abspath(path)
        return any(
            p == d or p.startswith(d + os.sep)
            for d in (os.path.join(self._save_dir, self._tag), os.path.abspath(self._staging))
        )

    def save(self, state_dict: Any, path: str) -> None:
        if not self._in_this_tag(path):
            # Not a file of a checkpoint tag: e.g. save_16bit_model's export (save_dir/pytorch_model.bin),
            # which DeepSpeed wraps in create/commit too. Written atomically, replacing an older export.
            _save_replacing(state_dict, path)
            return
        target = self._redirect(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise PathCollisionError(
                f"rank {_rank()}: {os.path.basename(path)} of tag {self._tag} was already written by another rank "
                f"(e.g. use_node_local_storage on storage that all nodes share); refusing to overwrite it",
                path=path,
            ) from None
        with os.fdopen(fd, "wb") as f:
            torch.save(state_dict, f)

    def load(self, path: str, map_location: Any = None) -> Any:
        # What DeepSpeed's own TorchCheckpointEngine does (its checkpoints hold pickled objects); the
        # bytes were verified against the commit when they were restored for this load.
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        save_dir, tag, staging = self._save_dir, self._tag, self._staging
        if save_dir is None or tag is None or staging is None:
            raise CheckpointError("commit without create: the checkpoint engine was installed mid-save")
        try:
            barrier()  # every rank's files are in staging
            one_rank_acts(
                f"commit DeepSpeed tag {tag} to {os.path.join(save_dir, ROOT_NAME)}",
                lambda: self._commit_on_rank0(save_dir, tag, staging),
                where=save_dir,
            )
            return True
        finally:
            self._save_dir = self._tag = self._staging = None

    def _commit_on_rank0(self, save_dir: str, tag: str, staging: str) -> None:
        staging_root = os.path.join(save_dir, STAGING_NAME)
        if not any(files for _, _, files in os.walk(staging)):
            # Nothing of the tag was written (save_16bit_model: its export lies beside the tags), so there is
            # no checkpoint to commit: committing it would replace a real tag of the same step by an empty one.
            # Only this save's own (empty) attempt goes: the rest of staging is cleared under the lease.
            shutil.rmtree(os.path.dirname(staging), ignore_errors=True)
            return
        ck = self._writer(save_dir)
        m = _NUMBER_AT_END.search(tag)
        existing = _step_of_tag(ck, tag)
        if existing is not None:
            step = existing
        elif m is not None and int(m.group(1)) not in ck.steps():
            step = int(m.group(1))
        else:
            step = max(ck.steps(), default=-1) + 1
        ck.save(
            step,
            {"deepspeed": {"tag": tag}},
            files={_dirs.FILES_KEY: staging},
            overwrite=step in ck.steps(),
            metadata={FRAMEWORK_KEY: "deepspeed", "tag": tag},
        )
        attempt = os.path.dirname(staging)  # DeepSpeed's save_dir: its zero_to_fp32.py & co. belong in save_dir
        for name in os.listdir(attempt):
            if name != tag and os.path.isfile(os.path.join(attempt, name)):
                ck.check_lease(f"replace {os.path.join(save_dir, name)}")
                os.replace(os.path.join(attempt, name), os.path.join(save_dir, name))
        if self.publish:
            _dirs.publish(ck, save_dir, staging, tag, staging_root)
        if self.want_latest:
            ck.check_lease(f"move {os.path.join(save_dir, 'latest')}")
            replace_file(os.path.join(save_dir, "latest"), tag.encode())
        _dirs.clear_staging(ck, staging_root)

    def cleanup(self) -> None:
        writers, self._writers = self._writers, {}
        for ck in writers.values():
            ck.close()


def _save_replacing(state_dict: Any, path: str) -> None:
    """torch.save to a temporary file beside ``path``, fsync, then rename over it: readers see the old
    file or the new one, never a torn one."""
    with replacing(path) as f:
        torch.save(state_dict, f)


def _step_of_tag(ck: Checkpointer, tag: str) -> int | None:
    """The committed step holding ``tag`` (the number at its end first, then a search, newest first)."""
    m = _NUMBER_AT_END.search(tag)
    candidates = sorted(ck.steps(), reverse=True)
    if m is not None and int(m.group(1)) in candidates:
        candidates.remove(int(m.group(1)))
        candidates.insert(0, int(m.group(1)))
    for s in candidates:
        meta = ck.read(step=s) or {}
        if meta.get("deepspeed", {}).get("tag") == tag:
            return s
    return None


def _restore_on_rank0(root: str, tag: str | None, target: str) -> tuple[int, str] | None:
    if not os.path.isdir(root):
        if tag is not None:
            raise CheckpointError(f"tag {tag!r} was never committed: {root} does not exist", path=root)
        return None
    with Checkpointer(root, process_group="local", read_only=True) as ck:
        step = None if tag is None else _step_of_tag(ck, tag)
        if tag is not None and step is None:
            raise CheckpointError(f"tag {tag!r} is not a committed checkpoint in {root}", path=root)
        got = ck.load({}, step=step, files={_dirs.FILES_KEY: target})
        if got is None:
            return None
        meta = ck.read(step=got) or {}
        return got, str(meta["deepspeed"]["tag"])


def _refuse_shared_offload_dirs(engine: Any, tag: str) -> None:
    """Refuse, on every rank and before anything is written, a save in which DeepSpeed would copy several ranks'
    NVMe swap folders into one ``<tag>/offloaded_tensors/rank<NN>``: it names the copy by the local rank with
    ``use_node_local_storage``, and ``save_dir`` is shared by all ranks."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str  # type: ignore[import-untyped]

    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    names = all_gather("rank" + dp_index_to_str(rank))
    for name in sorted(set(names)):
        ranks = [r for r, n in enumerate(names) if n == name]
        if len(ranks) > 1:
            raise PathCollisionError(
                f"ranks {ranks} would all copy their NVMe-offloaded optimizer state into "
                f"{tag}/offloaded_tensors/{name} (DeepSpeed names that copy by the local rank with "
                f"use_node_local_storage, and save_dir is shared by all ranks); refusing before anything is written",
                path=os.path.join(tag, "offloaded_tensors", name),
            )


def install(
    engine: Any,
    *,
    publish: bool = True,
    restore_dir: str | None = None,
    checkpointer_options: dict[str, Any] | None = None,
) -> CkptguardCheckpointEngine:
    """Make ``engine`` (a ``DeepSpeedEngine``) save and load through ckptguard.

    Replaces the engine's checkpoint engine and wraps ``save_checkpoint`` / ``load_checkpoint``: each tag
    is committed whole before it is visible, ``latest`` is written atomically after the commit and never
    trusted on load (the newest committed, verified tag is loaded). See the module's description above.

    Example:
        ```python
        engine, optimizer, _, _ = deepspeed.initialize(...)
        install(engine)
        engine.load_checkpoint(save_dir)   # (None, None) on a fresh start, as DeepSpeed's own
        ```

    Args:
        engine: The ``DeepSpeedEngine`` returned by ``deepspeed.initialize``.
        publish: Make the visible ``save_dir/<tag>`` directory and ``latest`` (default True).
        restore_dir: Where each rank restores the tag it loads (default: a temporary directory).
        checkpointer_options: Keyword arguments for the ``Checkpointer``.

    Returns:
        The installed ``CkptguardCheckpointEngine``.
    """
    ce = CkptguardCheckpointEngine(
        getattr(engine, "_config", None), publish=publish, checkpointer_options=checkpointer_options
    )
    engine.checkpoint_engine = ce
    save_checkpoint = engine.save_checkpoint
    load_checkpoint = engine.load_checkpoint

    def save(save_dir: str, tag: Any = None, client_state: Any = None, save_latest: bool = True, **kwargs: Any) -> Any:
        client_state = {} if client_state is None else client_state
        if not save_dir:  # DeepSpeed's own error
            return save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False, **kwargs)
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)  # DeepSpeed's default
        if engine.zero_nvme_offload_optimizer():
            _refuse_shared_offload_dirs(engine, tag)
        ce.want_latest = save_latest
        attempt = ce.begin(save_dir, tag)
        # DeepSpeed's own `latest` (open('w'), not waiting for the others) stays off: commit writes it
        return save_checkpoint(attempt, tag=tag, client_state=client_state, save_latest=False, **kwargs)

    def load(load_dir: str, tag: Any = None, **kwargs: Any) -> Any:
        load_dir = os.path.abspath(load_dir)
        root = os.path.join(load_dir, ROOT_NAME)
        tmp = tempfile.mkdtemp(prefix="ckptguard-deepspeed-", dir=restore_dir)
        try:
            tag_name = None if tag is None else str(tag)
            restored = _dirs.restore_on_every_rank(
                root, tmp, _rank() == 0, lambda dest: _restore_on_rank0(root, tag_name, dest)
            )
            if restored is None:
                log.warning("ckptguard: no committed checkpoint in %s", root)
                return None, None
            found_tag = os.path.basename(restored[1])
            path, client_state = load_checkpoint(tmp, tag=found_tag, **kwargs)
            barrier()
            if path is not None:  # where DeepSpeed read it -> where the user sees it
                path = os.path.join(load_dir, os.path.relpath(path, tmp))
            return path, client_state
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    engine.save_checkpoint = save
    engine.load_checkpoint = load
    return ce
