"""The framework integrations' registry: one entry per framework, read by discovery, resume and the CLI.

Each entry says how the framework's ckptguard root is recognised (the hidden directory it keeps beside
the framework's own files, or the ``framework`` key of a checkpoint's metadata), the line that resumes
from a step, the optional extra that installs the framework, and the module holding the integration.
:mod:`ckptguard.discover` finds roots with it, :mod:`ckptguard.resume` writes its hint with it and
``ckptguard ls``/``verify`` generate their help from it.

Adding a framework is one module (``ckptguard/integrations/<name>.py``, importing the framework behind
``_extra.missing_extra``) and one :class:`Framework` entry in :data:`FRAMEWORKS`. This module imports
no framework and nothing above it (it sits beside ``discover.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The key of a checkpoint's ``metadata=`` naming the integration that saved it.
FRAMEWORK_KEY = "framework"


@dataclass(frozen=True)
class ResumePoint:
    """What a resume hint is written from.

    Attributes:
        root: The ckptguard root that holds the step (never the directory the user gave).
        step: The step to resume from.
        metadata: The step's ``metadata=`` (empty if none).
    """

    root: str
    step: int
    metadata: Mapping[str, Any]

    @property
    def base(self) -> str:
        """The directory holding ``root``: the framework's own output directory for a hidden root."""
        return os.path.dirname(os.path.normpath(self.root))


@dataclass(frozen=True)
class Framework:
    """One framework integration.

    Attributes:
        name: The framework's name, as written under ``metadata["framework"]`` and reported by ``ls``.
        module: The integration's module (imported only by the user; never by ckptguard itself).
        extra: The pip extra that installs the framework: ``pip install 'ckptguard[<extra>]'``.
        describes: The directory a user knows, for help texts ("a Trainer ``output_dir``").
        hint: The line that resumes from a step of this framework's root.
        root_name: The hidden root the integration keeps beside the framework's files; None when the root
            is the framework's folder itself (recognised by the ``framework`` key of its metadata).
        beside: A directory name whose root is the hidden one beside it (Accelerate's automatic naming
            writes ``project_dir/checkpoints`` while the root is ``project_dir/.ckptguard-accelerate``).
    """

    name: str
    module: str
    extra: str
    describes: str
    hint: Callable[[ResumePoint], str]
    root_name: str | None = None
    beside: str | None = None


def _hf_hint(p: ResumePoint) -> str:
    return f'trainer.train(resume_from_checkpoint="{os.path.join(p.base, f"checkpoint-{p.step}")}")'


def _accelerate_hint(p: ResumePoint) -> str:
    return f"accelerator.load_state(step={p.step})  # CkptguardAccelerator; or load_state(accelerator, step={p.step})"


def _lightning_hint(p: ResumePoint) -> str:
    return f'trainer.fit(model, ckpt_path="last")  # the .ckpt committed last (step {p.step} of {p.root})'


def _deepspeed_hint(p: ResumePoint) -> str:
    tag = p.metadata.get("tag")
    tag_arg = f', tag="{tag}"' if tag is not None else ""
    return f'engine.load_checkpoint("{p.base}"{tag_arg})'


def _torchtitan_hint(p: ResumePoint) -> str:
    return f"the torchtitan trainer loads the step committed last at start (step {p.step} of {p.root})"


def plain_hint(p: ResumePoint) -> str:
    """The resume line of a root written through the plain API (no integration, or an unknown one)."""
    return f'Checkpointer("{p.root}").load(state, step={p.step})'


FRAMEWORKS: tuple[Framework, ...] = (
    Framework(
        "transformers",
        "ckptguard.integrations.hf",
        "transformers",
        "a Trainer ``output_dir``",
        _hf_hint,
        root_name=".ckptguard-hf",
    ),
    Framework(
        "lightning",
        "ckptguard.integrations.lightning",
        "lightning",
        "a Lightning ``dirpath``",
        _lightning_hint,
        root_name=".ckptguard-lightning",
    ),
    Framework(
        "accelerate",
        "ckptguard.integrations.accelerate",
        "accelerate",
        "an Accelerate ``project_dir``",
        _accelerate_hint,
        root_name=".ckptguard-accelerate",
        beside="checkpoints",
    ),
    Framework(
        "deepspeed",
        "ckptguard.integrations.deepspeed",
        "deepspeed",
        "a DeepSpeed save directory",
        _deepspeed_hint,
        root_name=".ckptguard-deepspeed",
    ),
    Framework(
        "torchtitan", "ckptguard.integrations.torchtitan", "torchtitan", "a torchtitan dump folder", _torchtitan_hint
    ),
)

BY_NAME: Mapping[str, Framework] = {f.name: f for f in FRAMEWORKS}
# The hidden root name -> its framework (the roots found by name, without reading a manifest).
BY_ROOT_NAME: Mapping[str, Framework] = {f.root_name: f for f in FRAMEWORKS if f.root_name is not None}


def root_name(name: str) -> str:
    """The hidden root directory of framework ``name``.

    Args:
        name: A registered framework's name (``"transformers"``, ``"lightning"``, ...).

    Returns:
        The directory name its integration keeps the root in (``".ckptguard-hf"``).

    Raises:
        KeyError: ``name`` is not registered, or its root is the framework's folder itself.
    """
    found = BY_NAME[name].root_name
    if found is None:
        raise KeyError(f"{name}: its root is the framework's own folder, not a hidden directory")
    return found


def resume_hint(framework: str | None, point: ResumePoint) -> str:
    """The line that resumes from ``point``: the framework's own resume call, or the plain API's.

    Args:
        framework: The framework that wrote the root (None: the plain API, or unknown).
        point: The root, the step and its metadata.

    Returns:
        One line of code (or of instruction, where the framework resumes by itself).
    """
    entry = BY_NAME.get(framework) if framework is not None else None
    return (entry.hint if entry is not None else plain_hint)(point)


def hidden_roots_text() -> str:
    """The hidden root names, for help texts: ``.ckptguard-hf, ... and .ckptguard-deepspeed``."""
    names = list(BY_ROOT_NAME)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def described_dirs_text() -> str:
    """The directories users know, for help texts: ``a Trainer output_dir, ..., a torchtitan dump folder``."""
    return ", ".join(f.describes.replace("``", "") for f in FRAMEWORKS)
