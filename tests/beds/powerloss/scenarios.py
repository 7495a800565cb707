"""The scenarios: what is committed before the recorded part, what it commits, what it may replace."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    new: tuple[int, int]  # (step, gen) the recorded part commits
    pre: tuple[tuple[int, int], ...] = ()  # committed before it began (durable)
    replaced: tuple[tuple[int, int], ...] = ()  # what the new one may remove once it is committed
    keep_last: int | None = None
    overwrite: bool = False
    files: bool = False
    phases: tuple[str, ...] = ("main",)
    kind: str = "checkpoint"  # or "file" (save_file / load_file)
    extra: dict[str, str] = field(default_factory=dict)


SCENARIOS = {s.name: s for s in (
    Scenario("first_save", "Checkpointer created on an empty root, first save, close", new=(1, 1)),
    Scenario("retention", "save step 3 with keep_last=2: step 1 is retired and deleted", new=(3, 1),
             pre=((1, 1), (2, 1)), replaced=((1, 1),), keep_last=2),
    Scenario("overwrite", "save step 1 again with overwrite=True (v2 replaces v1)", new=(1, 2),
             pre=((1, 1),), replaced=((1, 1),), overwrite=True),
    Scenario("save_file", "save_file replaces an existing file (checked with load_file)", new=(1, 2),
             pre=((1, 1),), replaced=((1, 1),), kind="file"),
    Scenario("files", "save with files= (a nested directory per rank) after one with files=", new=(2, 2),
             pre=((1, 1),), files=True),
    Scenario("takeover", "a new job takes over a dead job's lease (fences its staging), saves, closes",
             new=(2, 1), pre=((1, 1),), phases=("A", "main")),
    Scenario("async", "save(blocking=False), tensors changed in place, then wait()", new=(2, 2),
             pre=((1, 1),)),
)}
