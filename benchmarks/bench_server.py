"""Benchmark of lesson 07: the server under concurrent streaming clients.

    python -m benchmarks.bench_server            # about two minutes on a 2-core CPU
    python -m benchmarks.bench_server --quick    # < 1 minute

The server runs with its default flags (one torch thread) in its own process
(``serve_in_background``), started once; this process is the clients (httpx, one connection
each). Every request is a course prompt with ``max_new_tokens`` new tokens and EOS ignored,
greedy. In turns, after a warm-up:

1. 16 requests one after another (the "idle" TTFT), the same 16 at once (TTFT "under load"),
   and the same 16 through lesson 03's decode loop on batch 1 in this process (no server, no
   HTTP); each ratio is the median of the ratios within a turn. Single-token probes sent while
   the 16 stream give the TTFT of a request that joins a busy batch.
2. a sweep over 1, 4, 16 and 64 clients: tokens/s, TTFT and inter-token gaps p50/p95 (median
   over the repetitions, min-max beside it).
3. side by side with ``transformers serve --continuous-batching`` (``transformers_serve.py``)
   at 1, 16 and 64 clients, on OpenAI's streaming ``/v1/completions`` of both.

Targets (``targets.SERVER``): concurrent >= 4x one-after-another; one client >= 70% of the bare
loop; >= 1.5x transformers serve at 16 clients; checks: the same texts everywhere, every sweep
request answered in full. Writes ``bench_server.json``, ``.md`` and ``server.png``; exits with
status 1 when a target or a check is missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import statistics
import sys
import time

import httpx

from benchmarks.results_io import (arguments, begin, load_average, positive_int, run_facts,
                                   write_results)
from benchmarks.serving import (at_once, figures, jobs, levels_argument, metrics, percentile,
                                stream)
from benchmarks.timing import Candidate, spread, time_in_turns
from benchmarks.server_report import markdown, plot, targets_met
from benchmarks.transformers_serve import TransformersServe, against_transformers
from helpers.batching import Trace, generate_sequential, model_context
from helpers.server import serve_in_background

SWEEP_LEVELS = (1, 4, 16, 64)
COMPARE_LEVELS = (1, 16, 64)
QUICK = {"levels": [1, 16], "compare_levels": [1, 16], "new_tokens": 32, "probes": 3}


def summary(values):
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "min": min(values),
            "max": max(values), "n": len(values)}


async def one_after_another(url, jobs):
    """The jobs one after another, each alone on the server: the results and the wall time."""
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        results = [await stream(client, url, prompt, n) for prompt, n in jobs]
        return results, time.perf_counter() - start


def steps_between(before, after):
    return {kind: int(after.get(f"steps_{kind}", 0) - before.get(f"steps_{kind}", 0))
            for kind in ("decode", "prefill")}


# --- the sweep over concurrency ------------------------------------------------------------

def sweep_run(url, clients, new_tokens):
    """``clients`` requests at once: the figures of one repetition of one level."""
    before = metrics(url)
    results, seconds, _ = at_once(url, jobs(clients, new_tokens), tolerate_errors=True)
    steps = steps_between(before, metrics(url))
    answered = [r for r in results if isinstance(r, dict)]
    errors = [f"{type(r).__name__}: {r}" for r in results if not isinstance(r, dict)]
    errors += [f"{r['tokens']} tokens instead of {new_tokens}" for r in answered
               if r["tokens"] != new_tokens]
    return {**figures(answered, seconds), "steps_decode": steps["decode"],
            "steps_prefill": steps["prefill"], "errors": errors}


def sweep(url, levels, new_tokens, reps):
    """Every level once per repetition (the levels take turns), after one warm-up run of the
    largest level. Returns one entry per level: each figure's median and spread."""
    print(f"sweep: warm-up with {max(levels)} clients ...", flush=True)
    sweep_run(url, max(levels), new_tokens)
    runs = {n: [] for n in levels}

    def level(n):
        def run():
            runs[n].append(sweep_run(url, n, new_tokens))
            return runs[n][-1]
        return Candidate(run, clock=lambda run: run["seconds"])

    time_in_turns({f"{n} concurrent client(s)": level(n) for n in levels}, repeats=reps,
                  warmup=0, progress="sweep")
    table = []
    for n in levels:
        entry = {"clients": n, "requests": n * reps,
                 "tokens": int(statistics.median(r["tokens"] for r in runs[n]))}
        for key, label in (("seconds", "wall_seconds"), ("tokens_per_second", None),
                           ("ttft_p50", "ttft_p50_seconds"), ("ttft_p95", "ttft_p95_seconds"),
                           ("itl_p50", "itl_p50_seconds"), ("itl_p95", "itl_p95_seconds"),
                           ("steps_decode", "server_decode_steps"),
                           ("steps_prefill", "server_prefill_steps")):
            entry[label or key] = spread(r[key] for r in runs[n])
        entry["errors"] = [e for r in runs[n] for e in r["errors"]]
        table.append(entry)
    return table


def bare_loop(model, tokenizer, jobs) -> list[tuple[str, str]]:
    """The jobs one after another through lesson 03's decode loop on batch 1
    (``generate_sequential``: ``init_batch``, then ``generate_next_token`` until the row is
    done), in this process: no server, no HTTP; EOS ignored as the requests ask. Returns each
    text twice: with the special tokens' text (an EOS in the middle) and without it (a server
    may leave it out)."""
    trace = Trace()
    texts = generate_sequential(model, tokenizer, jobs, stop_at_eos=False, trace=trace)
    return [(text, tokenizer.decode(ids, skip_special_tokens=True))
            for text, ids in zip(texts, trace.token_ids)]


def one_by_one_and_at_once(url, jobs, reps, probes, bare):
    """The 16-request runs: one after another, all at once (and, apart, all at once with
    single-token probes), and through the bare decode loop (``bare``: a function of the jobs
    that returns the texts), taking turns ``reps`` times. Returns what the clients saw."""
    seen = {"tokens": {"one_after_another": [], "concurrent": [], "bare_loop": []},
            "ttft_idle": [], "ttft_load": [], "probes": [], "texts": {}}

    def record(name, results):
        seen["tokens"][name].append(sum(r["tokens"] for r in results))
        seen["texts"][name] = [r["text"] for r in results]
        return [r["ttft"] for r in results]

    def sequential():
        results, seconds = asyncio.run(one_after_another(url, jobs))
        seen["ttft_idle"] += record("one_after_another", results)
        return seconds

    def concurrent():
        seen["before"] = metrics(url)
        results, seconds, _ = at_once(url, jobs)
        seen["after"] = metrics(url)
        seen["ttft_load"] += record("concurrent", results)
        if probes:  # a separate concurrent run with probes, not counted in the tokens/s
            seen["probes"] += at_once(url, jobs, probes=probes)[2]
        return seconds

    def bare_run():
        seen["texts"]["bare_loop"] = bare(jobs)
        seen["tokens"]["bare_loop"].append(sum(n for _, n in jobs))

    # In each turn the one-after-another run sits between the two runs it is compared with,
    # and each ratio is taken within a turn (see summarise): this machine's speed drifts
    # over seconds, and a drift then moves both sides of a ratio alike.
    seen["timings"] = time_in_turns(
        {"bare_loop": bare_run, "one_after_another": Candidate(sequential, clock=float),
         "concurrent": Candidate(concurrent, clock=float)},
        repeats=reps, warmup=0, progress=f"{len(jobs)} requests,")
    return seen


def rates(seen, name) -> list[float]:
    """Tokens/s of each repetition of one way of sending the requests."""
    return [tokens / s for tokens, s in zip(seen["tokens"][name], seen["timings"].seconds[name])]


def tokens_per_second(seen, name):
    """The figures of one way of sending the requests: median seconds and tokens/s."""
    return {"seconds": seen["timings"].median(name), "tokens": seen["tokens"][name][0],
            "tokens_per_second": statistics.median(rates(seen, name)),
            "runs_tokens_per_second": [round(r, 1) for r in rates(seen, name)]}


def parse_args(argv=None):
    parser = arguments(__doc__, "1 repetition of each part instead of 5, levels 1 and 16, "
                                f"{QUICK['new_tokens']} new tokens, {QUICK['probes']} probes")
    parser.add_argument("--reps", type=positive_int,
                        help="repetitions of the 16-request runs and of the side-by-side run")
    parser.add_argument("--clients", type=positive_int, default=16,
                        help="concurrent requests (16)")
    parser.add_argument("--new-tokens", type=positive_int, help="new tokens per request (64)")
    parser.add_argument("--levels", type=levels_argument, default=None,
                        help="concurrent clients of the sweep, comma-separated (1,4,16,64)")
    parser.add_argument("--compare-levels", type=levels_argument, default=None,
                        help="clients of the side-by-side run with transformers serve (1,16,64)")
    parser.add_argument("--sweep-reps", type=positive_int,
                        help="repetitions of the sweep (after a warm-up)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="server slots (default: the server's own default)")
    parser.add_argument("--engine", choices=("process", "thread"), default=None,
                        help="where our server runs its model (default: the server's default)")
    parser.add_argument("--probes", type=int,
                        help="single-token probes per concurrent run (10)")
    parser.add_argument("--model", default=None, help="model name or folder (default: bundled)")
    parser.add_argument("--device", default="cpu", help="server device (default cpu)")
    args = parser.parse_args(argv)
    full = {"levels": list(SWEEP_LEVELS), "compare_levels": list(COMPARE_LEVELS),
            "new_tokens": 64, "probes": 10}
    for key, value in (QUICK if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # Five: each turn is short (a second or less), so a slow moment of this shared machine
    # moves one turn's figure by 20 % or more; the median of five keeps one such turn out.
    args.reps = args.reps or (1 if args.quick else 5)
    args.sweep_reps = args.sweep_reps or (1 if args.quick else 5)
    return args


def main(argv=None):
    args = parse_args(argv)
    from helpers.models import load_model, resolve_model_name

    started = time.perf_counter()
    out = begin(args)
    result = {"model": args.model or "bundled", "device": args.device, "reps": args.reps,
              "clients": args.clients, "new_tokens": args.new_tokens, "quick": args.quick,
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              **run_facts()}
    model, tokenizer = load_model(args.model, device=args.device)
    work = jobs(args.clients, args.new_tokens)
    print("starting the servers ...", flush=True)
    options = {"max_batch_size": args.max_batch_size, "engine": args.engine}
    ours = serve_in_background(args.model, name="bench-server", threads=args.threads,
                               device=args.device, wait=False, **options)
    # Their server starts now, while ours does (each takes seconds to import and load), and
    # stays idle until the side-by-side part. (If it cannot start, against_transformers says why.)
    theirs = TransformersServe(resolve_model_name(args.model), args.threads,
                               max(args.compare_levels), model_context(model) or 2048,
                               device=args.device)
    with contextlib.suppress(RuntimeError, OSError):
        theirs.start()
    with ours as url, contextlib.ExitStack() as stack:
        stack.callback(theirs.__exit__)       # stopped even if our part fails
        with contextlib.suppress(RuntimeError, OSError):
            theirs.wait()                     # loaded and idle before anything is timed
        info = httpx.get(url + "/info", timeout=10).json()
        result["max_batch_size"], result["engine"] = info["max_batch_size"], info["engine"]
        asyncio.run(one_after_another(url, work[:2]))        # warm-up
        bare_loop(model, tokenizer, work[:2])
        seen = one_by_one_and_at_once(url, work, args.reps, args.probes,
                                      lambda js: bare_loop(model, tokenizer, js))
        sweep_table = sweep(url, args.levels, args.new_tokens, args.sweep_reps)
        rows_max = int(metrics(url).get("rows_max", 0))
        compared = against_transformers(url, theirs, args.compare_levels, args.new_tokens,
                                        args.reps)
    result.update(summarise(seen), sweep={"new_tokens": args.new_tokens,
                                          "reps": args.sweep_reps, "rows_max": rows_max,
                                          "levels": sweep_table},
                  transformers_serve=compared)
    result["targets_met"] = targets_met(result)
    result["load_average_after"] = load_average()
    result["benchmark_seconds"] = time.perf_counter() - started

    plot(result, out / "server.png")
    write_results(out, "bench_server", result, markdown(result))
    print(f"plot: {out / 'server.png'}; {result['benchmark_seconds']:.0f} s in all")
    return 0 if all(result["targets_met"].values()) else 1


def summarise(seen) -> dict:
    """The figures of the 16-request runs, for the result."""
    seq = tokens_per_second(seen, "one_after_another")
    con = tokens_per_second(seen, "concurrent")
    bare = tokens_per_second(seen, "bare_loop")
    probes = seen["probes"]
    texts = seen["texts"]
    # Each ratio: the median of the ratios within each turn (the two runs of a ratio are
    # back to back there), not the ratio of medians taken from different moments.
    speedups = [c / s for c, s in zip(rates(seen, "concurrent"), rates(seen, "one_after_another"))]
    singles = [s / b for s, b in zip(rates(seen, "one_after_another"), rates(seen, "bare_loop"))]
    return {
        "one_after_another": seq, "concurrent": con, "bare_loop": bare,
        "speedup": statistics.median(speedups),
        "speedup_per_run": [round(x, 2) for x in speedups],
        "single_client": {"server_over_bare_loop": statistics.median(singles),
                          "per_run": [round(x, 3) for x in singles]},
        "ttft_seconds": {"idle": summary(seen["ttft_idle"]),
                         "under_load": summary(seen["ttft_load"]),
                         "probe_under_load": summary(probes) if probes else
                         {"p50": float("nan"), "p95": float("nan"), "n": 0}},
        "server_steps": {**steps_between(seen["before"], seen["after"]),
                         "rows_max": int(seen["after"].get("rows_max", 0))},
        "same_texts": texts["one_after_another"] == texts["concurrent"] and all(
            text in both for text, both in zip(texts["concurrent"], texts["bare_loop"])),
    }


if __name__ == "__main__":
    sys.exit(main())
