"""Run PyTorch's own Flex tests against ``attnkit.flex`` and say what passed, with why for the rest.

PyTorch's ``test/inductor/test_flex_attention.py`` and ``test_flex_decoding.py`` are not shipped
in its wheel and are not copied here: take them from PyTorch's repository at the tag of the
installed torch (``git show v2.13.0:test/inductor/test_flex_attention.py``) and pass their paths::

    pip install expecttest            # torch's test utilities import it
    python scripts/run_torch_flex_tests.py PATH/test_flex_attention.py PATH/test_flex_decoding.py \
        --json benchmarks/results/torch_flex_tests.json [-n 2] [-k EXPR]

``scripts/torch_flex_shim.py`` swaps ``flex_attention`` and ``create_block_mask`` for attnkit's
(compile, inductor, ``BlockMask`` and the assertions stay torch's; an eager float64 call, the tests'
"golden" answer, runs torch's own FlexAttention: see the shim). Every test outcome is written
to the JSON; failures are grouped by the first line of their error, and the ones listed in
``NOT_APPLICABLE`` (a test that asserts inductor's generated code or internals rather than an
answer) are counted apart, each with its reason. Hours on two cores: the CPU tests compile with
inductor.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Tests that check what inductor generated or counted rather than an answer, matched against the
#: test's name: with attnkit's kernel there is no Triton/C++ template for them to find. Each entry
#: says why; everything else that fails is counted as failed.
NOT_APPLICABLE: dict[str, str] = {
    r"^test_captured_reduction_": "asserts that torch refuses a score_mod reducing a captured tensor (an expected "
    "failure in torch); attnkit evaluates it one pair at a time and answers",
    r"^test_cpu_error_message_return_lse_": "asserts torch's error for return_lse under torch.compile on the CPU; "
    "attnkit returns the lse there",
    r"^test_debug_flag_disables_internal_compilation_": "asserts torch's warning that its eager CPU path is "
    "unfused (and torch's flag that silences it); attnkit has no unfused path to warn about",
    r"^test_subgraph_respect_decompostion_": "asserts the code of the score subgraph (sdpa_score0) of torch's "
    "flex_attention higher-order op in make_fx's graph; attnkit's graph has no such op (make_fx traces "
    "attnkit.flex and its graph is exact: tests/integrations/test_flex_compile.py)",
}


class Outcomes:
    """A pytest plugin that keeps each test's outcome and the first line of its error."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self.started = time.monotonic()
        self.count = 0

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "why": ""})
        if report.when == "call" or report.outcome != "passed":
            if report.skipped:
                entry["outcome"] = "skipped"
                if isinstance(report.longrepr, tuple):
                    entry["why"] = str(report.longrepr[2])
            elif report.failed:
                entry["outcome"] = "failed"
                entry["why"] = _first_line(report)
        if report.when == "teardown":
            self.count += 1
            if self.count % 25 == 0:
                minutes = (time.monotonic() - self.started) / 60
                print(f"\n[torch-flex-tests] {self.count} tests done, {minutes:.1f} min", flush=True)


def _first_line(report) -> str:
    text = str(report.longrepr)
    errors = [line[2:].strip() for line in text.splitlines() if line.startswith("E ")]
    line = errors[0] if errors else text.strip().splitlines()[-1]
    return re.sub(r"0x[0-9a-f]+", "0x..", line)[:300]


def _applicability(nodeid: str) -> str | None:
    name = nodeid.split("::")[-1]
    for pattern, why in NOT_APPLICABLE.items():
        if re.search(pattern, name):
            return why
    return None


def _mark_torchs_own_failures(results: dict[str, dict], paths: list[Path]) -> None:
    """Run what failed on attnkit again on torch's own FlexAttention (a subprocess: the shim is not
    installed there); a test that fails on torch too is one this torch fails itself (a test file of
    another torch version), marked so."""
    failed = [
        nodeid for nodeid, entry in results.items() if entry["outcome"] == "failed" and not _applicability(nodeid)
    ]
    if not failed:
        return
    print(
        f"\n[torch-flex-tests] {len(failed)} failed on attnkit: running them on torch's own FlexAttention", flush=True
    )
    root = Path(os.path.commonpath([p.resolve().parent for p in paths]))
    ids = [str(root / n.split("::")[0]) + "::" + n.split("::", 1)[1] for n in failed]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"torch_flex_baseline_{os.getpid()}.json"
    cmd = [sys.executable, __file__, *map(str, paths), "--against", "torch", "--json", str(out), "--only", *ids]
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    if not out.is_file():
        print("[torch-flex-tests] the baseline run wrote nothing; failures kept as they are", flush=True)
        return
    theirs = json.loads(out.read_text())["tests"]
    for nodeid in failed:
        if theirs.get(nodeid, {}).get("outcome") == "failed":
            results[nodeid]["outcome"] = "fails on torch"
            results[nodeid]["torch"] = theirs[nodeid]["why"]
    out.unlink()


def summarize(results: dict[str, dict]) -> dict:
    counts = collections.Counter()
    failures: dict[str, list[str]] = collections.defaultdict(list)
    torchs_own: dict[str, list[str]] = collections.defaultdict(list)
    not_applicable: dict[str, list[str]] = collections.defaultdict(list)
    skipped: collections.Counter = collections.Counter()
    for nodeid, entry in results.items():
        if entry["outcome"] == "failed" and (why := _applicability(nodeid)):
            counts["not applicable"] += 1
            not_applicable[why].append(nodeid)
        else:
            counts[entry["outcome"]] += 1
            if entry["outcome"] == "failed":
                failures[entry["why"]].append(nodeid)
            elif entry["outcome"] == "fails on torch":
                torchs_own[entry["torch"]].append(nodeid)
            elif entry["outcome"] == "skipped":
                skipped[entry["why"]] += 1
    return {
        "counts": dict(counts),
        "failures": {why: sorted(ids) for why, ids in sorted(failures.items(), key=lambda kv: -len(kv[1]))},
        "not_applicable": {why: sorted(ids) for why, ids in not_applicable.items()},
        "fails_on_torch_itself": {why: sorted(ids) for why, ids in torchs_own.items()},
        "skipped_because": dict(skipped.most_common()),
    }


def _machine() -> dict:
    import torch

    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    except OSError:
        model = platform.processor()
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": model}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="PyTorch's test files (test_flex_attention.py, ...)")
    parser.add_argument("--json", type=Path, help="where to write every outcome and the summary")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (a subset of the tests)")
    parser.add_argument("--only", nargs="+", metavar="NODEID", help="these tests only (pytest node ids)")
    parser.add_argument(
        "--no-baseline", dest="baseline", action="store_false",
        help="do not run attnkit's failures again on torch's own FlexAttention",
    )  # fmt: skip
    parser.add_argument("-n", dest="workers", type=int, default=1, help="pytest-xdist workers (default 1)")
    parser.add_argument("--oracle", choices=("torch", "attnkit"), default="torch", help="who answers float64 calls")
    parser.add_argument(
        "--against", choices=("attnkit", "torch"), default="attnkit",
        help="torch: run the tests on torch's own FlexAttention (the baseline: what this torch fails itself)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    missing = [str(p) for p in args.paths if not p.is_file()]
    if missing:
        parser.error(f"no such test file: {', '.join(missing)} (take them from PyTorch's repository; see --help)")
    try:
        import expecttest  # noqa: F401
    except ImportError:
        parser.error("torch's test utilities need expecttest: pip install expecttest")

    import pytest

    os.environ["ATTNKIT_TORCH_ORACLE"] = args.oracle
    os.environ["ATTNKIT_TORCH_AGAINST"] = args.against
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(ROOT / "scripts"))
    rootdir = Path(os.path.commonpath([p.resolve().parent for p in args.paths]))
    pytest_args = [
        *(args.only or map(str, args.paths)),
        "-p",
        "torch_flex_shim",
        "-c",
        os.devnull,
        "--rootdir",
        str(rootdir),
        "-q",
    ]
    pytest_args += ["-p", "no:cacheprovider", "-o", "python_files=test_*.py"]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    if args.workers > 1:
        pytest_args += ["-n", str(args.workers)]
    outcomes = Outcomes()
    started = time.monotonic()
    code = pytest.main(pytest_args, plugins=[outcomes])
    if args.against == "attnkit" and args.baseline:
        _mark_torchs_own_failures(outcomes.results, args.paths)
    summary = summarize(outcomes.results)
    summary.update(
        machine=_machine(),
        minutes=round((time.monotonic() - started) / 60, 1),
        oracle=args.oracle,
        against=args.against,
    )
    summary["files"] = [p.name for p in args.paths]
    shown = ("counts", "failures", "not_applicable", "fails_on_torch_itself")
    print(json.dumps({k: summary[k] for k in shown}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "tests": outcomes.results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if code in (0, 1) else int(code)


if __name__ == "__main__":
    raise SystemExit(main())
