"""Hugging Face Trainer: every ``checkpoint-N`` committed through ckptguard before it is visible.

    from ckptguard.integrations.hf import CkptguardTrainer
    trainer = CkptguardTrainer(model=model, args=TrainingArguments(..., save_total_limit=2), ...)
    trainer.train(resume_from_checkpoint=True)     # only ever a committed, verified checkpoint

A drop-in ``Trainer`` subclass (a callback cannot do it: ``on_save`` runs after Trainer has
already written into ``checkpoint-N`` and rotated). What changes, per save:

1. Trainer's own code writes the checkpoint (model, optimizer, scheduler, scaler, every rank's
   RNG file, ``trainer_state.json``; whatever strategy it uses) into a staging directory,
   ``output_dir/.ckptguard-hf-staging/checkpoint-N.<attempt>/checkpoint-N``, never into
   ``checkpoint-N`` itself.
2. All ranks meet; the main process commits the staging directory as step N of the ckptguard
   root ``output_dir/.ckptguard-hf`` (every file checksummed and fsynced, one atomic commit;
   a crash before it leaves the previous checkpoints as they were).
3. Only then does ``output_dir/checkpoint-N`` appear, by one rename of the staging directory
   (for ``from_pretrained``, ``load_best_model_at_end`` and other tools), and only then are
   old checkpoints rotated out (``save_total_limit``; the newest and the best are kept):
   the visible directory first, then the committed step.

Resume (``train(resume_from_checkpoint=True)``) picks the newest *committed* step (an older one,
with a warning, if its bytes do not verify), never a directory by its name (except on the first start of
a run switching from plain ``Trainer``: no ckptguard root yet and plain ``checkpoint-N`` directories
present, it resumes from the newest of those, as plain Trainer would, with a warning; rotation only
ever deletes steps ckptguard committed, so the plain ones stay): the main process
decides, every rank restores that step's files, verified, into a private temporary directory
(``restore_dir``, default the system's), and Trainer's own loaders read them from there.
``resume_from_checkpoint="output_dir/checkpoint-N"`` loads committed step N (or raises); a
path outside ``output_dir`` is an ordinary Trainer checkpoint and is passed through unchanged.

Costs: the data is stored twice (the committed copy and the visible ``checkpoint-N``);
``publish=False`` keeps only the committed copy (then ``checkpoint-N`` never appears and
``load_best_model_at_end`` cannot be used). Each save writes its bytes twice (Trainer into
staging, ckptguard into its root). Requires ``output_dir`` to be shared by all ranks (Trainer's
default assumption; ``save_on_each_node=True`` is refused). ``push_to_hub`` pushes from the
staging directory, before the commit.

Tested with transformers 5.18.0 (from a clone: ``pip install -e '.[transformers]'``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any

from ckptguard.integrations._extra import missing_extra

try:
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint
except ImportError as e:  # the framework is an extra
    raise missing_extra("hf", "transformers", e) from e


from ckptguard.checkpointer import Checkpointer
from ckptguard.discover import FRAMEWORK_KEY, HF_ROOT
from ckptguard.integrations import _dirs
from ckptguard.ranks import broadcast, one_rank_acts

log = logging.getLogger(__name__)

ROOT_NAME = HF_ROOT
STAGING_NAME = ".ckptguard-hf-staging"
_FOLDER_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CkptguardTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are committed through ckptguard.

    Use it instead of ``transformers.Trainer``: ``checkpoint-N`` appears only once committed;
    ``train(resume_from_checkpoint=True)`` resumes from the newest committed, verified checkpoint, or
    trains from scratch on a fresh start (one log line says so). See the module's description above.

    Example:
        ```python
        CkptguardTrainer(model=model, args=args, train_dataset=ds).train(resume_from_checkpoint=True)
        ```

    Args:
        *args: As for ``transformers.Trainer``.
        publish: Make the visible ``checkpoint-N`` directory (default True).
        restore_dir: Where each rank restores the checkpoint it resumes from (default: the system's
            temporary directory).
        checkpointer_options: Keyword arguments for the ``Checkpointer``.
        **kwargs: As for ``transformers.Trainer``.

    Raises:
        ValueError: ``save_on_each_node=True`` (the output directory must be shared by all ranks).
    """

    def __init__(
        self,
        *args: Any,
        publish: bool = True,
        restore_dir: str | None = None,
        checkpointer_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.save_on_each_node:
            raise ValueError(
                "CkptguardTrainer needs an output_dir shared by all ranks: save_on_each_node=True is not supported"
            )
        self.ckptguard_publish = publish
        self.ckptguard_restore_dir = restore_dir
        self.ckptguard_options = dict(checkpointer_options or {})
        self._ckptguard_writer: Checkpointer | None = None
        self._ckptguard_staging_run_dir: str | None = None

    # -- where things are ---------------------------------------------------------------
    @staticmethod
    def ckptguard_root(run_dir: str) -> str:
        """The ckptguard root holding the committed checkpoints of ``run_dir``."""
        return os.path.join(run_dir, ROOT_NAME)

    def _get_output_dir(self, trial: Any) -> str:
        if self._ckptguard_staging_run_dir is not None:  # inside _save_checkpoint: Trainer writes to staging
            return self._ckptguard_staging_run_dir
        out: str = super()._get_output_dir(trial)
        return out

    def _is_main(self) -> bool:
        return bool(self.args.process_index == 0)

    def _writer(self, run_dir: str) -> Checkpointer:
        root = self.ckptguard_root(run_dir)
        ck = self._ckptguard_writer
        if ck is None or os.path.normpath(ck.root) != os.path.normpath(root):
            if ck is not None:
                ck.close()
            ck = self._ckptguard_writer = Checkpointer(root, process_group="local", **self.ckptguard_options)
        return ck

    # -- save ---------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = self._get_output_dir(trial)
        step = int(self.state.global_step)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        attempt = broadcast(uuid.uuid4().hex[:12])  # one staging name for all ranks
        staging_run_dir = os.path.join(run_dir, STAGING_NAME, f"{folder}.{attempt}")
        staging = os.path.join(staging_run_dir, folder)
        # Trainer's own save, into staging. Its rotation runs there too, over that one directory: a no-op.
        self._ckptguard_staging_run_dir = staging_run_dir
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._ckptguard_staging_run_dir = None
        if self.args.should_save and self.state.best_global_step:
            # Trainer looked for the best checkpoint in staging: point it at the visible directory.
            best = int(self.state.best_global_step)
            if best == step or os.path.isdir(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")):
                self.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
                self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
        self.accelerator.wait_for_everyone()  # every rank's files are in staging
        one_rank_acts(
            f"commit {folder} to {self.ckptguard_root(run_dir)}",
            lambda: self._commit_on_main(run_dir, step, folder, staging),
            where=run_dir,
        )

    def _commit_on_main(self, run_dir: str, step: int, folder: str, staging: str) -> None:
        """Commit the staged checkpoint as ``step``, then publish it and rotate old ones out (the main process)."""
        ck = self._writer(run_dir)
        ours = step in ck.steps()
        visible = os.path.join(run_dir, folder)
        # A complete checkpoint plain Trainer wrote (a run switched to ckptguard) is the user's: never replaced.
        theirs = not ours and os.path.isfile(os.path.join(visible, "trainer_state.json"))
        ck.save(
            step,
            {"hf": {"folder": folder, "world_size": int(self.args.world_size)}},
            files={_dirs.FILES_KEY: staging},
            overwrite=ours,
            metadata={
                FRAMEWORK_KEY: "transformers",
                "folder": folder,
                "global_step": step,
                **({"epoch": float(self.state.epoch)} if self.state.epoch is not None else {}),
            },
        )
        # Committed: now Trainer and the user may see it, and only now may old ones go.
        if theirs:
            log.warning(
                "ckptguard: %s was written by plain Trainer, not ckptguard: kept as it is; step %d is "
                "committed in %s but not published over it",
                visible,
                step,
                self.ckptguard_root(run_dir),
            )
        elif self.ckptguard_publish:
            _dirs.publish(ck, run_dir, staging, folder, os.path.join(run_dir, STAGING_NAME))
        self._rotate_committed(run_dir)
        _dirs.clear_staging(ck, os.path.join(run_dir, STAGING_NAME))

    def _rotate_committed(self, run_dir: str) -> None:
        ck = self._writer(run_dir)
        best = self.state.best_model_checkpoint
        m = _FOLDER_RE.match(os.path.basename(os.path.normpath(best))) if best else None
        _dirs.rotate(
            ck,
            self.args.save_total_limit,
            {int(m.group(1))} if m else set(),
            run_dir,
            {s: f"{PREFIX_CHECKPOINT_DIR}-{s}" for s in ck.steps()},
            os.path.join(run_dir, STAGING_NAME),
        )

    # -- resume -------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        restored: str | None = None
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            restored, resume_from_checkpoint = self._restore(resume_from_checkpoint)
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
            )
        finally:
            if restored is not None:
                shutil.rmtree(restored, ignore_errors=True)
            if self._ckptguard_writer is not None:
                self._ckptguard_writer.close()
                self._ckptguard_writer = None

    def _restore(self, resume: str | bool) -> tuple[str | None, str | bool | None]:
        """Restore the committed checkpoint to resume from; (temporary directory, path for Trainer)."""
        run_dir = os.path.abspath(str(self.args.output_dir))
        root = self.ckptguard_root(run_dir)
        wanted: int | None = None
        if not isinstance(resume, bool):
            path = os.path.abspath(os.fspath(resume))
            m = _FOLDER_RE.match(os.path.basename(os.path.normpath(path)))
            # By identity, not by spelling: a symlink to output_dir names its checkpoints all the same.
            if m is None or not _dirs.same_dir(os.path.dirname(os.path.normpath(path)), run_dir):
                return None, resume  # an ordinary Trainer checkpoint from elsewhere
            wanted = int(m.group(1))
        tmp = tempfile.mkdtemp(prefix="ckptguard-hf-", dir=self.ckptguard_restore_dir)
        try:

            def restore_on_main(dest: str) -> tuple[int, str] | None:
                got = _dirs.restore_step(root, wanted, dest)
                return (got, f"{PREFIX_CHECKPOINT_DIR}-{got}") if got is not None else None

            restored = _dirs.restore_on_every_rank(root, tmp, self._is_main(), restore_on_main, what="resume from")
            if restored is None:
                if wanted is None and not os.path.isdir(root):
                    plain = one_rank_acts(
                        f"look for a plain Trainer checkpoint in {run_dir}",
                        lambda: get_last_checkpoint(run_dir),  # type: ignore[no-untyped-call]
                    )
                    if plain is not None:  # a run switching to ckptguard: continue it, as plain Trainer would
                        log.warning(
                            "ckptguard: no ckptguard checkpoint yet in %s: resuming from %s, a checkpoint "
                            "plain Trainer wrote (not verified); from now on checkpoints are committed "
                            "through ckptguard, and the plain ones are never deleted by it",
                            run_dir,
                            plain,
                        )
                        shutil.rmtree(tmp, ignore_errors=True)
                        return None, plain
                if wanted is None:  # resume_from_checkpoint=True on a fresh start: train from scratch
                    log.warning("ckptguard: no committed checkpoint in %s: training from scratch", root)
                    shutil.rmtree(tmp, ignore_errors=True)
                    return None, None
                raise ValueError(f"No committed checkpoint found in {root} (output directory {run_dir})")
            step, target = restored
            log.info("ckptguard: resuming from committed step %d of %s", step, root)
            return tmp, target
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
