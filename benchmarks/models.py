"""Whole models on the CPU: attn_implementation="attnkit" beside "sdpa", same weights, one process.

    python benchmarks/models.py [--dtypes float32 bfloat16] [--repeats 3] [--quick] [--only CASE ...] [--out FILE]

A Llama-shaped decoder (hidden 512, 4 layers, 8 query / 2 KV heads, MLP 1376) and a BERT-shaped
encoder (hidden 512, 4 layers, 8 heads), randomly initialised from their configs (nothing is
downloaded), each built twice with the same weights; calls alternate between the two and each
time is a median of ``--repeats`` (after a warm-up), attnkit / sdpa the median over rounds of the
ratio of a round's two calls (every sample is written):

- ``prefill``: Llama, 4 prompts of 1024 tokens, left-padded to lengths 1024, 896, 768, 640;
- ``decode``: Llama, greedy steps (one token per sequence, 16 steps a sample) over a KV cache
  of 1k and 8k tokens (batch 4): transformers' ``DynamicCache`` (cut back after each sample) and a
  ``StaticCache`` (allocated once, its empty slots masked);
- ``train``: Llama, a training step (forward, loss, backward) over one row of 8 packed documents
  at L=4096 and 16 at L=16384 (``position_ids`` restart per document, as transformers packs);
- ``encode``: BERT, a padded batch of 8 sentences of up to 512 tokens, forward.

Writes ``benchmarks/results/models.json`` (with ``lscpu``'s model) and prints attnkit / sdpa.
``--quick`` runs the small cases only (1k decode, 4k training).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import machine  # benchmarks/machine.py
import torch
from cpu import round_ratios  # benchmarks/cpu.py
from transformers import AutoModel, AutoModelForCausalLM, BertConfig, DynamicCache, LlamaConfig

import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")

RESULTS = Path(__file__).parent / "results"
IMPLS = ("sdpa", "attnkit")


def pair(build, config, dtype):
    """The same randomly initialised weights under each attention implementation."""
    torch.manual_seed(0)
    built = {}
    for impl in IMPLS:
        built[impl] = build(copy.deepcopy(config), attn_implementation=impl)
        if impl != IMPLS[0]:
            built[impl].load_state_dict(built[IMPLS[0]].state_dict())
    return {k: m.to(dtype).eval() for k, m in built.items()}


def llama_pair(dtype):
    config = LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=32768, pad_token_id=0,
    )  # fmt: skip
    return pair(AutoModelForCausalLM.from_config, config, dtype)


def bert_pair(dtype):
    config = BertConfig(
        vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048,
        max_position_embeddings=512,
    )  # fmt: skip
    return pair(AutoModel.from_config, config, dtype)


def interleaved(steps: dict, repeats: int) -> dict:
    """Seconds of each step in each of ``repeats`` rounds, the steps alternating; one warm-up call each."""
    for step in steps.values():
        step()
    times: dict = {k: [] for k in steps}
    for _ in range(repeats):
        for k, step in steps.items():
            start = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - start)
    return times


def prefill_case(models, repeats):
    lengths = torch.tensor([1024, 896, 768, 640])
    ids = torch.randint(3, 8000, (4, 1024))
    mask = (torch.arange(1024)[None] >= 1024 - lengths[:, None]).long()  # left padding
    ids = ids * mask

    def step(m):
        def run():
            with torch.no_grad():
                m(input_ids=ids, attention_mask=mask, use_cache=False)

        return run

    return interleaved({k: step(m) for k, m in models.items()}, repeats)


def _cache_kw(model) -> str:
    """The KV-cache argument's name: ``cache`` in newer transformers 5.x, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_case(models, cache_len, repeats, steps=16, static=False):
    """Greedy steps over a prompt's KV cache: transformers' ``DynamicCache`` (cut back to the prompt
    after each sample), or with ``static`` a ``StaticCache`` (allocated once, as for compiled or
    memory-bound decoding: the empty slots past each step's position are masked, the cache never
    copied; it is not cut back, so it has room for every timed sample)."""
    from transformers import StaticCache

    ids = torch.randint(3, 8000, (4, cache_len))
    state = {}
    for k, m in models.items():
        if static:
            cache = StaticCache(config=m.config, max_cache_len=cache_len + steps * (repeats + 2))
        else:
            cache = DynamicCache()  # filled in place by the prompt's forward
        with torch.no_grad():
            out = m(input_ids=ids, use_cache=True, **{_cache_kw(m): cache})
        state[k] = [cache, out.logits[:, -1:].argmax(-1)]

    def step(k, m):
        def run():
            cache, token = state[k]
            with torch.no_grad():
                for _ in range(steps):
                    out = m(input_ids=token, use_cache=True, **{_cache_kw(m): cache})
                    token = out.logits[:, -1:].argmax(-1)
            if static:
                state[k][1] = token  # the positions only advance
            else:
                cache.crop(-steps)  # back to the prompt's cache (a negative count: tokens removed)

        return run

    found = interleaved({k: step(k, m) for k, m in models.items()}, repeats)
    return {k: [t / steps for t in ts] for k, ts in found.items()}  # seconds per step


def train_case(models, length, documents, repeats):
    g = torch.Generator().manual_seed(length)
    cuts = torch.sort(torch.randperm(length - 1, generator=g)[: documents - 1] + 1).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([length])]))
    pos = torch.cat([torch.arange(int(n)) for n in sizes])[None]
    ids = torch.randint(3, 8000, (1, length), generator=g)

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()

        return run

    for m in models.values():
        m.train()
    try:
        return interleaved({k: step(m) for k, m in models.items()}, repeats)
    finally:
        for m in models.values():
            m.eval()


def encode_case(models, repeats):
    lengths = torch.tensor([512, 480, 400, 352, 300, 256, 200, 128])
    ids = torch.randint(3, 8000, (8, 512))
    mask = (torch.arange(512)[None] < lengths[:, None]).long()  # right padding, as BERT's tokenizers pad

    def step(m):
        def run():
            with torch.no_grad():
                m(input_ids=ids * mask, attention_mask=mask)

        return run

    return interleaved({k: step(m) for k, m in models.items()}, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1k decode and 4k training only")
    parser.add_argument(
        "--only", nargs="+", choices=["prefill", "decode", "train", "encode"], help="these cases only (default: all)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "models.json")
    args = parser.parse_args()
    rows = []

    def record(model, case, dtype, samples):
        """Each implementation's median and samples; the ratio is the median over rounds of the two
        neighbouring calls' ratio (a slow phase of a shared machine that a ratio of two medians carries
        into one of them cancels), ``ratio_spread`` the half-width of the rounds' middle half over it."""
        row = {"model": model, "case": case, "dtype": dtype}
        for k, ts in samples.items():
            row[f"{k}_s"] = statistics.median(ts)
            row[f"{k}_samples_s"] = [round(t, 6) for t in ts]
        row["ratio"], row["ratio_spread"] = round_ratios(samples["attnkit"], samples["sdpa"])
        row["ratio_of_medians"] = row["attnkit_s"] / row["sdpa_s"]
        rows.append(row)
        print(f"{model:5s} {case:28s} {dtype:8s} sdpa {row['sdpa_s']:.4f} attnkit {row['attnkit_s']:.4f} "
              f"ratio {row['ratio']:.2f} ±{100 * row['ratio_spread']:.0f}%", flush=True)  # fmt: skip

    for name in args.dtypes:
        dtype = getattr(torch, name)
        wanted = set(args.only or ("prefill", "decode", "train", "encode"))
        llama = llama_pair(dtype)
        if "prefill" in wanted:
            record("llama", "prefill 4 x 1024, left-padded", name, prefill_case(llama, args.repeats))
        for cache_len in ((1024,) if args.quick else (1024, 8192)) if "decode" in wanted else ():
            record("llama", f"decode step, cache {cache_len}", name, decode_case(llama, cache_len, args.repeats))
            found = decode_case(llama, cache_len, args.repeats, static=True)
            record("llama", f"decode step, static cache {cache_len}", name, found)
        trainings = ((4096, 8),) if args.quick else ((4096, 8), (16384, 16))
        for length, documents in trainings if "train" in wanted else ():
            found = train_case(llama, length, documents, max(1, args.repeats - 1) if length > 4096 else args.repeats)
            record("llama", f"train step, {documents} docs x L={length}", name, found)
        del llama
        if "encode" in wanted:
            record("bert", "encode 8 x 512, padded", name, encode_case(bert_pair(dtype), args.repeats))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/models.py " + " ".join(sys.argv[1:])
    args.out.write_text(json.dumps({"machine": machine.describe(), "command": command.strip(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
