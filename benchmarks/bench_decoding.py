"""Decoding one sequence: what the KV cache buys, what torch.compile buys, and how far both are
from what the hardware allows (lesson 01, and the roofline behind lessons 02-04).

    python -m benchmarks.bench_decoding            # about 3 minutes on 2 CPU cores
    python -m benchmarks.bench_decoding --quick    # fewer repetitions, no compile, small grid

1. KV cache versus none, 50 to 400 new tokens (greedy, EOS ignored). Past the bundled model's
   256 positions its position table is extended (rows repeat the last one): timing only.
2. Lesson 10's decode step on a ``StaticCache``, eager versus ``torch.compile``, at batch 1, 8
   and 64; the cold compile time apart; same tokens.
3. A roofline for the decode step (``roofline.py``).

Writes ``decoding.json``, ``.md``, ``kv_cache.png`` and ``roofline.png``.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import transformers

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import (arguments, begin, facts_line, markdown_table, min_max,
                                   positive_int, run_facts, verdicts, write_results)
from benchmarks.roofline import bench_roofline, plot_roofline, roofline_markdown
from benchmarks.timing import Candidate, time_in_turns, timed_once
from helpers.generation import generate_no_cache, generate_with_cache
from helpers.models import load_model

PROMPT = "Once upon a time"


# --- 1. KV cache versus no cache ------------------------------------------------------------

def with_positions(model, n_positions: int):
    """The model with its position table extended to ``n_positions`` rows (new rows repeat
    the last one). Only for timing longer runs than the model was trained for."""
    wpe = model.transformer.wpe
    if n_positions <= wpe.num_embeddings:
        return model
    table = torch.cat([wpe.weight.data,
                       wpe.weight.data[-1:].expand(n_positions - wpe.num_embeddings, -1)])
    model.transformer.wpe = torch.nn.Embedding.from_pretrained(table, freeze=True)
    model.config.n_positions = n_positions
    return model


def bench_kv_cache(model, tokenizer, lengths, reps):
    """Wall time of no-cache and cached greedy decoding for each length, taking turns."""
    rows = []
    for new_tokens in lengths:
        timings = time_in_turns({
            "no_cache": Candidate(lambda: generate_no_cache(model, tokenizer, PROMPT, new_tokens,
                                                            stop_at_eos=False),
                                  clock=lambda run: run.latency),
            "cache": Candidate(lambda: generate_with_cache(model, tokenizer, PROMPT, new_tokens,
                                                           stop_at_eos=False),
                               clock=lambda run: run.latency)}, repeats=reps)
        same = timings.last["no_cache"].token_ids == timings.last["cache"].token_ids
        row = {"new_tokens": new_tokens, "no_cache": timings.spread("no_cache"),
               "cache": timings.spread("cache"), "same_tokens": same,
               "speedup_per_run": timings.ratio_per_run("no_cache", "cache", 2)}
        row["speedup"] = row["no_cache"]["median"] / row["cache"]["median"]
        print(f"  {new_tokens:4d} tokens: no cache {row['no_cache']['median']:.3f} s, cache "
              f"{row['cache']['median']:.3f} s, {row['speedup']:.1f}x; same tokens {same}",
              flush=True)
        rows.append(row)
    return rows


# --- 2. torch.compile -------------------------------------------------------------------------

def bench_compile(model, tokenizer, batches, steps, reps):
    """Per-step time of lesson 10's static-cache decode step, eager and compiled, taking turns
    (a sample: the fastest of ``steps`` steps, ``helpers.compilation.time_decode``)."""
    from helpers.compilation import course_prompts, static_decode_step, time_decode

    prompts = course_prompts(tokenizer, n=max(batches))
    step = static_decode_step(model)
    ways = {"eager_static_cache": step,
            "compiled_static_cache": torch.compile(step, dynamic=False)}
    rows = []
    for batch in batches:
        def run(fn, batch=batch):
            return Candidate(lambda: time_decode(model, prompts, [batch], step=fn, steps=steps,
                                                 repeats=1, progress=False)[batch],
                             clock=lambda timing: timing.seconds_per_step)

        first, seconds = timed_once(run(ways["compiled_static_cache"]).run)   # compiles
        timings = time_in_turns({name: run(fn) for name, fn in ways.items()}, repeats=reps,
                                warmup=0)
        row = {"batch": batch, "steps": steps,
               "compile_seconds": seconds - steps * first.seconds_per_step,
               "same_tokens": all(torch.equal(t.token_ids, first.token_ids)
                                  for t in timings.last.values())}
        for name in ways:
            row[name] = timings.spread(name)
        row["eager_over_compiled"] = (row["eager_static_cache"]["median"]
                                      / row["compiled_static_cache"]["median"])
        print(f"  batch {batch}: eager {row['eager_static_cache']['median'] * 1e3:.2f} ms/step, "
              f"compiled {row['compiled_static_cache']['median'] * 1e3:.2f} ms/step = "
              f"{row['eager_over_compiled']:.2f}x; compile {row['compile_seconds']:.1f} s; same "
              f"tokens {row['same_tokens']}", flush=True)
        rows.append(row)
    return rows


# --- plots and table ----------------------------------------------------------------------

def plot_kv(rows, path):
    plt = pyplot()

    x = [r["new_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key, label, colour in (("no_cache", "no cache (re-reads the sequence)", "tab:red"),
                               ("cache", "KV cache (one token a step)", "tab:green")):
        med = [r[key]["median"] for r in rows]
        ax.plot(x, med, "o-", color=colour, label=label)
        ax.fill_between(x, [r[key]["min"] for r in rows], [r[key]["max"] for r in rows],
                        color=colour, alpha=0.15)
    for r in rows:
        ax.annotate(f"{r['speedup']:.1f}x", (r["new_tokens"], r["no_cache"]["median"]),
                    textcoords="offset points", xytext=(-6, 6), ha="right")
    ax.set(xlabel="new tokens", ylabel="seconds (median, band = min-max)",
           title="Greedy decoding of one sequence, bundled model")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def markdown(result):
    m = result["machine"]
    lines = [
        "# Decoding: KV cache, torch.compile, roofline", "",
        f"{result['date']}, {facts_line(m)}. Medians over {result['args']['reps']} "
        "repetitions (min-max beside them).", "",
    ]
    lines += kv_cache_markdown(result["kv_cache"])
    if result.get("compile"):
        lines += compile_markdown(result["compile"])
    lines += roofline_markdown(result["roofline"], m["threads"])
    return "\n".join(lines + ["Checks: " + verdicts(result["targets_met"]), ""])


def kv_cache_markdown(rows):
    table = [[r["new_tokens"], f"{r['no_cache']['median']:.3f}", min_max(r["no_cache"]),
              f"{r['cache']['median']:.3f}", min_max(r["cache"]), f"**{r['speedup']:.1f}x**",
              r["same_tokens"]] for r in rows]
    return [
        "## KV cache versus no cache (bundled model, one sequence, greedy)", "",
        *markdown_table(["new tokens", "no cache (s)", "min-max", "KV cache (s)", "min-max",
                         "no cache / cache", "same tokens"], table, "rrrrrrr"),
        "", "The ratio grows with the length: without the cache, step t re-reads t "
        "tokens. Past 256 tokens the bundled model's position table is extended for "
        "timing only (see the script). ![KV cache](kv_cache.png)", ""]


def compile_markdown(rows):
    table = [[r["batch"], f"{r['eager_static_cache']['median'] * 1e3:.2f} ms",
              f"{r['compiled_static_cache']['median'] * 1e3:.2f} ms",
              f"**{r['eager_over_compiled']:.2f}x**", f"{r['compile_seconds']:.1f} s",
              r["same_tokens"]] for r in rows]
    return [
        "## One decode step: eager versus torch.compile", "",
        *markdown_table(["batch", "eager", "compiled", "eager / compiled", "compile time",
                         "same tokens"], table, "rrrrrr"),
        "", f"Lesson 10's decode step on a StaticCache; a sample is the fastest of "
        f"{rows[0]['steps']} steps, the table their median. Compile time is the first compiled "
        "run minus its steps, with an empty inductor cache (a cold compile); the first batch "
        "size pays for most of it.", ""]


def main(argv=None):
    ap = arguments(__doc__, "2 repetitions, no torch.compile, a smaller roofline grid")
    ap.add_argument("--reps", type=positive_int, help="repetitions (default 3, quick 2)")
    ap.add_argument("--context", type=positive_int, default=64,
                    help="KV positions in the roofline steps")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile part")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 3)
    out = begin(args)
    # A fresh inductor cache: the compile time reported is that of a first, cold compile.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")

    model, tokenizer = load_model(device="cpu")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": dict(vars(args), reps=reps),
        "machine": run_facts(),
    }
    lengths = [50, 100, 200] if args.quick else [50, 100, 200, 400]
    print("KV cache vs no cache ...", flush=True)
    result["kv_cache"] = bench_kv_cache(with_positions(model, 512), tokenizer, lengths, reps)
    model, tokenizer = load_model(device="cpu")  # the bundled model as trained, again
    if not (args.quick or args.no_compile):
        print("torch.compile vs eager ...", flush=True)
        result["compile"] = bench_compile(model, tokenizer, batches=[1, 8, 64], steps=50,
                                          reps=reps)
    print("roofline ...", flush=True)
    gpt2_small = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    batches = [1, 8, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    result["roofline"] = bench_roofline({"bundled model": model, "GPT-2 small": gpt2_small},
                                        batches, args.context, reps, args.threads)
    result["targets_met"] = {  # no speed targets here: the figures are the point
        "same tokens everywhere": all(r["same_tokens"] for r in result["kv_cache"])
        and all(r["same_tokens"] for r in result.get("compile", [])),
    }
    plot_kv(result["kv_cache"], out / "kv_cache.png")
    plot_roofline(result["roofline"], out / "roofline.png")
    write_results(out, "decoding", result, markdown(result))
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
