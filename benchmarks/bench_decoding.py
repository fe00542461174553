"""Decoding one sequence: what the KV cache buys, what torch.compile buys, and how far both are
from what the hardware allows (lesson 01, and the roofline behind lessons 02-04).

    python -m benchmarks.bench_decoding            # about 3 minutes on 2 CPU cores
    python -m benchmarks.bench_decoding --quick    # fewer repetitions, no compile, small grid

1. KV cache versus none, 50 to 400 new tokens (greedy, EOS ignored). Past the bundled model's
   256 positions its position table is extended (rows repeat the last one): timing only.
2. One decode step, eager versus ``torch.compile`` on a ``StaticCache`` (and the usual eager
   step on a ``DynamicCache``), at batch 1, 8 and 64; the cold compile time apart; same tokens.
3. A roofline for the decode step (``roofline.py``).

Writes ``decoding.json``, ``.md``, ``kv_cache.png`` and ``roofline.png``.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import (arguments, begin, load_average, machine, markdown_table,
                                   min_max, numbers, positive_int, verdicts, write_results)
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

@torch.no_grad()
def decode_steps(model, tokenizer, batch, steps, step_fn=None):
    """Greedy decoding of ``steps`` tokens for ``batch`` copies of the prompt. ``step_fn``
    (token, cache, position) -> logits runs each step on a StaticCache; None runs the usual
    eager step with a DynamicCache. Returns (tokens of row 0, seconds of each step)."""
    from transformers import StaticCache

    ids = tokenizer([PROMPT] * batch, return_tensors="pt").input_ids
    length = ids.shape[1]
    cache = (StaticCache(config=model.config, max_cache_len=length + steps)
             if step_fn else None)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                cache_position=torch.arange(length))
    cache = out.past_key_values
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens, seconds = [], []
    for i in range(steps):
        position = torch.tensor([length + i])
        start = time.perf_counter()
        if step_fn:
            logits = step_fn(token, cache, position)
        else:
            logits = model(input_ids=token, past_key_values=cache, use_cache=True,
                           cache_position=position).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        seconds.append(time.perf_counter() - start)
        tokens.append(int(token[0]))
    return tokens, seconds


def bench_compile(model, tokenizer, batches, steps, reps):
    """Per-step time: eager DynamicCache, eager StaticCache, compiled StaticCache."""
    def static_step(token, cache, position):
        return model(input_ids=token, past_key_values=cache, use_cache=True,
                     cache_position=position).logits

    compiled = torch.compile(static_step, dynamic=False)
    rows = []
    for batch in batches:
        (compiled_tokens, first), seconds = timed_once(
            lambda: decode_steps(model, tokenizer, batch, steps, compiled))
        compile_seconds = seconds - sum(first[1:])
        ways = {"eager_dynamic_cache": None, "eager_static_cache": static_step,
                "compiled_static_cache": compiled}
        # A sample is the median step of one run (decode_steps times each step); the compile
        # run above was the warm-up.
        timings = time_in_turns(
            {name: Candidate(lambda fn=fn: decode_steps(model, tokenizer, batch, steps, fn),
                             clock=lambda out: statistics.median(out[1]))
             for name, fn in ways.items()}, repeats=reps, warmup=0)
        row = {"batch": batch, "steps": steps, "compile_seconds": compile_seconds,
               "same_tokens": all(tokens == compiled_tokens
                                  for tokens, _ in timings.last.values())}
        for name in ways:
            row[name] = timings.spread(name)
        row["eager_over_compiled"] = (row["eager_dynamic_cache"]["median"]
                                      / row["compiled_static_cache"]["median"])
        print(f"  batch {batch}: eager {row['eager_dynamic_cache']['median'] * 1e3:.2f} ms/step "
              f"(static cache {row['eager_static_cache']['median'] * 1e3:.2f}), compiled "
              f"{row['compiled_static_cache']['median'] * 1e3:.2f} ms/step = "
              f"{row['eager_over_compiled']:.2f}x; compile {compile_seconds:.1f} s; same "
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
        f"{result['date']}, {m['cpu']}, {m['threads']} torch thread(s), "
        f"torch {m['torch']}, transformers {m['transformers']}; load average before the run "
        f"{numbers(m['load_average'])}. Medians over "
        f"{result['args']['reps']} repetitions (min-max beside them).", "",
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
    table = [[r["batch"], f"{r['eager_dynamic_cache']['median'] * 1e3:.2f} ms",
              f"{r['eager_static_cache']['median'] * 1e3:.2f} ms",
              f"{r['compiled_static_cache']['median'] * 1e3:.2f} ms",
              f"**{r['eager_over_compiled']:.2f}x**", f"{r['compile_seconds']:.1f} s",
              r["same_tokens"]] for r in rows]
    return [
        "## One decode step: eager versus torch.compile", "",
        *markdown_table(["batch", "eager, DynamicCache", "eager, StaticCache",
                         "compiled, StaticCache", "eager / compiled", "compile time",
                         "same tokens"], table, "rrrrrrr"),
        "", f"Per-step medians over {rows[0]['steps']} steps. Compile time is the first "
        "compiled run minus its other steps, with an empty inductor cache (a cold compile); "
        "the first batch size pays for most of it.", ""]


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
        "machine": {"cpu": machine(), "cpus": os.cpu_count(),
                    "threads": args.threads, "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "load_average": load_average()},
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
