"""Facts of a log for the cross-rank rules, and NCCL's own lines: checkpoint paths announced,
world size and node layout, collective fingerprints, progress, ranks that lines name or blame,
and the pid -> rank and host maps that NCCL's headers give.

A mixin of the extractor (`events.Extractor`), as `launchers.LauncherLines` is: these handlers
share its bounded state, declared here.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ckptguard.diagnose.kb import KnowledgeBase
from ckptguard.diagnose.mask import Masker
from ckptguard.diagnose.model import Event, EventKind, Evidence, RankSource
from ckptguard.diagnose.rules import Operation, Rules

MAX_FINGERPRINTS = 4096
REPEAT_LINES = 3  # lines between copies of one announcement printed by several processes
_NCCL_TRACE_RE = re.compile(r":\d+ -> [1-9]\d*\s*$")  # NCCL's error trace: file:line -> non-zero code
_COMM_RE = re.compile(r"\brank (\d+) nranks (\d+)\b")
_CHANNEL_RE = re.compile(r"Channel \d+/\d+ : (\d+)\[(\d+)\] -> (\d+)\[(\d+)\](?: \[(send|receive)\])?")
_TREES_RE = re.compile(r"Trees \[\d+\] [-\d/]+->(\d+)->")
_WORLD_RE = re.compile(r"\b(?:dist_)?(?:world[_ ]size|WORLD_SIZE)\s*[=:]\s*(\d{1,7})\b")
# DeepSpeed's launcher, once per node: its node rank and local world size, and every node's ranks.
_NODE_RE = re.compile(r"\bnnodes=(\d{1,5}), num_local_procs=(\d{1,5}), node_rank=(\d{1,5})\b")
_MAPPING_RE = re.compile(r"'([\w.\-]{1,128})': \[([\d, ]{1,8192})\]")


class FactLines:
    """Mixin of the extractor: facts and NCCL lines."""

    kb: KnowledgeBase
    rules: Rules
    masker: Masker
    events: list[Event]
    saves: dict[str, dict[int, Evidence]]
    announced_path: str | None
    repeated_saves: dict[str, list[Evidence]]
    fingerprints: list[tuple[dict[str, str], Evidence]]
    reported_ranks: list[tuple[int, Evidence]]
    progress: dict[int, dict[int, Evidence]]
    named_ranks: set[int]
    world_size: int
    nnodes: int
    node_of: dict[str, tuple[int, int]]
    host_ranks: dict[str, list[int]]
    rank_host: dict[int, str]
    ranks_seen: set[int]
    pid_rank: dict[int, tuple[int, int]]
    pid_host: dict[int, str]
    memory_line: tuple[int, int] | None
    deliberate: bool
    _announced: tuple[Operation, int, int, Evidence] | None
    _last_save: tuple[tuple[int, str], int, Evidence] | None
    _line_host: str | None
    _src: int
    _nccl_init_warns: dict[tuple[str, int], list[Event]]
    _nccl_up: set[tuple[str, int]]
    _emit: Callable[..., Event | None]
    _pending_force: Callable[[], int]

    def _facts(self, rest: str, rank: int | None, ev: Evidence) -> None:
        """Facts for the cross-rank rules: checkpoint paths, world size, fingerprints, reports."""
        for op in self.rules.operations:
            if (
                op.announce is not None
                and any(map(rest.__contains__, op.announce_anchors))
                and op.announce.search(rest)
            ):
                self._announced = (op, self._src, ev.line, ev)
                break
        silent = self.rules.silent_exit
        if silent is not None:
            if any(map(rest.__contains__, silent.memory_anchors)) and silent.memory.search(rest):
                self.memory_line = (self._src, ev.line)
            if any(map(rest.__contains__, silent.deliberate_anchors)) and silent.deliberate.search(rest):
                self.deliberate = True
        race = self.rules.race
        if len(self.saves) < 10_000 and (rank is not None or any(map(rest.__contains__, race.anchors))):
            sm = race.announce.search(rest)
            if sm:
                self.announced_path = sm.group("path")
            if sm and rank is not None:
                self.saves.setdefault(sm.group("path"), {}).setdefault(rank, ev)
            elif sm and len(self.repeated_saves) < 10_000:
                self._repeated_save(sm.group("path"), rest[sm.start() :], ev)
        wm = _WORLD_RE.search(rest)
        if wm:
            self.world_size = max(self.world_size, int(wm.group(1)))
        if "num_local_procs=" in rest or "global_rank_mapping" in rest:
            self._node_facts(rest)
        if "SeqNum=" in rest and len(self.fingerprints) < MAX_FINGERPRINTS:
            fm = self.rules.desync_pattern.search(rest)
            if fm:
                self.fingerprints.append(({k: v for k, v in fm.groupdict().items() if v}, ev))
        prog = self.rules.progress
        if (
            prog is not None
            and self._announced is not None
            and any(map(rest.__contains__, self.rules.progress_anchors))
            and prog.search(rest)
        ):
            self._announced = None  # steps are running: the announced operation is over
        if (
            prog is not None
            and len(self.progress) < MAX_FINGERPRINTS
            and any(map(rest.__contains__, self.rules.progress_anchors))
        ):
            for pm in prog.finditer(rest):
                cur, total = int(pm.group("cur")), int(pm.group("total"))
                if cur < total:  # a bar that finished says nothing about where the ranks stopped
                    self.progress.setdefault(cur, {}).setdefault(total, ev)
        if rank is None and "ank" in rest and len(self.named_ranks) < 64:
            for h in self.rules.rank_hints:
                if h.source == "message" and h.anchor in rest:
                    hm = h.pattern.search(rest)
                    if hm:
                        self.named_ranks.add(int(hm.group("rank")))
        for rep in self.rules.rank_reports:
            if rep.anchor in rest:
                rm = rep.pattern.search(rest)
                if rm:
                    for r in re.findall(r"\d+", rm.group("ranks")):
                        self.reported_ranks.append((int(r), ev))

    def _node_facts(self, rest: str) -> None:
        """A node's rank and local world size (global rank = node rank x local world size +
        local rank), and the launcher's map of node -> global ranks."""
        nm = _NODE_RE.search(rest)
        if nm:
            nnodes, local, node = (int(g) for g in nm.groups())
            self.world_size = max(self.world_size, nnodes * local)
            self.nnodes = max(self.nnodes, nnodes)
            if self._line_host is not None:
                self.node_of[self._line_host] = (node, local)
        if "global_rank_mapping" in rest:
            for host, ranks in _MAPPING_RE.findall(rest):
                nums = [int(r) for r in ranks.split(",") if r.strip().isdigit()]
                self.host_ranks[host] = nums
                self.masker.learn_host(host)
                for r in nums:
                    self.rank_host.setdefault(r, host)
                    self.ranks_seen.add(r)

    def _blame_note(self, rest: str, rank: int, ev: Evidence) -> bool:
        """A note under an exception (Python's ``add_note``) that says another rank failed first:
        that rank's error is the cause, this rank's own (just raised) its consequence."""
        for rep in self.rules.blame_reports:
            bm = rep.pattern.search(rest) if rep.anchor in rest else None
            if bm is None:
                continue
            blamed = int(bm.group("ranks"))
            last = next((e for e in reversed(self.events[-16:]) if e.rank == rank and e.source == self._src), None)
            if last is not None and blamed != rank and 0 <= ev.line - last.evidence[-1].line <= 3:
                last.blames = blamed
                if len(self.reported_ranks) < 64:
                    self.reported_ranks.append((blamed, ev))
                return True
            return False
        return False

    def _repeated_save(self, path: str, said: str, ev: Evidence) -> None:
        """The same unprefixed announcement again within a few lines: another process saying it
        (a process announces one save once), so N copies are N writers of that path."""
        key = (self._src, said)
        last = self._last_save
        if last is not None and last[0] == key and 0 < ev.line - last[1] <= REPEAT_LINES:
            self.repeated_saves.setdefault(path, [last[2]]).append(ev)
        self._last_save = (key, ev.line, ev)

    def _nccl_line(self, m: re.Match[str], rank: int | None, ev: Evidence, ts: float | None, via: RankSource) -> int:
        host = m.group("host")
        pid = int(m.group("pid"))
        dev = int(m.group("dev"))
        self.pid_host.setdefault(pid, host)
        self.masker.learn_host(host)
        msg = m.group("msg")
        if rank is not None and via == RankSource.PREFIX:
            self._map_pid(pid, rank, 10)
        cm = _COMM_RE.search(msg)
        if cm and "Init COMPLETE" in msg:
            # the process set its communicator up after all: what it warned about while doing so
            # (an HCA it could not open, a plugin it did not find) was worked around
            for e in self._nccl_init_warns.pop((host, pid), []):
                e.kind = EventKind.HINT
            self._nccl_up.add((host, pid))
        if cm:
            nranks = int(cm.group(2))
            self.world_size = max(self.world_size, nranks)
            self._map_pid(pid, int(cm.group(1)), 2 + nranks)
        else:
            ch = _CHANNEL_RE.search(msg)
            if ch:
                src, sdev, dst, ddev = (int(ch.group(i)) for i in range(1, 5))
                direction = ch.group(5)
                if sdev == dev and ddev != dev:
                    me = src
                elif ddev == dev and sdev != dev:
                    me = dst
                else:
                    me = dst if direction == "receive" else src
                self._map_pid(pid, me, 1)
            else:
                tm = _TREES_RE.search(msg)
                if tm:
                    self._map_pid(pid, int(tm.group(1)), 1)
        if m.group("lvl") in ("WARN", "ERROR") or _NCCL_TRACE_RE.search(msg):
            matches = self.kb.match(m.group(0), exception=False)
            if matches:
                event = self._emit(EventKind.LINE, matches, [ev], rank, via, pid=pid, host=host, ts=ts, message=msg)
                if event is not None and m.group("lvl") == "WARN" and (host, pid) not in self._nccl_up:
                    self._nccl_init_warns.setdefault((host, pid), []).append(event)
        return self._pending_force()

    def _map_pid(self, pid: int, rank: int, priority: int) -> None:
        old = self.pid_rank.get(pid)
        if old is None or priority > old[1]:
            self.pid_rank[pid] = (rank, priority)
            self.ranks_seen.add(rank)
