"""The scenarios: what is committed before the recorded part, and the saves the recorded part makes.

Checkpointer scenarios record one or more saves (``saves``: step, gen, mode) after a setup
that committed ``pre``. What may be lost follows from the library's own promises: once a
save returned, it is committed and what retention (``keep_last``) or ``overwrite`` removes
is gone; while a save runs, the previous state stays, and the in-flight one may appear.
"""

from __future__ import annotations

from dataclasses import dataclass

FRESH_SUBDIRS = ("new", "dir")  # where save_file_new saves: ROOT/new/dir/model.pt
Save = tuple[int, int, str]  # (step, gen, mode): mode "" (blocking), "async" or "overwrite"


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    saves: tuple[Save, ...]  # made by the recorded part, in order
    pre: tuple[tuple[int, int], ...] = ()  # (step, gen) committed before it began (durable)
    keep_last: int | None = None
    files: bool = False
    phases: tuple[str, ...] = ("main",)
    kind: str = "checkpoint"  # or "file" (save_file / load_file)
    fresh_dir: bool = False  # the root (or save_file's directory) does not exist: the library creates it

    @property
    def known(self) -> set[tuple[int, int]]:
        return set(self.pre) | {(s, g) for s, g, _ in self.saves}


def kept(history: list[tuple[int, int]], keep_last: int | None) -> dict[int, int]:
    """{step: gen} the library keeps after committing ``history`` in order (overwrite replaces a
    step's gen; retention keeps the ``keep_last`` newest steps)."""
    out: dict[int, int] = {}
    for s, g in history:
        out[s] = g
        if keep_last is not None:
            for old in sorted(out)[:-keep_last]:
                del out[old]
    return out


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "first_save",
            "Checkpointer creates a root that did not exist, first save, close",
            saves=((1, 1, ""),),
            fresh_dir=True,
        ),
        Scenario(
            "retention",
            "save step 3 with keep_last=2: step 1 is retired and deleted",
            saves=((3, 1, ""),),
            pre=((1, 1), (2, 1)),
            keep_last=2,
        ),
        Scenario(
            "overwrite",
            "save step 1 again with overwrite=True (v2 replaces v1)",
            saves=((1, 2, "overwrite"),),
            pre=((1, 1),),
        ),
        Scenario(
            "save_file",
            "save_file replaces an existing file (checked with load_file)",
            saves=((1, 2, ""),),
            pre=((1, 1),),
            kind="file",
        ),
        Scenario(
            "save_file_new",
            "save_file into a directory that does not exist yet (it creates two levels)",
            saves=((1, 2, ""),),
            kind="file",
            fresh_dir=True,
        ),
        Scenario(
            "files",
            "save with files= (a nested directory per rank) after one with files=",
            saves=((2, 2, ""),),
            pre=((1, 1),),
            files=True,
        ),
        Scenario(
            "takeover",
            "a new job takes over a dead job's lease (fences its staging), saves, closes",
            saves=((2, 1, ""),),
            pre=((1, 1),),
            phases=("A", "main"),
        ),
        Scenario(
            "async",
            "save(blocking=False), tensors changed in place, then wait()",
            saves=((2, 2, "async"),),
            pre=((1, 1),),
        ),
        Scenario(
            "train",
            "a run: blocking, async, overwrite and blocking saves with keep_last=2 and files=",
            saves=((2, 2, ""), (3, 3, "async"), (3, 4, "overwrite"), (4, 5, "")),
            pre=((1, 1),),
            keep_last=2,
            files=True,
        ),
    )
}
