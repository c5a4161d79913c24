"""Is a ratio to the block ideal reproducible? The same cases, run again in fresh processes.

    python benchmarks/repro.py [--runs 3] [--repeats 21] [--threads N]
                               [--out benchmarks/results/repro.json]

One run of ``benchmarks/mods.py`` (soft-capping 50 + causal, soft-capping 30 + sliding window
256) and one of ``benchmarks/cpu.py`` (document & causal, float32) at L=4096, forward and forward
+ backward, each in its own process, ``--runs`` times in turn: a process's allocations, thread
pool and engine load are part of what a second run does differently. Each run reports
attnkit/ideal as the median over its rounds of the ratio of neighbouring calls (see
``cpu.ideal_ratio``). For every case and mode the JSON and the table give the runs' ratios,
their mean and the largest deviation from that mean in percent; nothing is averaged away (every
run's JSON, with all its samples, is kept in ``runs``).
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

import machine  # benchmarks/machine.py

HERE = Path(__file__).parent
RESULTS = HERE / "results"

#: (script, its arguments): the cases whose ratios the issue asks to be reproducible.
BENCHMARKS = (
    ("mods.py", ["--no-flex", "--cases", "softcap+causal", "softcap+window"]),
    ("cpu.py", ["--lengths", "4096", "--dtypes", "float32", "--flex-max-len", "0", "--cases", "document_causal"]),
)


def one_run(script: str, args: list[str], repeats: int, threads: int | None, workdir: Path, tag: str) -> list[dict]:
    """The rows one fresh process of ``script`` writes."""
    out = workdir / f"{tag}.json"
    command = [sys.executable, str(HERE / script), *args, "--repeats", str(repeats), "--out", str(out)]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["rows"]


def summarise(runs: list[list[dict]]) -> list[dict]:
    """``(case, mode) -> the runs' ratios, mean, largest deviation``."""
    series: dict[tuple[str, str], list[float]] = {}
    for rows in runs:
        for row in rows:
            series.setdefault((row["case"], row["mode"]), []).append(row["attnkit_ideal"])
    summary = []
    for (case, mode), ratios in series.items():
        mean = statistics.fmean(ratios)
        summary.append(
            {
                "case": case,
                "mode": mode,
                "ratios": [round(r, 4) for r in ratios],
                "mean": mean,
                "worst": max(ratios),
                "deviation_pct": 100 * max(abs(r - mean) for r in ratios) / mean,
            }
        )
    return summary


def table(summary: list[dict]) -> str:
    lines = ["| case | mode | attnkit/ideal, each run | mean | largest deviation |", "|---|---|---|---|---|"]
    for s in summary:
        runs = " / ".join(f"{r:.2f}" for r in s["ratios"])
        lines.append(f"| {s['case']} | {s['mode']} | {runs} | {s['mean']:.2f} | ±{s['deviation_pct']:.1f}% |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=21, help="rounds of each run (its median)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--out", type=Path, default=RESULTS / "repro.json")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error(f"--runs must be at least 2 to compare runs, got {args.runs}")

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            rows = []
            for script, script_args in BENCHMARKS:
                print(f"run {i + 1}/{args.runs}: {script}", flush=True)
                rows += one_run(script, script_args, args.repeats, args.threads, Path(tmp), f"{i}-{script}")
            runs.append(rows)
    summary = summarise(runs)
    meta = {**machine.describe(), "runs": args.runs, "repeats": args.repeats}
    if args.threads is not None:
        meta["threads"] = args.threads
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    print()
    print(table(summary))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
