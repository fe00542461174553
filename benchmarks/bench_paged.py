"""Benchmark of lesson 08: the paged KV cache, prefix caching and chunked prefill.

    python -m benchmarks.bench_paged            # under a minute on a laptop CPU
    python -m benchmarks.bench_paged --quick    # fewer repetitions

1. Requests at once in one KV budget (what a padded cache reserves for 8 of the course
   queue's longest requests): padded 8, paged as many as ``generate_paged`` runs. Target >= 2x.
2. TTFT of a request whose 200-token prefix is cached, against a fresh cache. Target >= 3x.
3. The worst gap of three running streams while a long prompt arrives, whole against chunks.
4. Tokens/s of contiguous and paged continuous batching and of ``generate_batch`` on the
   course queue.

Same tokens everywhere. Writes ``bench_paged.json``, ``.md`` and ``paged.png``; exits with
status 1 only when a same-tokens check fails.
"""

from __future__ import annotations

import math
import statistics
import sys

import transformers

from benchmarks.bench_batching import course_queue
from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import (arguments, begin, facts_line, markdown_table, min_max,
                                   run_facts, verdicts, write_results)
from benchmarks.targets import PAGED as TARGETS
from benchmarks.timing import Candidate, time_in_turns, traced
from helpers import load_model
from helpers.batching import Trace, generate_continuous, transformers_generate_batch
from helpers.paged import PagedKVCache, generate_paged, worst_inter_token_gap

BATCH_SIZE = 8
BLOCK = 16
CHUNK = 32
# About 200 tokens of shared instructions in front of each request (the context is 256).
PREFIX = ("Once upon a time a little fox lived by the river. Every morning the fox ran to the "
          "hill, and every evening it came home to sleep. ") * 6 + (
          "The river was cold and the hill was green, and the fox was happy there. ")


def concurrency(model, tokenizer, queue, contiguous_tokens):
    """Lesson 08 section 4: requests at once in the KV budget of 8 of the longest requests."""
    prompt_lengths = [len(ids) for ids in tokenizer([p for p, _ in queue])["input_ids"]]
    longest = max(n + m for n, (_, m) in zip(prompt_lengths, queue))
    budget_blocks = BATCH_SIZE * math.ceil(longest / BLOCK)
    padded = budget_blocks * BLOCK // longest
    pool = PagedKVCache(model, num_blocks=budget_blocks, block_size=BLOCK)
    trace = Trace()
    generate_paged(model, tokenizer, queue, batch_size=32, stop_at_eos=False, cache=pool,
                   trace=trace, progress=False)
    paged = max(sum(rid is not None for rid in step.slots) for step in trace.steps)
    return {"budget_blocks": budget_blocks, "block_size": BLOCK, "longest_tokens": longest,
            "padded": padded, "paged": paged, "ratio": paged / padded,
            "same_tokens": trace.token_ids == contiguous_tokens}


def prefix_ttft(model, tokenizer, reps):
    """The prefill of a second request whose prefix the first left cached, against a fresh
    cache (prefix caching off), taking turns."""
    first, second = (PREFIX + "The rain in Spain falls", 1), (PREFIX + "Jack and Jill", 2)
    caches = {}

    def prepare(name, caching):
        def fill():
            caches[name] = PagedKVCache(model, num_blocks=64, block_size=BLOCK,
                                        prefix_caching=caching)
            generate_paged(model, tokenizer, [first], batch_size=1, cache=caches[name],
                           stop_at_eos=False, progress=False)
        return fill

    def second_request(name):
        trace = Trace()
        generate_paged(model, tokenizer, [second], batch_size=1, cache=caches[name],
                       stop_at_eos=False, trace=trace, progress=False)
        return trace

    prefill = lambda trace: sum(s.seconds for s in trace.steps if s.kind == "prefill")  # noqa: E731
    timings = time_in_turns({
        name: Candidate(lambda name=name: second_request(name), prepare=prepare(name, caching),
                        clock=prefill)
        for name, caching in (("fresh", False), ("cached", True))}, repeats=reps)
    return {"prefix_tokens": len(tokenizer(PREFIX)["input_ids"]),
            "prompt_tokens": len(tokenizer(second[0])["input_ids"]),
            "cached_tokens": caches["cached"].cached_tokens,
            "fresh": timings.spread("fresh"), "cached": timings.spread("cached"),
            "ratio": timings.median("fresh") / timings.median("cached"),
            "same_tokens": timings.last["fresh"].token_ids == timings.last["cached"].token_ids}


def worst_gap(trace, streams=3) -> float:
    """The longest wait between two tokens of the first ``streams`` requests (lesson 08's
    ``worst_inter_token_gap``, on the trace's own step times)."""
    return worst_inter_token_gap(trace, range(streams))


def chunked_prefill(model, tokenizer, reps):
    """Lesson 08 section 6: three streams of 40 tokens; a short request ends and frees its
    slot for a long prompt, read whole or in chunks of ``CHUNK`` tokens."""
    arrivals = [(p, 40) for p in ("The quick brown fox jumped over the",
                                  "The rain in Spain falls", "What comes up must")]
    arrivals += [("Jack and Jill", 3), (PREFIX + "Jack and Jill", 5)]

    def run(max_prefill_tokens):
        trace = Trace()
        generate_paged(model, tokenizer, arrivals, batch_size=4, stop_at_eos=False,
                       trace=trace, max_prefill_tokens=max_prefill_tokens, progress=False)
        return trace

    timings = time_in_turns({
        "whole": Candidate(lambda: run(None), clock=worst_gap),
        "chunked": Candidate(lambda: run(CHUNK), clock=worst_gap)}, repeats=reps)
    whole, chunked = timings.last["whole"], timings.last["chunked"]
    return {"chunk": CHUNK, "long_prompt_tokens": len(tokenizer(arrivals[-1][0])["input_ids"]),
            "whole": timings.spread("whole"), "chunked": timings.spread("chunked"),
            "ratio": timings.median("whole") / timings.median("chunked"),
            "prefill_passes": {"whole": whole.prefill_steps, "chunked": chunked.prefill_steps},
            "same_tokens": whole.token_ids == chunked.token_ids}


def throughput(model, tokenizer, queue, reps):
    """Contiguous vs paged continuous batching vs transformers' ``generate_batch``, taking
    turns, every request to its max_tokens."""
    def theirs():
        return transformers_generate_batch(model, tokenizer, queue, batch_size=BATCH_SIZE,
                                           stop_at_eos=False)

    kwargs = dict(batch_size=BATCH_SIZE, progress=False, stop_at_eos=False)
    candidates = {"contiguous": traced(generate_continuous, model, tokenizer, queue, **kwargs),
                  "paged": traced(generate_paged, model, tokenizer, queue, block_size=BLOCK,
                                  **kwargs)}
    if int(transformers.__version__.split(".")[0]) >= 5:
        candidates["generate_batch"] = theirs
    timings = time_in_turns(candidates, repeats=reps)
    traces = {name: timings.last[name][1] for name in ("contiguous", "paged")}
    tokens = sum(len(ids) for ids in traces["contiguous"].token_ids)
    result = {"tokens": tokens, "batch_size": BATCH_SIZE,
              "paged_over_contiguous": timings.median("paged") / timings.median("contiguous"),
              "same_tokens": traces["paged"].token_ids == traces["contiguous"].token_ids}
    for name in candidates:
        result[name] = dict(timings.spread(name),
                            tokens_per_second=tokens / timings.median(name))
    for name, trace in traces.items():
        result[name]["decode_seconds_per_step"] = statistics.median(
            s.seconds for s in trace.steps if s.kind == "decode")
    if "generate_batch" in candidates:
        result["generate_batch_same_answers"] = (timings.last["generate_batch"]
                                                 == timings.last["contiguous"][0])
    return result, traces["contiguous"].token_ids


def plot(result, path):
    """One bar pair per figure: requests at once, TTFT, worst gap, tokens/s."""
    plt = pyplot()
    c, p, g, t = (result[k] for k in ("concurrency", "prefix", "chunked", "throughput"))
    panels = [("requests at once in one KV budget", {"padded": c["padded"], "paged": c["paged"]}),
              (f"TTFT, {p['prefix_tokens']}-token prefix (ms)", {"fresh": p["fresh"]["median"] * 1e3,
                                               "cached": p["cached"]["median"] * 1e3}),
              ("worst inter-token gap (ms)", {"whole": g["whole"]["median"] * 1e3,
                                              f"chunks of {CHUNK}": g["chunked"]["median"] * 1e3}),
              ("course queue, tokens/s", {name: t[name]["tokens_per_second"] for name in
                                          ("contiguous", "paged", "generate_batch") if name in t})]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for ax, (title, bars) in zip(axes, panels):
        ax.bar(list(bars), list(bars.values()), color=["#999999", "#0072B2", "#009E73"][:len(bars)])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def markdown(result):
    c, p, g, t = (result[k] for k in ("concurrency", "prefix", "chunked", "throughput"))
    ms = lambda f: f"{f['median'] * 1e3:.1f}"  # noqa: E731
    rows = [["requests at once in one KV budget", f"padded {c['padded']}", f"paged {c['paged']}",
             f"**{c['ratio']:.2f}x**", f">= {TARGETS['concurrency']}x", c["same_tokens"]],
            [f"TTFT (ms), {p['prefix_tokens']}-token prefix", f"fresh {ms(p['fresh'])}",
             f"cached {ms(p['cached'])}", f"**{p['ratio']:.2f}x**", f">= {TARGETS['ttft']}x",
             p["same_tokens"]],
            ["worst inter-token gap (ms)", f"whole {ms(g['whole'])}",
             f"chunks of {g['chunk']} {ms(g['chunked'])}", f"{g['ratio']:.2f}x", "",
             g["same_tokens"]],
            ["course queue, tokens/s", f"contiguous {t['contiguous']['tokens_per_second']:.0f}",
             f"paged {t['paged']['tokens_per_second']:.0f}",
             f"{1 / t['paged_over_contiguous']:.2f}x", "", t["same_tokens"]]]
    step = {n: t[n]["decode_seconds_per_step"] * 1e3 for n in ("contiguous", "paged")}
    lines = ["# Paged KV cache benchmark (lesson 08)", "",
             f"Model: `{result['model']}`; {facts_line(result)}; {result['reps']} "
             "repetitions (median).", "",
             *markdown_table(["figure", "baseline", "lesson 08", "ratio", "target", "same tokens"],
                             rows, "lrrrrl"), "",
             f"- KV budget: {c['budget_blocks']} blocks of {c['block_size']} tokens (8 x the "
             f"longest request, {c['longest_tokens']} tokens); spreads: TTFT fresh "
             f"{min_max(p['fresh'], 1e3, 1)}, cached {min_max(p['cached'], 1e3, 1)} ms.",
             f"- the gather's cost: a decode step takes {step['paged']:.1f} ms on the paged cache, "
             f"{step['contiguous']:.1f} ms on the contiguous one (median); the whole queue "
             f"({t['tokens']} tokens) takes **{t['paged_over_contiguous']:.2f}x** the time."]
    if "generate_batch" in t:
        lines.append(f"- transformers `generate_batch` (set-up included): "
                     f"{t['generate_batch']['tokens_per_second']:.0f} tokens/s; same answers: "
                     f"{t['generate_batch_same_answers']}.")
    return "\n".join(lines + ["", "![Paged KV cache](paged.png)", "",
                              "Checks: " + verdicts(result["targets_met"]), ""])


def main(argv=None):
    parser = arguments(__doc__, "2 repetitions instead of 5")
    parser.add_argument("--model", default=None, help="model name or folder (default: bundled)")
    args = parser.parse_args(argv)
    reps = 2 if args.quick else 5
    out = begin(args)
    model, tokenizer = load_model(args.model, device="cpu")
    queue = course_queue()
    result = {"model": args.model or "bundled", "reps": reps, **run_facts()}
    print(f"throughput on the course queue (x{reps}) ...", flush=True)
    result["throughput"], contiguous_tokens = throughput(model, tokenizer, queue, reps)
    print("requests at once in one KV budget ...", flush=True)
    result["concurrency"] = concurrency(model, tokenizer, queue, contiguous_tokens)
    print(f"TTFT with a cached prefix (x{reps}) ...", flush=True)
    result["prefix"] = prefix_ttft(model, tokenizer, reps)
    print(f"chunked prefill (x{reps}) ...", flush=True)
    result["chunked"] = chunked_prefill(model, tokenizer, reps)
    result["targets_met"] = targets_met(result)
    plot(result, out / "paged.png")
    write_results(args.out, "bench_paged", result, markdown(result))
    return 0 if result["targets_met"]["same tokens everywhere"] else 1


def targets_met(result) -> dict[str, bool]:
    t = result["throughput"]
    return {
        f"concurrency >= {TARGETS['concurrency']}x": result["concurrency"]["ratio"]
        >= TARGETS["concurrency"],
        f"cached-prefix TTFT >= {TARGETS['ttft']}x": result["prefix"]["ratio"] >= TARGETS["ttft"],
        "same tokens everywhere": all(result[k]["same_tokens"] for k in
                                      ("concurrency", "prefix", "chunked", "throughput"))
        and t.get("generate_batch_same_answers", True),
    }


if __name__ == "__main__":
    sys.exit(main())
