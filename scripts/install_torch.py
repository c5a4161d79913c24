"""Install PyTorch's CPU build where the package index would give its CUDA build (the set-up's first step).

On Linux, PyPI's ``torch==X`` is the CUDA build (about 17 ``nvidia-*`` packages, several GB); attnkit
runs on the CPU and the README promises the CPU build. This asks pip what the configured indexes
would install (``pip install --dry-run --report``): where that is the CPU build already (a machine
whose registry holds it, macOS, Windows) it is installed as is; where it would pull ``nvidia-*``
packages, the CPU build comes from PyTorch's own CPU index (``$TORCH_INDEX``, default
https://download.pytorch.org/whl/cpu), and where that index cannot be reached, from the configured
index after all, saying so. Nothing happens when the wanted release is installed already.

Usage: python scripts/install_torch.py VERSION [pip options, e.g. -c constraints.txt]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request

CPU_INDEX = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")


def _say(text: str) -> None:
    print(f"install_torch: {text}", flush=True)


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, text=True, capture_output=True)


def installed() -> str | None:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], text=True,
                          capture_output=True)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else None


def would_install(version: str, options: list[str]) -> list[tuple[str, str]]:
    """What the configured indexes would install for torch==version: (name, version) pairs."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        done = _pip("install", "--dry-run", "--quiet", "--ignore-installed", "--report", report, *options,
                    f"torch=={version}")  # fmt: skip
        if done.returncode != 0:
            sys.exit(f"install_torch: pip cannot resolve torch=={version}:\n{done.stderr[-2000:]}")
        with open(report) as f:
            items = json.load(f)["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in items]


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/torch/", timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


def pip_version() -> tuple[int, ...]:
    done = _pip("--version")
    try:
        return tuple(int(x) for x in done.stdout.split()[1].split(".")[:2])
    except (IndexError, ValueError):
        return (0,)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    version, options = argv[0], argv[1:]
    if pip_version() < (22, 2):  # --dry-run --report: pip 22.2 (a stock Ubuntu 22.04 venv has 22.0.2)
        _say(f"pip {'.'.join(map(str, pip_version()))} cannot tell what it would install: upgrading it first")
        upgrade = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "pip>=23.1"]
        if subprocess.run(upgrade).returncode:
            sys.exit("install_torch: pip could not be upgraded; run: python -m pip install 'pip>=23.1'")
    found = installed()
    if found is not None and found.split("+")[0] == version:
        _say(f"torch {found} is installed")
        return
    _say(f"asking the package index what torch=={version} would install (pip install --dry-run; a few seconds)")
    plan = would_install(version, options)
    cuda = sorted(name for name, _ in plan if name.lower().startswith("nvidia-"))
    if not cuda:
        torch_version = dict((n.lower(), v) for n, v in plan).get("torch", version)
        _say(f"installing torch {torch_version} from the configured package index")
        args = ["install", *options, f"torch=={version}"]
    elif reachable(CPU_INDEX):
        _say(f"the package index offers torch {version} as its CUDA build ({len(cuda)} nvidia-* packages); "
             f"installing the CPU build from {CPU_INDEX}")  # fmt: skip
        args = ["install", "--index-url", CPU_INDEX, *options, f"torch=={version}+cpu"]
    else:
        _say(f"the package index offers torch {version} as its CUDA build and {CPU_INDEX} cannot be reached "
             "(set TORCH_INDEX to a mirror of it): installing the CUDA build, which also runs on the CPU")  # fmt: skip
        args = ["install", *options, f"torch=={version}"]
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args])
    if done.returncode != 0:
        sys.exit(done.returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
