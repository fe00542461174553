"""Run every benchmark of the course, then write one summary of their headline figures.

    python -m benchmarks.run_all            # what `make bench` runs (about 10 minutes on 2 CPU cores)
    python -m benchmarks.run_all --quick    # each benchmark's smoke run, into a scratch folder
    python -m benchmarks.run_all --summary  # only rewrite the summary from the JSON files there

Each benchmark runs as a module in its own process, one after another, and writes its JSON,
markdown and plots into the output folder; the summary (``README.md`` there) gives the
machine, each benchmark's time, and every figure beside the target a lesson set for it. A
benchmark that misses a target or a check exits with status 1; this script carries on and
exits with status 1 at the end, naming them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

from benchmarks.results_io import machine, markdown_table
from benchmarks.targets import BATCHING, LORA, PAGED, QUANTIZATION, SERVER, SPECULATIVE

HERE = pathlib.Path(__file__).resolve().parent
#: Reports written apart from this run (``make bench-vllm``), linked from the summary.
APART = ("bench_vllm",)
RESULTS = HERE / "results"

#: script, the JSON/markdown name it writes, and what it covers. (Each runs as the module
#: ``benchmarks.<script without .py>``; the script's name labels its row in the summary.)
BENCHMARKS = [
    ("bench_decoding.py", "decoding", "lesson 01: KV cache, torch.compile, roofline"),
    ("bench_batching.py", "bench_batching", "lessons 02-03: static and continuous batching"),
    ("bench_quantization.py", "quantization", "lesson 04: quantization"),
    ("bench_lora.py", "lora", "lessons 05-06: multi-LoRA"),
    ("bench_server.py", "bench_server", "lesson 07: the server"),
    ("bench_paged.py", "bench_paged", "lesson 08: paged KV cache, prefix caching, chunked prefill"),
    ("bench_speculative.py", "bench_speculative", "lesson 09: speculative decoding"),
]


def run(script: str, out: pathlib.Path, quick: bool) -> dict:
    """Run one benchmark as a module; return its exit status and wall time."""
    module = "benchmarks." + script.removesuffix(".py")
    command = [sys.executable, "-m", module, "--out", str(out)] + (["--quick"] if quick else [])
    print(f"\n=== {script} ===", flush=True)
    start = time.perf_counter()
    status = subprocess.call(command, cwd=HERE.parent)
    return {"script": script, "status": status, "seconds": time.perf_counter() - start}


def _load(out: pathlib.Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _x(value: float) -> str:
    return f"{value:.2f}x"


def headline_rows(out: pathlib.Path) -> list[tuple[str, str, str, str]]:
    """(what, measured, target, verdict) for every figure the lessons claim."""
    rows = []

    def add(what, measured, target="", met=None):
        rows.append((what, measured, target, "" if met is None else ("met" if met else "**missed**")))

    for name, figures in (("decoding", decoding_rows), ("bench_batching", batching_rows),
                          ("quantization", quantization_rows), ("lora", lora_rows),
                          ("bench_server", server_rows), ("bench_paged", paged_rows),
                          ("bench_speculative", speculative_rows)):
        result = _load(out, name)
        if result:
            figures(result, add)
    return rows


def decoding_rows(dec, add) -> None:
    for r in dec["kv_cache"]:
        add(f"KV cache vs no cache, {r['new_tokens']} new tokens (time ratio)", _x(r["speedup"]))
    for r in dec.get("compile", []):
        add(f"torch.compile'd decode step vs eager, batch {r['batch']} (compile "
            f"{r['compile_seconds']:.0f} s apart)", _x(r["eager_over_compiled"]))
    for name, info in dec["roofline"]["models"].items():
        add(f"{name}, batch 1: measured tokens/s / this CPU's bound",
            f"{info['rows'][0]['measured_over_bound']:.0%}")


def batching_rows(bat, add) -> None:
    q, g = bat["course_queue"], bat["generate"]
    add("continuous vs static, course queue (time ratio)", _x(q["speedup"]),
        f">= {BATCHING['speedup']:g}x", q["speedup"] >= BATCHING["speedup"])
    add("decode steps / ideal bound, course queue", f"{q['steps_over_ideal']:.3f}",
        f"<= {BATCHING['steps_over_ideal']:g}",
        q["steps_over_ideal"] <= BATCHING["steps_over_ideal"])
    add("our batched decode / `model.generate` (time)", _x(g["ours_over_generate"]),
        f"<= {BATCHING['ours_over_generate']:g}x",
        g["ours_over_generate"] <= BATCHING["ours_over_generate"])
    if "generate_batch" in bat:
        add("our continuous batching / transformers `generate_batch`, course queue (time)",
            _x(bat["generate_batch"]["ours_over_generate_batch"]))
    lt = bat.get("long_tail")
    if lt:
        d = lt["drivers"]
        add(f"continuous vs static, {d['requests']} long-tailed requests", _x(d["speedup"]))
        add("decode steps / ideal bound, long-tailed queue", f"{d['steps_over_ideal']:.3f}",
            f"<= {BATCHING['steps_over_ideal']:g}",
            d["steps_over_ideal"] <= BATCHING["steps_over_ideal"])
        if "generate_batch" in lt:
            add("our continuous batching / `generate_batch`, long-tailed queue (time)",
                _x(lt["generate_batch"]["ours_over_generate_batch"]))


def quantization_rows(quant, add) -> None:
    by_name = {r["variant"]: r for r in quant["rows"]}
    fp32 = by_name["fp32"]
    tensor = by_name.get("uint8 per-tensor")
    if tensor:
        add("uint8 per-tensor footprint / fp32", f"{tensor['ratio_to_fp32']:.4f}",
            f"<= {QUANTIZATION['per_tensor_footprint']:g}",
            tensor["ratio_to_fp32"] <= QUANTIZATION["per_tensor_footprint"])
        add("perplexity fp32 → uint8 per-tensor",
            f"{fp32['perplexity']:.4f} → {tensor['perplexity']:.4f}")
    ao = next((r for n, r in by_name.items() if n.startswith("torchao int8")), None)
    if ao:
        add("torchao int8 weight-only footprint / fp32", f"{ao['ratio_to_fp32']:.4f}")
        if "fp32_over_this" in ao:
            add("torchao int8 weight-only decode speed vs fp32", _x(ao["fp32_over_this"]))


def lora_rows(lora, add) -> None:
    toys = [(lora["machine"]["threads"], lora["toy"])]
    if "toy_all_cores" in lora:
        toys.append((lora["toy_all_cores"]["threads"], lora["toy_all_cores"]["rows"]))
    for threads, toy in toys:
        at_64 = [r for r in toy if r["batch"] == 64]
        if at_64:
            add(f"gathered vs loop, toy model, batch 64, 64 adapters, {threads} thread(s) "
                "(time ratio)", _x(at_64[0]["lora_ratio"]), f">= {LORA['gathered_at_64']:g}x",
                at_64[0]["lora_ratio"] >= LORA["gathered_at_64"])
    real = lora.get("real")
    if real:
        add(f"ours vs peft mixed batch, shipped adapters ({len(real['adapters'])} + none), "
            f"batch {real['batch']} (time ratio)", _x(real["peft_over_ours_total_s"]),
            f">= {LORA['peft_over_ours']:g}x",
            real["peft_over_ours_total_s"] >= LORA["peft_over_ours"])
        add("  ceiling of that ratio: peft / base model with no adapters",
            _x(real["peft_over_base_total_s"]))


def server_rows(server, add) -> None:
    add(f"server: {server['clients']} concurrent streams vs one after another (tokens/s)",
        _x(server["speedup"]), f">= {SERVER['speedup']:g}x",
        server["speedup"] >= SERVER["speedup"])
    single = server.get("single_client")
    if single:
        add("server: one client vs the bare decode loop on the same prompts (tokens/s)",
            f"{single['server_over_bare_loop']:.0%}", f">= {SERVER['single_client']:.0%}",
            single["server_over_bare_loop"] >= SERVER["single_client"])
    compared = server.get("transformers_serve", {})
    if "error" in compared:
        add("server vs `transformers serve --continuous-batching`", "not run: " +
            compared["error"][:80], f">= {SERVER['transformers']:g}x at 16 clients", False)
    for row in compared.get("levels", []):
        target = row["clients"] == 16
        add(f"server vs `transformers serve --continuous-batching`, {row['clients']} "
            "streaming clients (tokens/s)", _x(row["ours_over_theirs"]),
            f">= {SERVER['transformers']:g}x" if target else "",
            row["ours_over_theirs"] >= SERVER["transformers"] if target else None)
    for level in server.get("sweep", {}).get("levels", []):
        add(f"server: {level['clients']} concurrent clients, tokens/s (TTFT p50)",
            f"{level['tokens_per_second']['median']:.0f} "
            f"({level['ttft_p50_seconds']['median'] * 1e3:.0f} ms)")


def paged_rows(paged, add) -> None:
    c, p, g, t = (paged[k] for k in ("concurrency", "prefix", "chunked", "throughput"))
    add("paged vs padded: requests at once in one KV budget", _x(c["ratio"]),
        f">= {PAGED['concurrency']:g}x", c["ratio"] >= PAGED["concurrency"])
    add(f"TTFT, {p['prefix_tokens']}-token prefix: fresh vs cached (time ratio)", _x(p["ratio"]),
        ">= 3x", p["ratio"] >= 3)
    add(f"worst inter-token gap while a long prompt arrives: whole vs chunks of {g['chunk']}",
        f"{g['whole']['median'] * 1e3:.0f} → {g['chunked']['median'] * 1e3:.0f} ms")
    add("paged / contiguous continuous batching, course queue (time; the gather's cost)",
        _x(t["paged_over_contiguous"]))
    if "generate_batch" in t:
        add("paged continuous batching vs transformers `generate_batch`, course queue (tokens/s)",
            f"{t['paged']['tokens_per_second']:.0f} vs {t['generate_batch']['tokens_per_second']:.0f}")


def speculative_rows(spec, add) -> None:
    c, s = spec["copy"], spec["story"]
    add(f"prompt lookup (k={c['k']}) vs plain greedy, an answer that repeats its prompt "
        "(tokens/s, same text)",
        _x(c["lookup_over_plain"]), f">= {SPECULATIVE['lookup']:g}x",
        c["lookup_over_plain"] >= SPECULATIVE["lookup"] and c["same_text"])
    best = max(s["by_k"], key=lambda row: row["over_plain"])
    add(f"draft model vs plain greedy, stories, best k={best['k']} (tokens/s; acceptance "
        f"{best['acceptance']:.0%})", _x(best["over_plain"]))
    add("ours vs transformers prompt lookup, same prompts and k (tokens/s)",
        _x(c["ours_over_transformers"]), f">= {SPECULATIVE['ours_vs_transformers']:g}x",
        c["ours_over_transformers"] >= SPECULATIVE["ours_vs_transformers"])
    add("ours vs transformers assisted generation, same prompts and k (tokens/s)",
        _x(s["ours_over_transformers"]), f">= {SPECULATIVE['ours_vs_transformers']:g}x",
        s["ours_over_transformers"] >= SPECULATIVE["ours_vs_transformers"])


def write_summary(out: pathlib.Path, runs: list[dict] | None) -> str:
    """README.md of the results folder: machine, run times, headline figures, links."""
    timing_path = out / "run_all.json"
    if runs is None and timing_path.exists():
        runs = json.loads(timing_path.read_text())["runs"]
    meta = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    lines = [
        "# Benchmark results", "",
        f"Run by `make bench` (`python -m benchmarks.run_all`) on {meta.get('machine', '?')}, "
        f"{meta.get('date', '?')}; torch threads: see each benchmark (one, as in the lessons, "
        "unless it says otherwise). No GPU was used. Every ratio was measured side by side in "
        "one run, over several repetitions (medians; each benchmark's page has the spread).", "",
    ]
    if runs:
        covers = {script: what for script, _, what in BENCHMARKS}
        names = {script: name for script, name, _ in BENCHMARKS}
        rows = [[f"[{r['script']}]({names[r['script']]}.md)", covers[r["script"]],
                 f"{r['seconds']:.0f} s", "ok" if r["status"] == 0 else f"status {r['status']}"]
                for r in runs]
        rows.append(["**all**", "", f"**{sum(r['seconds'] for r in runs) / 60:.1f} min**", ""])
        lines += markdown_table(["benchmark", "covers", "wall time", "exit"], rows, "llrl") + [""]
    what = {"bench_vllm": "from `make bench-vllm` (the course server beside real vLLM, "
                          "defaults against defaults, 1, 16 and 64 streaming clients; plot: "
                          "[vllm.png](vllm.png))"}
    apart = [f"[{name}.md]({name}.md) {what[name]}" for name in APART
             if (out / f"{name}.md").exists()]
    if apart:
        lines += ["Run apart from `make bench` (vLLM's own environment, 60-100 s to start): "
                  + "; ".join(apart) + ".", ""]
    lines += ["## Headline figures", ""]
    lines += markdown_table(["figure", "measured", "target", ""], headline_rows(out), "lrrl")
    plots = sorted(p.name for p in out.glob("*.png"))
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    text = "\n".join(lines) + "\n"
    (out / "README.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="each benchmark's smoke run (default output: a scratch folder)")
    ap.add_argument("--summary", action="store_true", help="only rewrite README.md")
    ap.add_argument("--out", default=None, help=f"output folder (default {RESULTS})")
    ap.add_argument("--only", nargs="+", choices=[s for s, _, _ in BENCHMARKS],
                    help="run only these scripts (the summary still covers every JSON there)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out) if args.out else (
        pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "course-bench-quick" if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    if args.summary:
        print(write_summary(out, None))
        return 0
    runs = [run(script, out, args.quick) for script, _, _ in BENCHMARKS
            if not args.only or script in args.only]
    if args.only and (out / "run_all.json").exists():  # keep the other benchmarks' times
        earlier = json.loads((out / "run_all.json").read_text())["runs"]
        mine = {r["script"] for r in runs}
        runs = [r for r in earlier if r["script"] not in mine] + runs
        order = [s for s, _, _ in BENCHMARKS]
        runs.sort(key=lambda r: order.index(r["script"]))
    (out / "run_all.json").write_text(json.dumps({
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "runs": runs}, indent=1) + "\n")
    print(write_summary(out, runs))
    failed = [r["script"] for r in runs if r["status"] != 0]
    if failed:
        print(f"missed a target or a check: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
