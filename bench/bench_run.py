"""What `ckptguard run` costs: a command printing many lines, directly and under the runner.

The command is a Python process that prints ``--lines`` lines (half on stdout, half on stderr,
interleaved, one write per line as an unbuffered training script does). It runs directly and
under `ckptguard run`, in the same run, alternating, ``--repeat`` times each; the best time of each
counts. Both write into files (as a batch job's output does: the runner's own stdout and stderr
are the files, the child writes into pipes that the runner passes on), or, with ``--sink null``,
into /dev/null (the cheapest sink there is: the child's write costs almost nothing directly). The runner's
peak memory is its ``VmHWM`` (from /proc), read until it exits, for ``--lines`` and for 4x as
many lines (flat: it does not grow with the output).

    python bench/bench_run.py [--lines 500000] [--repeat 3] [--sink file|null]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GENERATOR = r"""
import os, sys
n = int(sys.argv[1])
out, err = sys.stdout.buffer, sys.stderr.buffer
for i in range(n // 2):
    out.write(b"step %d loss 2.3456 lr 0.0003 tokens/s 123456 grad-norm 0.98\n" % i); out.flush()
    err.write(b"W1202 00:00:00.000000 123 train.py:42] warning %d: something noisy on stderr\n" % i); err.flush()
"""


def _peak_rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def timed(cmd: list[str], env: dict[str, str], sink: str) -> tuple[float, int]:
    """Seconds the command took, and its own peak RSS in KiB (sampled every 10 ms)."""
    with (
        open(sink if sink == os.devnull else sink + ".out", "wb") as out,
        open(sink if sink == os.devnull else sink + ".err", "wb") as err,
    ):
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _peak_rss_kib(proc.pid))
            time.sleep(0.01)
        elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]}... exited {proc.returncode}")
    return elapsed, peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=500_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sink", choices=["file", "null"], default="file")
    args = p.parse_args()
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH", "")) if x)
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        gen = os.path.join(tmp, "gen.py")
        Path(gen).write_text(GENERATOR)
        logs = os.path.join(tmp, "logs")
        sink = os.devnull if args.sink == "null" else os.path.join(tmp, "console")

        def direct(n: int) -> list[str]:
            return [sys.executable, gen, str(n)]

        def under(n: int) -> list[str]:
            return [sys.executable, "-m", "ckptguard", "run", "--logs", logs, "--", *direct(n)]

        best_d, best_u, rss = float("inf"), float("inf"), 0
        for _ in range(args.repeat):
            best_d = min(best_d, timed(direct(args.lines), env, sink)[0])
            t, r = timed(under(args.lines), env, sink)
            best_u, rss = min(best_u, t), max(rss, r)
        _, rss4 = timed(under(4 * args.lines), env, sink)
        kept = sum(f.stat().st_size for f in Path(logs).rglob("*.log"))
    print(f"lines: {args.lines:,} (half on stderr) into {args.sink}; best of {args.repeat}")
    print("| run | seconds | lines/s |\n| --- | --- | --- |")
    print(f"| direct | {best_d:.2f} | {args.lines / best_d:,.0f} |")
    print(f"| under ckptguard run | {best_u:.2f} | {args.lines / best_u:,.0f} |")
    print(f"ratio (direct time / time under run): {best_d / best_u:.3f} (target >= 0.95)")
    print(
        f"ckptguard run peak RSS: {rss / 1024:.1f} MiB for {args.lines:,} lines, "
        f"{rss4 / 1024:.1f} MiB for {4 * args.lines:,} lines; {kept / 1e6:.1f} MB of logs kept in all"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
