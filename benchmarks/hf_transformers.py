"""attnkit inside a HuggingFace Llama-style model on the CPU, beside eager and SDPA.

    python benchmarks/hf_transformers.py [--lengths 1024 4096] [--repeats 3]

A randomly initialised Llama (hidden 256, 4 query / 2 KV heads, 2 layers), the same
weights under ``attn_implementation`` = ``eager``, ``sdpa`` and ``attnkit``, in one
process, interleaved, medians of ``--repeats`` runs:

- packed rows (4 documents per row, found by transformers from ``position_ids``):
  forward, and a training step (forward, loss, backward);
- plain batches (no padding, no packing) at the first length: forward;
- greedy generation with a KV cache (prompt 128, 64 new tokens): tokens per second.

(Named hf_transformers.py so that it does not shadow the transformers package.)
Writes ``benchmarks/results/hf_transformers.json`` and prints a table of ratios to SDPA.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")

sys.path.insert(0, str(Path(__file__).parent))
from core import median_ms  # noqa: E402  (interleaved medians, shared with benchmarks/core.py)

RESULTS = Path(__file__).parent / "results"
IMPLS = ("eager", "sdpa", "attnkit")


def models():
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    built = {}
    for impl in IMPLS:
        built[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if impl != IMPLS[0]:
            built[impl].load_state_dict(built[IMPLS[0]].state_dict())
    return built


def forward_step(model, ids, pos):
    def step():
        with torch.no_grad():
            model(ids, position_ids=pos, use_cache=False)

    return step


def train_step(model, ids, pos):
    def step():
        model.zero_grad()
        model(ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()

    return step


def generate_step(model, prompt, new_tokens):
    def step():
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_transformers.json")
    args = parser.parse_args()
    built = models()
    rows = []
    for length in args.lengths:
        ids = torch.randint(3, 1000, (1, length))
        pos = torch.arange(length // 4).repeat(4)[None]  # 4 packed documents
        for mode, make in (("forward", forward_step), ("training step", train_step)):
            for m in built.values():
                m.train(mode == "training step")
            ms = median_ms({k: make(m, ids, pos) for k, m in built.items()}, args.repeats)
            rows.append({"case": f"packed x4, L={length}", "mode": mode, **{f"{k}_ms": v for k, v in ms.items()}})
            print(rows[-1], flush=True)
    length = args.lengths[0]
    ids = torch.randint(3, 1000, (2, length))
    pos = torch.arange(length)[None].expand(2, -1)
    for m in built.values():
        m.eval()
    ms = median_ms({k: forward_step(m, ids, pos) for k, m in built.items()}, args.repeats)
    rows.append({"case": f"plain B=2, L={length}", "mode": "forward", **{f"{k}_ms": v for k, v in ms.items()}})
    print(rows[-1], flush=True)
    prompt, new = torch.randint(3, 1000, (1, 128)), 64
    ms = median_ms({k: generate_step(m, prompt, new) for k, m in built.items()}, args.repeats)
    rows.append(
        {
            "case": "generate 64 tokens after 128",
            "mode": "tokens/s",
            **{f"{k}_ms": v for k, v in ms.items()},
            **{f"{k}_tok_s": 1e3 * new / v for k, v in ms.items()},
        }
    )
    print(rows[-1], flush=True)

    lines = ["| case | mode | eager ms | sdpa ms | attnkit ms | attnkit / sdpa |", "|---|---|---|---|---|---|"]
    for r in rows:
        extra = f" ({r['attnkit_tok_s']:.0f} vs {r['sdpa_tok_s']:.0f} tokens/s)" if "attnkit_tok_s" in r else ""
        lines.append(
            f"| {r['case']} | {r['mode']} | {r['eager_ms']:.1f} | {r['sdpa_ms']:.1f} | {r['attnkit_ms']:.1f} | "
            f"{r['attnkit_ms'] / r['sdpa_ms']:.2f}{extra} |"
        )
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
