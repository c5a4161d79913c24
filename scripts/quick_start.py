"""The README's quick start, run by `make wheel` against the installed wheel (no extras)."""

import re
import sys
from pathlib import Path

import attnkit

readme = Path(__file__).resolve().parents[1] / "README.md"
block = readme.read_text(encoding="utf-8").split("## Quick start", 1)[1].split("```python", 1)[1].split("```", 1)[0]
assert "site-packages" in attnkit.__file__, f"attnkit came from {attnkit.__file__}, not the installed wheel"
exec(compile(block, "README quick start", "exec"), {})
wheel_files = {p.name for p in Path(attnkit.__file__).parent.rglob("*") if p.is_file()}
for needed in ("date_translator.safetensors", "attention.html", "attention.js"):
    assert any(re.fullmatch(needed.replace(".", r"\."), f) for f in wheel_files), f"the wheel lacks {needed}"
dist = Path(attnkit.__file__).parent.parent / f"attnkit-{attnkit.__version__}.dist-info"
assert any("LICENSE" in p.name for p in dist.rglob("*")), "the wheel carries no LICENSE"
print(f"quick start ran on attnkit {attnkit.__version__} from the wheel", file=sys.stderr)
