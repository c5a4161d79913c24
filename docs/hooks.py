"""mkdocs hook: benchmark tables rendered from ``benchmarks/results/*.json`` at build time.

A page writes ``<!-- bench: NAME -->`` and gets the table of that result file (see
:data:`TABLES`): the numbers on the site are always the ones the last benchmark run wrote,
never copied by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLACEHOLDER = re.compile(r"<!-- bench: ([\w.-]+) -->")


def _load(name: str):
    return json.loads((RESULTS / f"{name}.json").read_text())


def _table(header: list[str], rows: list[list]) -> str:
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def _ideal(r: dict) -> str:
    """attnkit over the block ideal: the median of the rounds' ratios with its spread where the
    run recorded them, else the ratio of the two medians (results written before that)."""
    if "attnkit_ideal" in r:
        return f"{r['attnkit_ideal']:.2f}x ±{100 * r['attnkit_ideal_spread']:.0f}%"
    return _ratio(r["attnkit_ms"], r.get("ideal_ms"))


def cpu(name: str) -> str:
    d = _load(name)
    rows = []
    for r in d["rows"]:
        flex = _ratio(r["attnkit_ms"], r["flex_ms"]) if r.get("flex_ms") else "-"
        ideal = _ideal(r)
        if "ideal_from_L" in r:
            ideal += f" (dense from L={r['ideal_from_L']})"
        gflops = "-"
        if "attnkit_gflops_kept" in r:
            dense = r.get("sdpa_dense_gflops")
            gflops = f"{r['attnkit_gflops_kept']:.0f} / {dense:.0f}" if dense else f"{r['attnkit_gflops_kept']:.0f}"
        live = f"{r['attnkit_live_mib']:.0f}" if "attnkit_live_mib" in r else "-"
        rows.append(
            [
                r["case"],
                r["L"],
                r["dtype"],
                r["mode"],
                round(r["attnkit_ms"], 2),
                _ratio(r["attnkit_ms"], r.get("sdpa_ms")),
                ideal,
                gflops,
                flex,
                live,
                r["kernel"],
            ]
        )
    meta = d.get("meta", {})
    header = ["case", "L", "dtype", "mode", "attnkit ms", "vs SDPA", "vs ideal", "GFLOP/s kept / dense SDPA"]
    cpu = ""
    if "model" in meta:
        units = ", ".join(meta.get("units", [])) or "no vector extensions listed"
        cpu = f" {meta['model']} ({units}); engine: {meta.get('engine', '?')}."
    return f"*{meta.get('threads', '?')} threads, torch {meta.get('torch', '?')}.{cpu}*\n\n" + _table(
        [*header, "vs Flex", "live MiB", "kernel"], rows
    )


def core(name: str) -> str:
    d = _load(name)
    rows = [
        [
            r["case"],
            r["L"],
            round(r["attnkit_ms"], 3),
            round(r["ref_ms"], 3) if r.get("ref_ms") else "-",
            r["ref"],
            _ratio(r["attnkit_ms"], r.get("ref_ms")),
            r["kernel"],
        ]
        for r in d["rows"]
    ]
    return _table(["case", "L", "attnkit ms", "reference ms", "reference", "ratio", "kernel"], rows)


def mods(name: str) -> str:
    d = _load(name)
    rows = [
        [
            r["case"],
            r["L"],
            r["mode"],
            round(r["attnkit_ms"], 2),
            r["baseline"],
            _ratio(r["attnkit_ms"], r["baseline_ms"]),
            _ideal(r),
            _ratio(r["attnkit_ms"], r["flex_ms"]) if r.get("flex_ms") else "-",
        ]
        for r in d["rows"]
    ]
    return _table(["case", "L", "mode", "attnkit ms", "baseline", "vs baseline", "vs ideal", "vs Flex"], rows)


def repro(name: str) -> str:
    """benchmarks/repro.py: each run's attnkit/ideal, the mean and the largest deviation."""
    d = _load(name)
    rows = [
        [
            s["case"],
            s["mode"],
            " / ".join(f"{r:.2f}x" for r in s["ratios"]),
            f"{s['mean']:.2f}x",
            f"±{s['deviation_pct']:.1f}%",
        ]
        for s in d["summary"]
    ]
    meta = d.get("meta", {})
    return (
        f"*{meta.get('runs', '?')} runs in fresh processes, {meta.get('repeats', '?')} rounds each, "
        f"{meta.get('threads', '?')} threads; {meta.get('model', '?')}.*\n\n"
        + _table(["case", "mode", "attnkit / ideal, each run", "mean", "largest deviation"], rows)
    )


def compile_(name: str) -> str:
    d = _load(name)
    rows = [
        [r["case"], r["ms"], f"{r['vs_eager_tiled']:.2f}x", r["first_call_s"], r["largest_allocation_mb"]]
        for r in d["rows"]
    ]
    return f"*L={d['length']}, {d['kept']:.0%} of blocks kept, {d['threads']} threads.*\n\n" + _table(
        ["case", "fwd+bwd ms", "vs eager tiled", "first call s", "largest allocation MB"], rows
    )


def gym(name: str) -> str:
    d = _load(name)
    rows = []
    for r in d["rows"]:
        flex = _ratio(r["attnkit_ms"], r["flex_ms"]) if r.get("flex_ms") else "-"
        rows.append(
            [
                r["case"],
                r["mode"],
                f"{r['kept_128']:.0%}",
                round(r["attnkit_ms"], 1),
                _ratio(r["attnkit_ms"], r["sdpa_ms"]),
                _ratio(r["attnkit_ms"], r["ideal_ms"]),
                round(r["prepare_ms"]),
                f"{r['prepare_ms'] / r['attnkit_ms']:.0%}",
                flex,
            ]
        )
    meta = d.get("meta", {})
    return f"*L={d['rows'][0]['L'] if d['rows'] else '?'}, {meta.get('threads', '?')} threads.*\n\n" + _table(
        [
            "mask",
            "mode",
            "blocks kept",
            "attnkit ms",
            "vs SDPA (dense mask)",
            "vs ideal",
            "prepare ms",
            "prepare / one call",
            "vs Flex",
        ],
        rows,
    )


def opstream(name: str) -> str:
    d = _load(name)
    rows = [[r["case"], r["mode"], r["fused_calls"], r["operations"]] for r in d["rows"]]
    meta = d.get("meta", {})
    return f"*L={meta.get('length', '?')}, {meta.get('dtype', '?')}.*\n\n" + _table(
        ["mask", "mode", "fused attention calls", "ATen operations"], rows
    )


def compare(name: str) -> str:
    d = _load(name)
    rows = [
        [r["case"], r["base_ratio"], r["new_ratio"], f"{r['new_vs_base']:.3f}x"]
        + ([f"{r['time_new_vs_base']:.3f}x"] if "time_new_vs_base" in r else ["-"])
        + ([f"{r['best_new_vs_base']:.3f}x"] if "best_new_vs_base" in r else ["-"])
        for r in d["rows"]
    ]
    return (
        f"*Against {d['base']}, {d['rounds']} interleaved rounds; ratios are attnkit over the script's reference "
        "in the same process; then attnkit's own time, after over before: the medians, and the fastest "
        "round of each side.*\n\n"
        + _table(["case", "before", "after", "after / before", "time after / before", "best after / before"], rows)
    )


def distributed(name: str) -> str:
    d = _load(name)
    rows = []
    for r in d["rows"]:
        rows.append(
            [
                r["L"],
                r["mask"],
                round(r["attnkit_fwd"], 1),
                round(r["ring_fwd"], 1),
                _ratio(r["ring_fwd"], r["attnkit_fwd"]),
                round(r["attnkit_fwdbwd"], 1),
                round(r["ring_fwdbwd"], 1),
                _ratio(r["ring_fwdbwd"], r["attnkit_fwdbwd"]),
                " / ".join(f"{x:g}" for x in r["sent_mb"])
                if isinstance(r.get("sent_mb"), list)
                else r.get("sent_mb", "-"),
            ]
        )
    return _table(
        [
            "L",
            "mask",
            "1 process fwd ms",
            "2 ranks fwd ms",
            "ratio",
            "1 process fwd+bwd ms",
            "2 ranks fwd+bwd ms",
            "ratio",
            "MB sent per rank (fwd)",
        ],
        rows,
    )


def long_context(name: str) -> str:
    d = _load(name)
    rows = [
        [
            r["L"],
            r["mask"],
            round(r["forward_ms"], 1),
            round(r["stats_ms"], 1),
            f"{r['ratio']:.2f}x",
            round(r["topk_ms"], 1),
            f"{r['topk_ratio']:.2f}x",
            round(r["stats_mb"], 1),
            r.get("eager_needs_gb", "-"),
        ]
        for r in d["stats"]
    ]
    header = ["L", "mask", "forward ms", "statistics ms", "vs forward", "with top-8 ms", "vs forward"]
    return _table([*header, "statistics MB", "full weights GB"], rows)


def accuracy(name: str) -> str:
    d = _load(name)
    n = len(d["problems"])
    rows = [
        [q, f"{s['median']:.2f}", f"{s['p90']:.2f}", f"{s['worst']:.2f}", f"{s['passes']} of {n}", s["passes_floored"]]
        for q, s in d["summary"].items()
    ]
    cpu = d.get("cpu", {})
    head = f"*{n} problems, {d['dtype']}, {cpu.get('model', '?')} ({', '.join(cpu.get('units', []))}).*\n\n"
    header = ["quantity", "median ratio", "90th percentile", "worst", "within the rule", "with the logit floor"]
    return head + _table(header, rows)


def hf(name: str) -> str:
    d = _load(name)
    rows = [
        [
            r["case"],
            r["mode"],
            round(r["eager_ms"], 2) if r.get("eager_ms") else "-",
            round(r["sdpa_ms"], 2),
            round(r["attnkit_ms"], 2),
            _ratio(r["attnkit_ms"], r["sdpa_ms"]),
        ]
        for r in d["rows"]
    ]
    return _table(["case", "mode", "eager ms", "sdpa ms", "attnkit ms", "attnkit / sdpa"], rows)


def speech(name: str) -> str:
    d = _load(name)
    rows = [[r["set"], f"{r['exact']:.1%}", f"{r['cer']:.2%}", f"{r['monotonic']:.1%}", r["n"]] for r in d["rows"]]
    return _table(["set", "exact strings", "character error rate", "monotonic alignment", "utterances"], rows)


def recommendation(name: str) -> str:
    d = _load(name)
    rows = [[model, f"{m['HR@10']:.3f}", f"{m['NDCG@10']:.3f}", m.get("train_seconds", "-")] for model, m in d.items()]
    return _table(["model", "HR@10", "NDCG@10", "training s"], rows)


def captioner(name: str) -> str:
    d = _load(name)
    return _table(
        ["strips", "exact captions", "words right", "aligned"],
        [[d["strips"], f"{d['exact']:.1%}", f"{d['word_accuracy']:.1%}", f"{d['alignment']:.1%}"]],
    )


def masks(name: str) -> str:
    """Making a mask new per call: ms, and its share of one forward / forward+backward."""
    d = _load(name)
    rows = []
    for r in d["rows"]:
        if "prepare_ms" not in r:  # attention-gym's catalogue: its own table (masks_gym)
            continue
        share = f"{r['share_of_forward']:.1%}" if "share_of_forward" in r else "-"
        share2 = f"{r['share_of_fwd_bwd']:.1%}" if "share_of_fwd_bwd" in r else "-"
        rows.append([r["L"], r["B"], r["kind"], round(r["prepare_ms"], 2), share, share2, r.get("first_call_s", "")])
    m = d.get("machine", {})
    head = f"*{m.get('model', '?')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}.*\n\n"
    return head + _table(
        ["L", "B", "mask (made new each call)", "make ms", "of a forward", "of fwd+bwd", "first call s"], rows
    )


def masks_gym(name: str) -> str:
    """attention-gym's catalogue: attnkit's create_block_mask against torch's, compiled and eager."""
    d = _load(name)
    rows = []
    for r in d["rows"]:
        if "attnkit_ms" not in r:
            continue
        if "torch_compiled_ms" in r:
            compiled = f"{r['torch_compiled_ms']:.2f}"
            ratio = f"{r['attnkit_ms'] / r['torch_compiled_ms']:.2f}x"
        else:
            compiled, ratio = ("fails to compile", "-") if "torch_compiled_error" in r else ("-", "-")
        eager = f"{r['torch_eager_ms']:.1f}" if "torch_eager_ms" in r else "-"
        ours = f"{r['attnkit_ms']:.2f}"
        traced = f"{r['attnkit_traced_ms']:.2f}" if "attnkit_traced_ms" in r else "-"
        rows.append([r["L"], r["kind"], ours, traced, compiled, ratio, eager, r.get("torch_compile_s", "-")])
    m = d.get("machine", {})
    head = f"*{m.get('model', '?')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}.*\n\n"
    return head + _table(
        [
            "L",
            "mask",
            "attnkit ms",
            "attnkit ms, traced anew",
            "torch compiled ms",
            "attnkit / compiled",
            "torch eager ms",
            "torch compile s",
        ],
        rows,
    )


def rollout(name: str) -> str:
    d = _load(name)
    rows = [
        [
            r["L"],
            r["forward_s"],
            r["rollout_s"],
            f"{r['rollout_vs_forward']:.2f}x",
            r["grad_s"] if r["grad_s"] == r["grad_s"] else "-",
            f"{r['grad_vs_forward']:.2f}x" if r["grad_vs_forward"] == r["grad_vs_forward"] else "-",
            r["forward_kb_per_token"],
            r["rollout_kb_per_token"],
            r["grad_kb_per_token"] if r["grad_kb_per_token"] == r["grad_kb_per_token"] else "-",
        ]
        for r in d["rows"]
    ]
    m = d.get("machine", {})
    head = f"*{m.get('model', '?')}, {m.get('threads', '?')} threads; memory: peak live tensors per token.*\n\n"
    return head + _table(
        ["L", "forward s", "rollout s", "vs forward", "grad s", "vs forward", "forward KiB", "rollout KiB", "grad KiB"],
        rows,
    )


def kv_compress(name: str) -> str:
    d = _load(name)
    methods = tuple(d.get("methods", ("snapkv", "tova", "observed", "random", "recent")))
    keep = list(d["rows"][0][methods[0]]) if d["rows"] else []
    shares = " / ".join(f"{float(k):.0%}" for k in keep)
    rows = [
        [
            f"{r['L']:,}",
            r.get("budgets", "uniform") + (", per head (AdaKV)" if r.get("allocate") == "heads" else ""),
            r["texts"],
            f"{r['full']:.1%}",
        ]
        + [" / ".join(f"{r[m][k]:.1%}" for k in keep) for m in methods]
        for r in d["rows"]
    ]
    m = d.get("machine", {})
    head = f"*{m.get('model', '?')}, {m.get('threads', '?')} threads; `{d.get('command', '')}`.*\n\n"
    columns = ["text length", "layer budgets", "texts", "full cache", *(f"{m} {shares}" for m in methods)]
    return head + _table(columns, rows)


def models(name: str) -> str:
    d = _load(name)
    rows = [
        [
            r["model"],
            r["case"],
            r["dtype"],
            f"{r['sdpa_s'] * 1e3:.1f}",
            f"{r['attnkit_s'] * 1e3:.1f}",
            f"{r['ratio']:.2f}x" + (f" ±{100 * r['ratio_spread']:.0f}%" if "ratio_spread" in r else ""),
        ]
        for r in d["rows"]
    ]
    m = d.get("machine", {})
    head = f"*{m.get('model', '?')}, {m.get('threads', '?')} threads; `{d.get('command', '')}`.*\n\n"
    return head + _table(["model", "case", "dtype", "sdpa ms", "attnkit ms", "attnkit / sdpa"], rows)


def torch_flex_tests(name: str) -> str:
    d = _load(name)["summary"]
    counts = d["counts"]
    # the runner's outcome keys, with the words the table shows; an outcome not named here still shows
    labels = {"fails on torch": "fails on torch itself"}
    kinds = ["passed", "failed", "fails on torch", "not applicable", "skipped"]
    kinds += [k for k in counts if k not in kinds]
    machine = d.get("machine", {})
    head = (
        f"*{', '.join(d.get('files', []))}; torch {machine.get('torch', '?')}, {machine.get('cpu', '?')}; "
        f"{d.get('minutes', '?')} minutes.*\n\n"
    )
    out = head + _table(
        ["outcome", "tests"], [[labels.get(k, k), counts.get(k, 0)] for k in kinds] + [["total", sum(counts.values())]]
    )

    def listed(title: str, groups: dict) -> str:
        if not groups:
            return ""
        lines = [f"- {why} ({len(ids)}: `{ids[0].split('::')[-1]}`{', ...' if len(ids) > 1 else ''})"
                 for why, ids in groups.items()]  # fmt: skip
        return f"\n\n{title}:\n\n" + "\n".join(lines)

    out += listed("Failed, by the first line of the error", d.get("failures", {}))
    out += listed("Failing on torch's own FlexAttention too", d.get("fails_on_torch_itself", {}))
    out += listed("Not applicable", d.get("not_applicable", {}))
    skipped = d.get("skipped_because", {})
    if skipped:
        out += "\n\nSkipped by the tests themselves:\n\n" + "\n".join(f"- {k}: {v}" for k, v in skipped.items())
    return out


TABLES = {
    "masks": masks,
    "masks_4096_recheck": masks,
    "masks_gym": masks_gym,
    "masks_gym_zen4": masks_gym,
    "kv_compress": kv_compress,
    "kv_budgets": kv_compress,
    "kv_budgets_32k": kv_compress,
    "kv_heads": kv_compress,
    "kv_heads_32k": kv_compress,
    "models": models,
    "models_decode": models,
    "models_zen4": models,
    "models_decode_zen4": models,
    "torch_flex_tests": torch_flex_tests,
    "rollout": rollout,
    "cpu": cpu,
    "cpu_4096": cpu,
    "cpu_4096_amx": cpu,
    "cpu_4096_1thread": cpu,
    "cpu_4096_flex": cpu,
    "cpu_long": cpu,
    "core": core,
    "core_xeon": core,
    "core_1thread_zen4": core,
    "mods": mods,
    "repro_zen4": repro,
    "repro_zen4_later": repro,
    "mods_zen4": mods,
    "compile": compile_,
    "gym": gym,
    "opstream": opstream,
    "compare_core": compare,
    "compare_cpu": compare,
    "compare_cpu_masked": compare,
    "compare_cpu_wave48": compare,
    "compare_cpu_wave48_rerun": compare,
    "distributed": distributed,
    "long_context": long_context,
    "accuracy": accuracy,
    "accuracy_bf16": accuracy,
    "accuracy_xeon": accuracy,
    "accuracy_bf16_xeon": accuracy,
    "hf_transformers": hf,
    "speech": speech,
    "recommendation": recommendation,
    "captioner": captioner,
}


def render(name: str) -> str:
    if name not in TABLES:
        raise KeyError(f"no benchmark table named {name!r} (known: {sorted(TABLES)})")
    if not (RESULTS / f"{name}.json").is_file():
        return f"*No results yet: run the benchmark that writes benchmarks/results/{name}.json.*"
    return TABLES[name](name)


#: Links of the repository's own Markdown (CHANGELOG.md, included by docs/changelog.md) to docs pages.
REPO_LINK = re.compile(r"\]\(docs/")


def on_page_markdown(markdown, page, config, files):  # mkdocs hook
    if page.file.src_uri == "changelog.md":  # CHANGELOG.md itself, its links made relative to docs/
        markdown = REPO_LINK.sub("](", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"))
    return PLACEHOLDER.sub(lambda m: render(m.group(1)), markdown)
