"""Run the fuzz suite for a given number of minutes: ``make fuzz`` (FUZZ_MINUTES=10).

    python tests/fuzz/run.py [--minutes 10]

Each round runs tests/fuzz with the ``fuzz`` hypothesis profile (300 examples per
property) and a fresh seed, and prints what it tried: the examples per property, and
hypothesis's statistics. A failing round prints hypothesis's falsifying example and
stops with exit code 1 (rerun it with the printed seed). The last round is cut at the
time limit; that is not a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    end = time.monotonic() + 60 * args.minutes
    env = dict(os.environ, ATTNKIT_FUZZ_PROFILE="fuzz")
    totals: dict[str, int] = {}
    rounds = 0
    while time.monotonic() < end:
        seed = int.from_bytes(os.urandom(4), "little")
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE),
            f"--hypothesis-seed={seed}",
            "--hypothesis-show-statistics",
        ]
        try:
            run = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=max(5.0, end - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            print(f"round {rounds + 1} (seed {seed}): stopped at the time limit", flush=True)
            break
        rounds += 1
        tried = re.findall(r"::(\w+):\n(?:.*\n)*?\s+- (\d+) passing, (\d+) failing", run.stdout)
        for name, passing, failing in tried:
            totals[name] = totals.get(name, 0) + int(passing) + int(failing)
        summary = ", ".join(f"{name.removeprefix('test_')}: {int(p) + int(f)}" for name, p, f in tried)
        print(f"round {rounds} (seed {seed}): {summary}", flush=True)
        if run.returncode != 0:
            print(run.stdout[-20000:], run.stderr[-5000:], sep="\n")
            print(f"FAILED in round {rounds}: rerun with  {' '.join(command)}  and ATTNKIT_FUZZ_PROFILE=fuzz")
            return 1
    print(f"\n{rounds} rounds in {args.minutes:g} minutes, no failure. Examples tried per property:")
    for name, count in totals.items():
        print(f"  {name}: {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
