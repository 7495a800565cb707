"""Launcher lines: worker exits as torchrun, mp.spawn, srun, mpirun and DeepSpeed report them.

The formats are data (``[[launcher]]`` in ``kb/_rules.toml``); this module applies them, and
parses torchrun's multi-line ``ChildFailedError`` summary, which no single regex can.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ckptguard.diagnose.mask import Masker
from ckptguard.diagnose.model import Evidence, LauncherFailure
from ckptguard.diagnose.prefixes import parse_timestamp
from ckptguard.diagnose.rules import Rules

_SIGTERM_RE = re.compile(r"Sending process (\d+) (?:the )?closing signal (SIG[A-Z]+)")
_BLOCK_FIELD_RE = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s*(.*)$")
_BLOCK_RANK_RE = re.compile(r"(-?\d+) \(local_rank: (\d+)\)")
_BLOCK_EXIT_RE = re.compile(r"(-?\d+) \(pid: (\d+)\)")
_EXIT_CODE_RE = re.compile(r"exit code (-?\d+)")


@dataclass
class Block:
    """State of a torchrun ChildFailedError summary being read."""

    section: str = ""
    entry: dict[str, str] = field(default_factory=dict)
    entry_ev: Evidence | None = None
    equals_seen: int = 0


def expand_tasks(tasks: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7] (bounded)."""
    out: list[int] = []
    for part in tasks.split(","):
        if "-" in part:
            a, _, b = part.partition("-")
            if a.isdigit() and b.isdigit():
                out.extend(range(int(a), min(int(b), int(a) + 4096) + 1))
        elif part.isdigit():
            out.append(int(part))
    return out


class LauncherLines:
    """Mixin of the extractor: launcher exit lines and the torchrun summary block."""

    rules: Rules
    masker: Masker
    launcher: list[LauncherFailure]
    sigterm: list[tuple[int, Evidence]]
    rank_host: dict[int, str]
    ranks_seen: set[int]
    _block: Block | None
    _year: int
    memory_line: tuple[int, int] | None
    deliberate: bool
    _line_host: str | None
    node_of: dict[str, tuple[int, int]]
    host_ranks: dict[str, list[int]]

    def _map_pid(self, pid: int, rank: int, priority: int) -> None:  # provided by the extractor
        raise NotImplementedError

    def launcher_line(self, rest: str, ev: Evidence, ts: float | None) -> bool:
        """Record a launcher's report of a worker exit; True if the line was one."""
        m = _SIGTERM_RE.search(rest)
        if m:
            self.sigterm.append((int(m.group(1)), ev))
            return True
        for fmt in self.rules.launchers:
            if fmt.anchor not in rest:
                continue
            m = fmt.pattern.search(rest)
            if m is None:
                continue
            g = m.groupdict()
            code, cls, weight = self._exit_code(g)
            host = g.get("host") or self._line_host
            if host:
                self.masker.learn_host(host)
            pid = int(g["pid"]) if g.get("pid") else None
            local = int(g["local"]) if g.get("local") else None
            reliable = fmt.rank_reliable or (fmt.last_local and local == 0)
            ranks: list[int | None] = [int(g["rank"])] if g.get("rank") else [None]
            if ranks == [None] and host is not None and local is not None:
                glob = self._global_rank(host, local, reliable)
                if glob is not None:
                    ranks, reliable = [glob], True
            if g.get("tasks"):
                ranks = list(expand_tasks(g["tasks"]))
            if code is None and fmt.code_cut:
                code, cls, weight = self._silent_exit(ev)
                if cls is None:
                    return False  # no cause to tell: the line is left to the signatures
            for rank in ranks:
                if rank is not None and host:
                    self.rank_host.setdefault(rank, host)
                self.launcher.append(
                    LauncherFailure(
                        rank if reliable else None,
                        local if reliable else None,
                        pid,
                        code,
                        host,
                        ts,
                        False,
                        ev,
                        rank_reliable=reliable,
                        launcher=fmt.name,
                        class_id=cls,
                        weight=weight,
                    )
                )
            # srun's "error:" lines that say nothing about an exit are left to the signatures
            return code is not None or cls is not None or "rror" not in rest
        return False

    def _global_rank(self, host: str, local: int, reliable: bool) -> int | None:
        """The global rank of a node's local rank: the node's only rank, whatever local rank the
        line names; else, where the local rank is the failed one, node rank x local world size +
        local rank (or the launcher's own map of the node's ranks)."""
        only = self.host_ranks.get(host, [])
        node = self.node_of.get(host)
        if len(only) == 1:
            return only[0]
        if node is not None and node[1] == 1:
            return node[0]
        if not reliable:
            return None
        if node is not None and local < node[1]:
            return node[0] * node[1] + local
        return only[local] if local < len(only) else None

    def _silent_exit(self, ev: Evidence) -> tuple[int | None, str | None, float | None]:
        """A launcher's report cut before the exit code, from a worker that printed nothing of its
        own: after memory figures (and no deliberate stop), the memory killer's SIGKILL; else an
        exit of unknown cause."""
        silent = self.rules.silent_exit
        mem = self.memory_line
        if (
            silent is None
            or self.deliberate
            or mem is None
            or mem[0] != ev.source
            or not 0 <= ev.line - mem[1] <= silent.within
        ):
            return None, None, None
        return None, silent.class_id, silent.weight

    def _exit_code(self, g: dict[str, str | None]) -> tuple[int | None, str | None, float | None]:
        """Exit code (negative for a signal) and, where the launcher's words say it, the class."""
        if g.get("code"):
            return int(g["code"] or 0), None, None
        if g.get("sig"):
            return -int(g["sig"] or 0), None, None
        if g.get("signame"):
            n = self.rules.signal_by_name(g["signame"] or "")
            return (-n if n is not None else None), None, None
        what = g.get("what") or ""
        cm = _EXIT_CODE_RE.search(what)
        if cm:
            return int(cm.group(1)), None, None
        for w in self.rules.exit_words:
            if w.word in what:
                return -w.signal, w.class_id, w.weight
        return None, None, None

    def block_line(self, rest: str, ev: Evidence) -> bool:
        """Parse torchrun's ChildFailedError summary; True if the line belonged to it."""
        b = self._block
        assert b is not None
        s = rest.strip()
        if s.startswith("Root Cause"):
            self.flush_block_entry()
            b.section = "root"
            return True
        if s.startswith("Failures:"):
            self.flush_block_entry()
            b.section = "failures"
            return True
        if re.fullmatch(r"\[\d+\]:", s):
            self.flush_block_entry()
            return True
        if s.startswith("====="):
            b.equals_seen += 1
            if b.equals_seen >= 2:
                self.flush_block_entry()
                self._block = None
            return True
        fm = _BLOCK_FIELD_RE.match(rest)
        if fm and b.section:
            b.entry[fm.group(1)] = fm.group(2).strip()
            if fm.group(1) in ("rank", "exitcode") or b.entry_ev is None:
                b.entry_ev = ev
            return True
        return s.startswith("-----") or s == "<NO_OTHER_FAILURES>" or s.endswith("FAILED")

    def flush_block_entry(self) -> None:
        """Turn the summary entry read so far into a launcher failure."""
        b = self._block
        if b is None or not b.entry:
            return
        e, ev = b.entry, b.entry_ev
        b.entry, b.entry_ev = {}, None
        rank = local = pid = code = None
        rm = _BLOCK_RANK_RE.search(e.get("rank", ""))
        if rm:
            rank, local = int(rm.group(1)), int(rm.group(2))
        xm = _BLOCK_EXIT_RE.search(e.get("exitcode", ""))
        if xm:
            code, pid = int(xm.group(1)), int(xm.group(2))
        host = e.get("host") or None
        if host:
            self.masker.learn_host(host)
        t, _ = parse_timestamp(e.get("time", "").replace("_", " "), self._year)
        if ev is None:
            return
        if rank is not None:
            self.ranks_seen.add(rank)
            if host:
                self.rank_host.setdefault(rank, host)
            if pid is not None:
                self._map_pid(pid, rank, 50)
        self.launcher.append(
            LauncherFailure(
                rank, local, pid, code, host, t, b.section == "root", ev, e.get("traceback", ""), launcher="torchrun"
            )
        )
