"""Benchmark of lessons 02-03: static versus continuous batching, and our batched decode
versus transformers.

    python -m benchmarks.bench_batching            # a few minutes on a laptop CPU
    python -m benchmarks.bench_batching --quick    # fewer repetitions

On the course queue (32 requests, batch size 8, every 8th wants 100 tokens, the others 10),
each part side by side in one run:

1. static versus continuous batching: wall time and decode steps against the ideal schedule's,
   every request to its max_tokens ("as asked") and with EOS; again on 128 requests with
   long-tailed lengths;
2. our batched generation versus ``model.generate`` (8 requests, 100 new tokens), same tokens;
3. transformers' ``generate_batch`` on the same queues, same answers.

Targets (``targets.BATCHING``): continuous >= 3x static; decode steps within 15% of the ideal;
ours <= 1.2x ``model.generate``. Writes ``bench_batching.json``, ``.md`` and ``batching.png``;
exits with status 1 when a target is missed.
"""

from __future__ import annotations

import random
import statistics
import sys

import torch
import transformers

from benchmarks import PROMPTS
from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import (arguments, begin, facts_line, markdown_table, min_max,
                                   positive_int, run_facts, verdicts, write_results)
from benchmarks.targets import BATCHING as TARGETS
from benchmarks.timing import time_in_turns, traced
from helpers import load_model
from helpers.batching import (generate_batched, generate_continuous, generate_static,
                              ideal_decode_steps, static_decode_steps,
                              transformers_generate_batch)

BATCH_SIZE = 8
LONG_BATCH_SIZE = 16  # the long-tailed queue's batch size


def course_queue(n=32, every=8, long=100, short=10):
    """The lesson-03 queue: every ``every``-th request wants ``long`` tokens, the rest ``short``."""
    return [(PROMPTS[i % len(PROMPTS)], long if i % every == 0 else short) for i in range(n)]


def long_tailed_queue(n=128, seed=0, scale=8, alpha=1.5, cap=200):
    """``n`` requests whose max_tokens follow a Pareto law (most are short, a few are very
    long: the shape of real chat traffic), at least ``scale`` and at most ``cap`` tokens;
    the course prompts in turn. Seeded."""
    rng = random.Random(seed)
    return [(PROMPTS[i % len(PROMPTS)], min(cap, round(scale * rng.paretovariate(alpha))))
            for i in range(n)]


def run_drivers(model, tokenizer, queue, reps, stop_at_eos, batch_size=BATCH_SIZE):
    """Static and continuous batching on ``queue``, taking turns, ``reps`` times (after a
    warm-up run of each)."""
    drivers = {"static": generate_static, "continuous": generate_continuous}
    timings = time_in_turns({name: traced(driver, model, tokenizer, queue, batch_size=batch_size,
                                          progress=False, stop_at_eos=stop_at_eos)
                             for name, driver in drivers.items()}, repeats=reps)
    answers = {name: out[0] for name, out in timings.last.items()}
    traces = {name: out[1] for name, out in timings.last.items()}
    # Forward passes a request needs: its tokens, plus the EOS if it stopped at one.
    counts = [len(ids) + (len(ids) < max_tokens)
              for ids, (_, max_tokens) in zip(traces["continuous"].token_ids, queue)]
    ideal = ideal_decode_steps(counts, batch_size)
    result = {"stop_at_eos": stop_at_eos, "batch_size": batch_size, "requests": len(queue),
              "tokens": sum(len(ids) for ids in traces["continuous"].token_ids)}
    for name, trace in traces.items():
        result[name] = dict(timings.spread(name), decode_steps=trace.decode_steps,
                            prefill_steps=trace.prefill_steps,
                            slot_utilization=trace.utilization())
    return dict(
        result, ideal_decode_steps=ideal,
        static_decode_steps_bound=static_decode_steps(counts, batch_size),
        speedup=timings.median("static") / timings.median("continuous"),
        # Each round ran static then continuous: their ratio pairs runs under the same load.
        speedup_per_run=timings.ratio_per_run("static", "continuous", 3),
        steps_over_ideal=traces["continuous"].decode_steps / ideal,
        same_answers=answers["static"] == answers["continuous"],
        decode_seconds_per_step={
            name: statistics.median([s.seconds for s in trace.steps if s.kind == "decode"])
            for name, trace in traces.items()},
        merge_filter_seconds=traces["continuous"].seconds
        - sum(s.seconds for s in traces["continuous"].steps))


def run_generate(model, tokenizer, reps, new_tokens):
    """Our batched generation versus model.generate on one batch of 8 prompts, taking turns."""
    prompts = [p for p, _ in course_queue()[:BATCH_SIZE]]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)

    @torch.no_grad()
    def generate():
        # eos_token_id=[]: no stopping token, exactly new_tokens tokens per row, as ours.
        return model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=[], pad_token_id=tokenizer.pad_token_id)

    timings = time_in_turns({"ours": traced(generate_batched, model, tokenizer, prompts,
                                            max_new_tokens=new_tokens, stop_at_eos=False),
                             "generate": generate}, repeats=reps)
    trace, out = timings.last["ours"][1], timings.last["generate"]
    same = out[:, inputs["input_ids"].shape[1]:].tolist() == trace.token_ids
    return {"batch": len(prompts), "new_tokens": new_tokens, "ours": timings.spread("ours"),
            "generate": timings.spread("generate"),
            "ours_over_generate": timings.median("ours") / timings.median("generate"),
            "same_tokens": same}


def run_generate_batch(model, tokenizer, queue, reps, stop_at_eos=True, batch_size=BATCH_SIZE):
    """transformers' continuous batching versus ours, on the queue (by default with the EOS
    rule), taking turns."""
    def theirs():
        return transformers_generate_batch(model, tokenizer, queue, batch_size=batch_size,
                                           stop_at_eos=stop_at_eos)

    timings = time_in_turns({
        "generate_batch": theirs,
        "ours_continuous": traced(generate_continuous, model, tokenizer, queue,
                                  batch_size=batch_size, progress=False, stop_at_eos=stop_at_eos),
    }, repeats=reps)
    return {"generate_batch": timings.spread("generate_batch"),
            "ours_continuous": timings.spread("ours_continuous"),
            "ours_over_generate_batch": (timings.median("ours_continuous")
                                         / timings.median("generate_batch")),
            "same_answers": timings.last["generate_batch"] == timings.last["ours_continuous"][0]}


def plot(result, path):
    """Wall time per driver (left) and decode steps against their bounds (right), for the
    course queue and the long-tailed one."""
    plt = pyplot()

    # (generate_batch ran on the course queue with the EOS rule: not the same work as the
    # bars beside it, so it is drawn for the long-tailed queue only.)
    queues = {"course queue\n(32 requests, batch 8)": (result["course_queue"], None),
              f"long-tailed queue\n({len(result['long_tail']['queue'])} requests, batch "
              f"{LONG_BATCH_SIZE})": (result["long_tail"]["drivers"],
                                      result["long_tail"].get("generate_batch"))}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"static": "tab:red", "continuous": "tab:green", "generate_batch": "tab:gray"}
    for q, (label, (drivers, gb)) in enumerate(queues.items()):
        bars = {"static": drivers["static"], "continuous": drivers["continuous"]}
        if gb:
            bars["generate_batch"] = gb["generate_batch"]
        for i, (name, r) in enumerate(bars.items()):
            x = q * 4 + i
            left.bar(x, r["median"], color=colours[name], label=name if q == 1 else None,
                     yerr=[[r["median"] - r["min"]], [r["max"] - r["median"]]], capsize=3)
        for i, name in enumerate(("static", "continuous")):
            x = q * 3 + i
            right.bar(x, drivers[name]["decode_steps"], color=colours[name])
            bound = (drivers["static_decode_steps_bound"] if name == "static"
                     else drivers["ideal_decode_steps"])
            right.plot([x - 0.4, x + 0.4], [bound, bound], "k--")
    left.set_xticks([1, 5], list(queues))
    left.set(ylabel="seconds (median, min-max)", title="Wall time, every request to its max_tokens")
    left.legend()
    right.set_xticks([0.5, 3.5], list(queues))
    right.set(ylabel="decode steps", title="Decode steps (dashed: the bound of each schedule)")
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def markdown(result):
    lines = [
        "# Batching benchmark (lessons 02-03)", "",
        f"Model: `{result['model']}`; {facts_line(result)}; {result['reps']} repetitions "
        "(median, min-max).", "",
    ]
    lines += course_queue_markdown(result)
    if "long_tail" in result:
        lines += long_tail_markdown(result["long_tail"])
    return "\n".join(lines + ["", "Targets: " + verdicts(result["targets_met"]), ""])


def driver_rows(run, first_cells=(), columns=("decode_steps", "bound", "prefill_steps",
                                              "slot_utilization")):
    """One table row for static and one for continuous batching of one run of the drivers."""
    rows = []
    for name in ("static", "continuous"):
        r = dict(run[name], bound=run["ideal_decode_steps"] if name == "continuous"
                 else run["static_decode_steps_bound"])
        rows.append([*first_cells, name, f"{r['median']:.3f}", min_max(r)]
                    + [f"{r[c]:.0%}" if c == "slot_utilization" else r[c] for c in columns])
    return rows


def course_queue_markdown(result):
    q, e, g = result["course_queue"], result["course_queue_with_eos"], result["generate"]
    rows = [row for label, run in (("as asked", q), ("with EOS", e))
            for row in driver_rows(run, [f"{label} ({run['tokens']} tokens)"])]
    lines = markdown_table(["queue", "driver", "seconds (median)", "min-max", "decode steps",
                            "ideal", "prefills", "slots busy"], rows)
    lines += [
        "",
        f"- continuous vs static, as asked: **{q['speedup']:.2f}x** faster "
        f"(per repetition {min(q['speedup_per_run']):.2f}-{max(q['speedup_per_run']):.2f}; "
        f"target >= {TARGETS['speedup']}x); with EOS: {e['speedup']:.2f}x.",
        f"- decode steps / ideal bound: **{q['steps_over_ideal']:.3f}** as asked, "
        f"{e['steps_over_ideal']:.3f} with EOS (target <= {TARGETS['steps_over_ideal']}).",
        f"- our batched generation vs `model.generate` ({g['batch']} prompts x {g['new_tokens']} "
        f"tokens): {g['ours']['median']:.3f} s vs {g['generate']['median']:.3f} s = "
        f"**{g['ours_over_generate']:.2f}x** (target <= {TARGETS['ours_over_generate']}x); "
        f"same tokens: {g['same_tokens']}.",
    ]
    if "generate_batch" in result:
        b = result["generate_batch"]
        lines.append(
            f"- transformers `generate_batch` (its continuous batching, with EOS, set-up "
            f"included): {b['generate_batch']['median']:.3f} s; ours: "
            f"{b['ours_continuous']['median']:.3f} s = **{b['ours_over_generate_batch']:.2f}x** "
            f"its time; same answers: {b['same_answers']}.")
    return lines


def long_tail_markdown(lt):
    d, gb = lt["drivers"], lt.get("generate_batch")
    counts = [r["max_tokens"] for r in lt["queue"]]
    rows = driver_rows(d, columns=("decode_steps", "bound", "slot_utilization"))
    if gb:
        g = gb["generate_batch"]
        rows.append(["transformers `generate_batch`", f"{g['median']:.3f}", min_max(g), "", "", ""])
    lines = [
        "", f"## {len(counts)} requests, long-tailed lengths, batch size {d['batch_size']}",
        "", f"max_tokens drawn from a Pareto law (seeded): median "
        f"{statistics.median(counts):.0f}, mean {statistics.mean(counts):.1f}, max "
        f"{max(counts)}; {d['tokens']} tokens in all, every request to its max_tokens "
        "(EOS is an ordinary token).", "",
        *markdown_table(["driver", "seconds (median)", "min-max", "decode steps", "bound",
                         "slots busy"], rows),
        "", f"- continuous vs static: **{d['speedup']:.2f}x** faster (per repetition "
        f"{min(d['speedup_per_run']):.2f}-{max(d['speedup_per_run']):.2f}); decode "
        f"steps / ideal bound **{d['steps_over_ideal']:.3f}**; same answers: "
        f"{d['same_answers']}."]
    if gb:
        lines.append(f"- ours vs transformers `generate_batch` (set-up included): "
                     f"**{gb['ours_over_generate_batch']:.2f}x** its time; same answers: "
                     f"{gb['same_answers']}.")
    return lines + ["", "![Batching](batching.png)"]


def main(argv=None):
    parser = arguments(__doc__, "2 repetitions instead of 5")
    parser.add_argument("--reps", type=positive_int, help="repetitions (after a warm-up)")
    parser.add_argument("--model", default=None, help="model name or folder (default: bundled)")
    args = parser.parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)
    out = begin(args)
    model, tokenizer = load_model(args.model, device="cpu")
    queue = course_queue()
    result = {
        "model": args.model or "bundled", "reps": reps, **run_facts(), "batch_size": BATCH_SIZE,
        "queue": [{"prompt": p, "max_tokens": m} for p, m in queue],
    }
    print(f"course queue, as asked (x{reps}) ...", flush=True)
    result["course_queue"] = run_drivers(model, tokenizer, queue, reps, stop_at_eos=False)
    print(f"course queue, with EOS (x{reps}) ...", flush=True)
    result["course_queue_with_eos"] = run_drivers(model, tokenizer, queue, reps, stop_at_eos=True)
    print(f"batched generation vs model.generate (x{reps}) ...", flush=True)
    result["generate"] = run_generate(model, tokenizer, reps, new_tokens=100)
    if int(transformers.__version__.split(".")[0]) >= 5:
        print(f"transformers generate_batch (x{reps}) ...", flush=True)
        result["generate_batch"] = run_generate_batch(model, tokenizer, queue, reps)
    long_queue = long_tailed_queue()
    result["long_tail"] = {"queue": [{"prompt": p, "max_tokens": m} for p, m in long_queue]}
    print(f"{len(long_queue)} long-tailed requests, static vs continuous (x{reps}) ...", flush=True)
    result["long_tail"]["drivers"] = run_drivers(model, tokenizer, long_queue, reps,
                                                 stop_at_eos=False, batch_size=LONG_BATCH_SIZE)
    if "generate_batch" in result:
        print(f"{len(long_queue)} long-tailed requests, generate_batch (x{reps}) ...", flush=True)
        result["long_tail"]["generate_batch"] = run_generate_batch(
            model, tokenizer, long_queue, reps, stop_at_eos=False, batch_size=LONG_BATCH_SIZE)
    result["targets_met"] = targets_met(result)
    plot(result, out / "batching.png")
    write_results(args.out, "bench_batching", result, markdown(result))
    return 0 if all(result["targets_met"].values()) else 1


def targets_met(result) -> dict[str, bool]:
    q, g = result["course_queue"], result["generate"]
    return {
        f"continuous >= {TARGETS['speedup']}x static": q["speedup"] >= TARGETS["speedup"],
        f"decode steps within {TARGETS['steps_over_ideal'] - 1:.0%} of ideal":
            q["steps_over_ideal"] <= TARGETS["steps_over_ideal"],
        f"ours <= {TARGETS['ours_over_generate']}x model.generate":
            g["ours_over_generate"] <= TARGETS["ours_over_generate"],
        "same answers everywhere": q["same_answers"] and result["course_queue_with_eos"]["same_answers"]
        and g["same_tokens"] and result.get("generate_batch", {}).get("same_answers", True)
        and result["long_tail"]["drivers"]["same_answers"]
        and result["long_tail"].get("generate_batch", {}).get("same_answers", True),
    }


if __name__ == "__main__":
    sys.exit(main())
