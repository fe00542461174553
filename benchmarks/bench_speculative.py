"""Benchmark of lesson 09: speculative decoding, greedy, batch 1, on the bundled model.

    python -m benchmarks.bench_speculative            # a few minutes on a laptop CPU
    python -m benchmarks.bench_speculative --quick    # fewer prompts and repetitions (< 1 min)

1. The copy task (the answer repeats a nursery rhyme from the prompt): prompt lookup (k = 8)
   against plain greedy decoding, same text.
2. Story continuation (48 new tokens): the draft model against plain greedy for k = 1, 2, 4,
   with its acceptance and the cost model's break-even (lesson 09, section 5).
3. Ours against transformers on the same prompts and k: ``prompt_lookup_num_tokens`` on the
   copy task, ``assistant_model`` on the stories.

Targets (``targets.SPECULATIVE``): lookup >= 1.5x plain; ours >= transformers in both. Writes
``bench_speculative.json``, ``.md`` and ``speculative.png``; exits with status 1 when a target
or a same-text check is missed.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import (arguments, begin, facts_line, markdown_table, run_facts,
                                   verdicts, write_results)
from benchmarks.targets import SPECULATIVE as TARGETS
from benchmarks.timing import time_in_turns
from helpers import generate_with_cache, load_model
from helpers.corpus import RHYMES, corpus
from helpers.speculative import (DRAFT_MODEL_DIR, DraftModelProposer, PromptLookupProposer,
                                 speculative_generate, transformers_speculative)

LOOKUP_K, DRAFT_KS, HF_DRAFT_K = 8, (1, 2, 4), 2
COPY_TOKENS, STORY_TOKENS = 60, 48


def story_prompts(tokenizer, n: int) -> list[str]:
    """The first 12 tokens of ``n`` held-out stories (corpus seed 1; lesson 09 section 4)."""
    stories = [d for d in corpus(seed=1, n_docs=200) if d.startswith("Once upon")][:n]
    return [tokenizer.decode(tokenizer(d)["input_ids"][:12]) for d in stories]


def recite_prompts() -> list[str]:
    """Each rhyme followed by its first four words (lesson 09 section 6), but Mary's lamb,
    which the bundled model does not know by heart."""
    return [text + " " + " ".join(text.split()[:4])
            for name, (text, *_) in RHYMES.items() if name != "mary"]


def run_all(decode, prompts):
    """A candidate: every prompt through ``decode(prompt)``; returns the results. Under
    ``torch.inference_mode``, as ``speculative_generate`` runs, so that plain decoding is not
    slowed by ``no_grad``'s bookkeeping alone."""
    def run():
        with torch.inference_mode():
            return [decode(p) for p in prompts]
    return run


def tokens_of(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def speeds(timings, results_tokens: int) -> dict:
    """tokens/s of each candidate from the median time of a round."""
    return {name: results_tokens / timings.median(name) for name in timings.seconds}


def copy_task(model, tokenizer, prompts, reps):
    """Plain vs prompt lookup (ours and transformers') on the copy task, to end-of-text."""
    plain = lambda p: generate_with_cache(model, tokenizer, p, COPY_TOKENS)  # noqa: E731
    ours = lambda p: speculative_generate(model, tokenizer, p, PromptLookupProposer(),  # noqa: E731
                                          k=LOOKUP_K, max_new_tokens=COPY_TOKENS)
    theirs = lambda p: transformers_speculative(model, tokenizer, p, k=LOOKUP_K,  # noqa: E731
                                                max_new_tokens=COPY_TOKENS)
    timings = time_in_turns({"plain": run_all(plain, prompts), "lookup": run_all(ours, prompts),
                             "transformers lookup": run_all(theirs, prompts)}, repeats=reps)
    last = timings.last
    tokens = sum(len(ids) for ids in tokens_of(last["plain"]))
    tps = speeds(timings, tokens)
    return {"k": LOOKUP_K, "prompts": len(prompts), "tokens": tokens,
            "tokens_per_second": tps, "seconds": {n: timings.spread(n) for n in tps},
            "lookup_over_plain": tps["lookup"] / tps["plain"],
            "ours_over_transformers": tps["lookup"] / tps["transformers lookup"],
            "acceptance": _acceptance(last["lookup"]),
            "tokens_per_verify": _per_verify(last["lookup"]),
            "same_text": tokens_of(last["lookup"]) == tokens_of(last["plain"])
            == tokens_of(last["transformers lookup"])}


def _acceptance(results) -> float:
    return sum(r.accepted for r in results) / max(1, sum(r.proposed for r in results))


def _alpha(results) -> float:
    """Per-guess acceptance for the cost model: accepted / (accepted + rejections)."""
    accepted = sum(r.accepted for r in results)
    rejections = sum(a < p for r in results for p, a in r.steps)
    return accepted / max(1, accepted + rejections)


def _per_verify(results) -> float:
    return sum(r.tokens_per_verify * r.verify_steps for r in results) / sum(
        r.verify_steps for r in results)


def story_task(model, draft, tokenizer, prompts, reps):
    """Plain vs the draft at each k in DRAFT_KS vs transformers' assisted generation."""
    def ours(k):
        return lambda p: speculative_generate(model, tokenizer, p, DraftModelProposer(draft), k=k,
                                              max_new_tokens=STORY_TOKENS, stop_at_eos=False)
    candidates = {"plain": run_all(lambda p: generate_with_cache(
        model, tokenizer, p, STORY_TOKENS, stop_at_eos=False), prompts)}
    candidates |= {f"draft k={k}": run_all(ours(k), prompts) for k in DRAFT_KS}
    candidates["transformers assisted"] = run_all(lambda p: transformers_speculative(
        model, tokenizer, p, k=HF_DRAFT_K, draft=draft, max_new_tokens=STORY_TOKENS,
        stop_at_eos=False), prompts)
    timings = time_in_turns(candidates, repeats=reps)
    last = timings.last
    tokens = sum(len(ids) for ids in tokens_of(last["plain"]))
    tps = speeds(timings, tokens)
    by_k = [{"k": k, "tokens_per_second": tps[f"draft k={k}"],
             "over_plain": tps[f"draft k={k}"] / tps["plain"],
             "acceptance": _acceptance(last[f"draft k={k}"]), "alpha": _alpha(last[f"draft k={k}"]),
             "tokens_per_verify": _per_verify(last[f"draft k={k}"])} for k in DRAFT_KS]
    same = all(tokens_of(last[name]) == tokens_of(last["plain"]) for name in candidates)
    story = {"prompts": len(prompts), "tokens": tokens, "tokens_per_second": tps,
             "seconds": {n: timings.spread(n) for n in tps}, "by_k": by_k,
             "ours_over_transformers": tps[f"draft k={HF_DRAFT_K}"] / tps["transformers assisted"],
             "same_text": same}
    story["cost_model"] = cost_model(story, last)
    return story


def cost_model(story, last) -> dict:
    """Lesson 09 section 5 on the story runs: for each k, the cost model's speed-up over plain
    decoding and the draft/plain step-time ratio below which the draft pays, with t_draft and
    t_verify from what ``speculative_generate`` timed in the last round."""
    t_step = 1 / story["tokens_per_second"]["plain"]
    rows = []
    for row in story["by_k"]:
        k, alpha, runs = row["k"], row["alpha"], last[f"draft k={row['k']}"]
        passes = sum(r.verify_steps for r in runs)
        t_draft = sum(r.propose_seconds for r in runs) / (k * passes)
        t_verify = sum(r.verify_seconds for r in runs) / passes
        expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        rows.append({"k": k, "alpha": alpha, "expected_tokens_per_verify": expected,
                     "draft_over_step": t_draft / t_step, "verify_over_step": t_verify / t_step,
                     "predicted_over_plain": expected * t_step / (k * t_draft + t_verify),
                     "measured_over_plain": row["over_plain"],
                     "pays_below_step_ratio": (expected * t_step - t_verify) / (k * t_step)})
    return {"rows": rows}


def plot(result, path):
    """tokens/s of every candidate, copy task and stories."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
    for ax, (title, key) in zip(axes, (("copy task (the answer repeats the prompt), tokens/s", "copy"),
                                       ("story continuation, tokens/s", "story"))):
        tps = result[key]["tokens_per_second"]
        ax.bar(list(tps), list(tps.values()),
               color=["#999999"] + ["#0072B2"] * (len(tps) - 2) + ["#CC79A7"])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def markdown(result):
    c, s = result["copy"], result["story"]
    tps = lambda d, n: f"{d['tokens_per_second'][n]:.0f}"  # noqa: E731
    rows = [[f"copy task: prompt lookup k={c['k']} vs plain", f"{tps(c, 'plain')}", tps(c, "lookup"),
             f"**{c['lookup_over_plain']:.2f}x**", f">= {TARGETS['lookup']}x", c["same_text"]],
            [f"copy task: ours vs transformers prompt lookup, k={c['k']}",
             tps(c, "transformers lookup"), tps(c, "lookup"), f"**{c['ours_over_transformers']:.2f}x**",
             f">= {TARGETS['ours_vs_transformers']}x", c["same_text"]]]
    for row in s["by_k"]:
        rows.append([f"stories: draft k={row['k']} vs plain (acceptance {row['acceptance']:.0%})",
                     tps(s, "plain"), f"{row['tokens_per_second']:.0f}", f"{row['over_plain']:.2f}x",
                     "", s["same_text"]])
    rows.append([f"stories: ours vs transformers assisted generation, k={HF_DRAFT_K}",
                 tps(s, "transformers assisted"), tps(s, f"draft k={HF_DRAFT_K}"),
                 f"**{s['ours_over_transformers']:.2f}x**", f">= {TARGETS['ours_vs_transformers']}x",
                 s["same_text"]])
    model_rows = [[r["k"], f"{r['alpha']:.2f}", f"{r['expected_tokens_per_verify']:.2f}",
                   f"{r['draft_over_step']:.2f}", f"{r['verify_over_step']:.2f}",
                   f"{r['predicted_over_plain']:.2f}x", f"{r['measured_over_plain']:.2f}x",
                   f"{r['pays_below_step_ratio']:.2f}"] for r in s["cost_model"]["rows"]]
    lines = ["# Speculative decoding benchmark (lesson 09)", "",
             f"Model: bundled, draft: `helpers/assets/draft`; {facts_line(result)}; batch 1, "
             f"greedy, {result['reps']} repetitions (median).", "",
             *markdown_table(["figure", "baseline tokens/s", "ours tokens/s", "ratio", "target",
                              "same text"], rows, "lrrrrl"), "",
             "Cost model for the draft on the stories (lesson 09 section 5; times per plain "
             "decoding step, from the same runs):", "",
             *markdown_table(["k", "alpha", "E[tokens per verify]", "draft step", "verify pass",
                              "predicted vs plain", "measured", "pays if draft step <"],
                             model_rows, "rrrrrrrr")]
    return "\n".join(lines + ["", "![Speculative decoding](speculative.png)", "",
                              "Checks: " + verdicts(result["targets_met"]), ""])


def targets_met(result) -> dict[str, bool]:
    c, s = result["copy"], result["story"]
    return {f"prompt lookup >= {TARGETS['lookup']}x": c["lookup_over_plain"] >= TARGETS["lookup"],
            "ours >= transformers (lookup)": c["ours_over_transformers"] >= TARGETS["ours_vs_transformers"],
            "ours >= transformers (assisted)": s["ours_over_transformers"]
            >= TARGETS["ours_vs_transformers"],
            "same text everywhere": c["same_text"] and s["same_text"]}


def main(argv=None):
    args = arguments(__doc__, "4 story prompts, 2 repetitions").parse_args(argv)
    reps, n = (2, 4) if args.quick else (5, 8)
    out = begin(args)
    model, tokenizer = load_model(device="cpu")
    draft, _ = load_model(DRAFT_MODEL_DIR, device="cpu")
    result = {"reps": reps, **run_facts()}
    print(f"story continuation: plain, draft k={DRAFT_KS}, transformers (x{reps}) ...", flush=True)
    result["story"] = story_task(model, draft, tokenizer, story_prompts(tokenizer, n), reps)
    print(f"copy task: plain vs prompt lookup, ours and transformers' (x{reps}) ...", flush=True)
    result["copy"] = copy_task(model, tokenizer, recite_prompts(), reps)
    result["targets_met"] = targets_met(result)
    plot(result, out / "speculative.png")
    write_results(args.out, "bench_speculative", result, markdown(result))
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
