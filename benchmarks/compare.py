"""Is the working tree slower than an earlier commit? Runs one benchmark script on both, interleaved.

    python benchmarks/compare.py BASE [--script core.py] [--rounds 3] [-- SCRIPT ARGS...]

``BASE`` is a commit (e.g. ``HEAD~3``); it is checked out into a temporary git worktree.
Each round runs the script once on BASE and once on the working tree (alternating which
goes first), each in its own process, with ``PYTHONPATH`` pointing at that tree's
``src``. Both write the script's JSON; every row (a case) is compared by the ratio of
attnkit's time to the reference the script measures in the same process (SDPA, the block
ideal, ...), which cancels most of the machine's drift between processes. The table is
the median over rounds of ``new ratio / base ratio`` per case: 1.05 means 5% slower.
Beside it, the medians of attnkit's own time (``new ms / base ms``): where the reference
itself varies between processes (SDPA with a 4096 x 4096 dense mask does, by 10-30%), the
ratio moves although attnkit's time does not. And the fastest round of each tree
(``best new / best base``): this machine's timing moves in steps between processes (the
same tree and case run 30% apart in two processes), and those steps only ever slow a
process down, so the fastest process of each tree is the one least disturbed. A case is
flagged slower only when all three say so. Writes ``benchmarks/results/compare_<script>.json``
(or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"


def _key(row: dict) -> str:
    return " | ".join(str(row[k]) for k in ("case", "L", "dtype", "mode") if k in row)


def _ratio(row: dict) -> float | None:
    """attnkit's time over the reference measured beside it (None if the row has none)."""
    ours = row.get("attnkit_ms")
    ref = row.get("sdpa_ms", row.get("ref_ms"))
    if ours is None or ref in (None, 0):
        return None
    return ours / ref


def _run(tree: Path, script: str, args: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)]
    subprocess.run(command, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("--script", default="core.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/compare_<script>.json")
    args, rest = parser.parse_known_args()  # the rest (after --) goes to the script
    script_args = [a for a in rest if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_tree), args.base],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            ratios: dict[str, dict[str, list[float]]] = {}
            times: dict[str, dict[str, list[float]]] = {}
            for r in range(args.rounds):
                order = [("base", base_tree), ("new", ROOT)] if r % 2 == 0 else [("new", ROOT), ("base", base_tree)]
                for name, tree in order:
                    result = _run(tree, args.script, script_args, Path(tmp) / f"{name}{r}.json")
                    for row in result["rows"]:
                        value = _ratio(row)
                        if value is not None:
                            ratios.setdefault(_key(row), {"base": [], "new": []})[name].append(value)
                            times.setdefault(_key(row), {"base": [], "new": []})[name].append(row["attnkit_ms"])
                print(f"round {r + 1} of {args.rounds} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    rows = []
    for case, got in ratios.items():
        if not got["base"] or not got["new"]:
            continue
        change = statistics.median(got["new"]) / statistics.median(got["base"])
        ms = times[case]
        rows.append(
            {
                "case": case,
                "base_ratio": round(statistics.median(got["base"]), 4),
                "new_ratio": round(statistics.median(got["new"]), 4),
                "new_vs_base": round(change, 3),
                "base_ms": round(statistics.median(ms["base"]), 2),
                "new_ms": round(statistics.median(ms["new"]), 2),
                "time_new_vs_base": round(statistics.median(ms["new"]) / statistics.median(ms["base"]), 3),
                "best_base_ms": round(min(ms["base"]), 2),
                "best_new_ms": round(min(ms["new"]), 2),
                "best_new_vs_base": round(min(ms["new"]) / min(ms["base"]), 3),
            }
        )
    width = max(len(r["case"]) for r in rows)
    print(
        f"\n{args.script}: the working tree against {args.base}, {args.rounds} interleaved rounds "
        "(attnkit / the script's reference, medians)"
    )
    print(f"{'case':<{width}}  {'base':>8}  {'new':>8}  {'new/base':>9}  {'time new/base':>14}  {'best new/base':>14}")
    for r in rows:
        slower = r["new_vs_base"] > 1.05 and r["time_new_vs_base"] > 1.05 and r["best_new_vs_base"] > 1.05
        flag = "  <- slower by more than 5% (ratio, time and best time)" if slower else ""
        print(
            f"{r['case']:<{width}}  {r['base_ratio']:>8.3f}  {r['new_ratio']:>8.3f}  {r['new_vs_base']:>8.3f}x"
            f"  {r['time_new_vs_base']:>13.3f}x  {r['best_new_vs_base']:>13.3f}x{flag}"
        )
    out = args.out or RESULTS / f"compare_{Path(args.script).stem}.json"
    out.write_text(
        json.dumps({"base": args.base, "rounds": args.rounds, "script_args": script_args, "rows": rows}, indent=1)
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
