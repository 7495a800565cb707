"""A Checkpointer's management of its committed steps: delete them, and name them with tags.

The protocol's part (rank 0 decides, every domain's leader writes, the tags moved by compare-and-swap)
is :mod:`ckptguard.protocol.manage`; this mixin keeps the Checkpointer's agreed view of the committed
steps and tags up to date around it.
"""

from __future__ import annotations

from typing import Any

from ckptguard._collective import collective
from ckptguard.comm import Comm
from ckptguard.protocol import manage
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.decisions import Listing
from ckptguard.protocol.session import Session
from ckptguard.saving import Saves


class Management:
    """``delete``, ``tag``, ``untag`` and ``tags`` of a :class:`~ckptguard.Checkpointer`."""

    _session: Session
    _comm: Comm
    _committed: Listing
    _tags: manage.Tags
    _saves: Saves
    _out_of_step: str | None
    _pid: int

    @property
    def root(self) -> str:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def _check_usable(self, writing: bool, wait_cleanup: bool = True) -> None:
        raise NotImplementedError

    @collective()
    def delete(self, step: int) -> None:
        """Delete committed ``step`` (every version) on every storage domain; collective.

        The step disappears for every reader at once; ``latest`` moves back to the newest step left.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            CheckpointError: ``step`` is tagged (move or remove its tag first), or the Checkpointer is
                read_only or closed.
        """
        self.wait()
        self._check_usable(writing=True)
        current = self._committed = save_protocol.agreed_current(self._session)
        self._tags = manage.read_tags(self._session)
        self._committed, retired = manage.delete_step(self._session, step, current, self._tags)
        self._saves.remove_retired(retired, step)

    @collective()
    def tag(self, name: str, step: int, *, expect: Any = ...) -> int | None:
        """Point tag ``name`` (e.g. ``"best"``) at committed ``step``, durably; retention keeps tagged steps.

        Args:
            name: The tag.
            step: A committed step.
            expect: Move the tag only if it names this step now (None: only if it does not exist yet).

        Returns:
            The step the tag named before, or None.

        Raises:
            StepNotFoundError: ``step`` is not committed.
            CheckpointError: ``expect`` does not hold, or the Checkpointer is read_only or closed.
        """
        self.wait()
        self._check_usable(writing=True)
        current = self._committed = save_protocol.agreed_current(self._session)
        before = manage.set_tag(self._session, name, step, current, expect)
        self._tags = manage.read_tags(self._session)
        return before

    @collective()
    def untag(self, name: str) -> int | None:
        """Remove tag ``name``; collective.

        Args:
            name: The tag.

        Returns:
            The step it named, or None if it did not exist.

        Raises:
            CheckpointError: The Checkpointer is read_only or closed.
        """
        self.wait()
        self._check_usable(writing=True)
        before = manage.set_tag(self._session, name, None, self._committed)
        self._tags = manage.read_tags(self._session)
        return before

    @collective(only_with="refresh")
    def tags(self, *, refresh: bool = False) -> dict[str, int]:
        """The tags, agreed by every rank.

        Args:
            refresh: Read the tags again; then collective (every rank must call it).

        Returns:
            ``{tag: step}``, sorted by tag.
        """
        if refresh:
            self.wait()
            self._tags = manage.read_tags(self._session)
        return dict(sorted(self._tags.items()))
