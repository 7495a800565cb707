"""A Checkpointer's view of its committed steps: list them (which one ``load()`` resumes, which a load
found corrupt), delete them, and name them with tags.

The protocol's part (rank 0 decides, every domain's leader writes, the tags moved by compare-and-swap)
is :mod:`ckptguard.protocol.manage`; this mixin keeps the Checkpointer's agreed view of the committed
steps, the quarantined ones and the tags up to date around it.
"""

from __future__ import annotations

from typing import Any

from ckptguard._collective import collective
from ckptguard.comm import Comm
from ckptguard.protocol import manage, rootid
from ckptguard.protocol import save as save_protocol
from ckptguard.protocol.decisions import Listing, commit_order
from ckptguard.protocol.fallback import agreed_current_and_quarantined
from ckptguard.protocol.session import Session
from ckptguard.saving import Saves


class Management:
    """``steps``, ``latest``, ``quarantined``, ``delete``, ``tag``, ``untag`` and ``tags`` of a
    :class:`~ckptguard.Checkpointer`."""

    _session: Session
    _comm: Comm
    _committed: Listing
    #: step -> (the commit sequence number it was found corrupt at, why): quarantine records read with
    #: the listing, and steps this Checkpointer's loads fell back past. A commit of the step since (a
    #: save replaces a quarantined step) has another number: then the entry no longer applies.
    _corrupt: dict[int, tuple[int | None, str]]
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

    def check_lease(self, acting: str = "change the root") -> None:
        raise NotImplementedError

    def root_id(self) -> str:
        """The root's stable identity (32 hex digits, ``.ckptguard/root-id``): created once, by the job
        holding the lease, by compare-and-swap under the fence like every control record, and never
        replaced; integrations bind pointer files to it. Not collective.

        Returns:
            The identity (the same for every job on this root, whichever created it).

        Raises:
            CorruptCheckpointError: The record is damaged.
            CheckpointError: The root has none yet and this Checkpointer cannot create it (read_only or
                closed; LeaseLostError: another job holds the root now).
        """
        storage = self._session.root.storage
        found = rootid.read(storage)
        if found is not None:
            return found
        acting = f"create {rootid.record_path(storage)}"
        self.check_lease(acting)
        return rootid.create(storage, fence=lambda: self._session.root.guard(acting))

    @collective(only_with="refresh")
    def steps(self, *, refresh: bool = False) -> list[int]:
        """The committed steps in commit order, agreed by every rank (committed in every storage domain),
        quarantined ones included (:meth:`quarantined`: a load found them corrupt, and loads skip them).

        The last one was committed last. Commit order is not step order after a rollback:
        ``load(step=100)`` then a save of step 110 while 200 and 300 exist gives ``[100, 200, 300, 110]``.
        The answer is the one agreed when opened and updated by every save and load (while this job holds
        the lease nobody else writes), so rank 0 alone may call it.

        Args:
            refresh: List the root again; then collective (every rank must call it).

        Returns:
            The committed steps, the last committed last.
        """
        if refresh:
            self.wait()
            self._relist()
        return commit_order(self._committed)

    def latest(self, *, refresh: bool = False) -> int | None:
        """The step ``load()`` resumes: the one committed last that is not quarantined (a load found it
        corrupt: ``load()`` skips it without reading it again).

        Args:
            refresh: List the root again; then collective (every rank must call it).

        Returns:
            The step, or None if the root holds no committed checkpoint that is not quarantined.
        """
        steps, skipped = self.steps(refresh=refresh), self.quarantined()
        return next((s for s in reversed(steps) if s not in skipped), None)

    @collective(only_with="refresh")
    def quarantined(self, *, refresh: bool = False) -> dict[int, str]:
        """The committed steps a load found corrupt, which ``load()`` and ``latest()`` skip: those the
        root's quarantine records name (a writing job's load records them), and those this
        Checkpointer's own loads fell back past. The next save of such a step replaces it.

        Args:
            refresh: List the root again; then collective (every rank must call it).

        Returns:
            ``{step: why it is corrupt}``, in commit order.
        """
        steps = self.steps(refresh=refresh)
        found = {s: self._corrupt[s] for s in steps if s in self._corrupt}
        return {s: why for s, (seq, why) in found.items() if self._committed[s].seq == seq}

    def _relist(self) -> None:
        """The agreed listing and its quarantined steps (collective: one agreement)."""
        current, quarantined = agreed_current_and_quarantined(self._session)
        self._committed = current
        self._corrupt = {s: (current[s].seq, why) for s, why in quarantined.items()}

    def _loaded(self, asked: int | None, loaded: int | None, current: Listing) -> None:
        """After a load or read of ``asked`` gave ``loaded`` from the listing ``current``: a load of the
        newest (``asked`` None) skipped or fell back past every step committed after ``loaded``."""
        self._committed = current
        if asked is None and loaded is not None:
            order = commit_order(current)
            for s in order[order.index(loaded) + 1 :]:
                if s not in self._corrupt or self._corrupt[s][0] != current[s].seq:
                    self._corrupt[s] = (current[s].seq, "a load of this job found it corrupt")

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
