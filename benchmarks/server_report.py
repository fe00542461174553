"""The server benchmark's targets and its report (``bench_server.py`` measures): the checks, the
markdown tables and ``server.png``."""

from __future__ import annotations

from benchmarks.plots import clients_axis, pyplot, save_figure, spread_bars
from benchmarks.results_io import markdown_table, numbers, verdicts
from benchmarks.targets import SERVER as TARGETS
from benchmarks.transformers_serve import side_by_side_markdown

#: The number of clients at which ours is held to TARGETS["transformers"].
COMPARE_TARGET_CLIENTS = 16
#: How the markdown says where the server ran its model (/info's "engine").
ENGINE_WORDS = {"process": "a process of its own", "thread": "a thread of the HTTP process"}


def compared_at(result, clients):
    """The side-by-side row for ``clients``, or None (not measured, or their server failed)."""
    rows = result["transformers_serve"].get("levels", [])
    return next((row for row in rows if row["clients"] == clients), None)


def targets_met(result) -> dict:
    single = result["single_client"]["server_over_bare_loop"]
    at_target = compared_at(result, COMPARE_TARGET_CLIENTS)
    return {
        f"concurrent >= {TARGETS['speedup']}x tokens/s": result["speedup"] >= TARGETS["speedup"],
        f"one client >= {TARGETS['single_client']:.0%} of the bare decode loop":
            single >= TARGETS["single_client"],
        f">= {TARGETS['transformers']}x transformers serve at {COMPARE_TARGET_CLIENTS} clients":
            at_target is not None and at_target["ours_over_theirs"] >= TARGETS["transformers"],
        "same texts": result["same_texts"],
        "same texts as transformers serve": bool(result["transformers_serve"].get("levels")) and
            all(row["same_texts"] for row in result["transformers_serve"]["levels"]),
        "sweep requests all answered in full":
            not any(row["errors"] for row in result["sweep"]["levels"]),
    }


def plot(result, path):
    """Two panels: tokens/s versus clients, and TTFT p50/p95 versus clients (median over the
    repetitions, bars from min to max)."""
    table = result["sweep"]["levels"]
    clients = [row["clients"] for row in table]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4.4))
    rate = spread_bars(left, clients, [row["tokens_per_second"] for row in table],
                       color="tab:blue")
    for x, y in zip(clients, rate):
        left.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(7, -12),
                      ha="left", fontsize=9)
    left.set_title("Throughput versus clients")
    left.set_ylabel("generated tokens per second (all clients)")
    left.set_ylim(bottom=0, top=max(rate) * 1.2)
    for name, key, colour in (("p50", "ttft_p50_seconds", "tab:green"),
                              ("p95", "ttft_p95_seconds", "tab:red")):
        spread_bars(right, clients, [row[key] for row in table], 1e3, color=colour,
                    label=f"TTFT {name}")
    right.set_title("Time to first token (TTFT) versus clients")
    right.set_ylabel("time to first token (ms)")
    right.set_ylim(bottom=0)
    right.legend()
    for ax in (left, right):
        clients_axis(ax, clients)
    sweep_info = result["sweep"]
    fig.suptitle(
        f"Course server, {sweep_info['new_tokens']} new tokens per request: {result['model']} "
        f"model, {result['threads']} torch thread(s), {result['machine']}; median of "
        f"{sweep_info['reps']} repetition(s), bars min-max", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)


def markdown(result):
    seq, con, bare = result["one_after_another"], result["concurrent"], result["bare_loop"]
    ttft = result["ttft_seconds"]
    rows = [[label, f"{run['seconds']:.2f}", run["tokens"], f"{run['tokens_per_second']:.0f}",
             f"{ttft[key]['p50'] * 1e3:.1f}", f"{ttft[key]['p95'] * 1e3:.1f}"]
            for label, run, key in (("one after another (idle server)", seq, "idle"),
                                    (f"{result['clients']} concurrent clients", con,
                                     "under_load"))]
    rows.append(["bare decode loop, batch 1, no server", f"{bare['seconds']:.2f}",
                 bare["tokens"], f"{bare['tokens_per_second']:.0f}", "", ""])
    probe, steps = ttft["probe_under_load"], result["server_steps"]
    single = result["single_client"]
    lines = [
        "# Server benchmark (lesson 07)", "",
        f"Model: `{result['model']}`; {result['machine']}; server: its default flags, "
        f"{result['threads']} torch thread(s) (max batch size {result['max_batch_size']}, the "
        f"model in {ENGINE_WORDS.get(result.get('engine'), 'a process or thread')}); run "
        f"on {result['date']}; load average before the run {numbers(result['load_average'])}, "
        f"after it {numbers(result['load_average_after'])}.", "",
        "## 16 requests: one after another, all at once, and the bare decode loop", "",
        f"{result['clients']} requests x {result['new_tokens']} new tokens (EOS ignored), "
        f"streamed over HTTP on 127.0.0.1 (`/generate_stream`); the bare decode loop is lesson "
        f"03's `init_batch` + `generate_next_token` on batch 1 in the benchmark's process; "
        f"{result['reps']} repetition(s), median.", "",
        *markdown_table(["run", "wall time (s)", "tokens", "tokens/s", "TTFT p50 (ms)",
                         "TTFT p95 (ms)"], rows),
        "",
        f"- concurrent vs one after another: **{result['speedup']:.2f}x** the tokens/s "
        f"(the median of the repetitions' ratios, which ranged "
        f"{min(result['speedup_per_run']):.2f}-"
        f"{max(result['speedup_per_run']):.2f}; target >= {TARGETS['speedup']}x).",
        f"- one client (one after another) vs the bare decode loop: "
        f"**{single['server_over_bare_loop']:.0%}** of its tokens/s (median; per repetition "
        f"{min(single['per_run']):.0%}-{max(single['per_run']):.0%}; target >= "
        f"{TARGETS['single_client']:.0%}).",
        f"- TTFT of a request that joins the busy batch (single-token probes sent while the "
        f"{result['clients']} clients stream): p50 {probe['p50'] * 1e3:.1f} "
        f"ms, p95 {probe['p95'] * 1e3:.1f} ms ({probe['n']} probes).",
        f"- server steps during one concurrent run: {steps['decode']} decode, "
        f"{steps['prefill']} prefill; largest batch {steps['rows_max']} rows.",
        f"- same texts in the three runs: {result['same_texts']}.", "",
    ]
    lines += sweep_markdown(result) + side_by_side_markdown(
        result, TARGETS["transformers"], COMPARE_TARGET_CLIENTS)
    return "\n".join(lines + ["Targets and checks: " + verdicts(result["targets_met"]), ""])


def sweep_markdown(result):
    info = result["sweep"]

    def cell(figure, scale=1.0, digits=1):
        middle, low, high = (figure[k] * scale for k in ("median", "min", "max"))
        return f"{middle:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"

    rows = [[row["clients"], cell(row["wall_seconds"], digits=2), f"{row['tokens']:.0f}",
             cell(row["tokens_per_second"], digits=0), cell(row["ttft_p50_seconds"], 1e3),
             cell(row["ttft_p95_seconds"], 1e3), cell(row["itl_p50_seconds"], 1e3),
             cell(row["itl_p95_seconds"], 1e3),
             f"{row['server_decode_steps']['median']:.0f} / "
             f"{row['server_prefill_steps']['median']:.0f}", len(row["errors"])]
            for row in info["levels"]]
    first, last = info["levels"][0], info["levels"][-1]

    def ratio(key):
        below = first[key]["median"]
        return last[key]["median"] / below if below else float("nan")

    lines = [
        "## Sweep over concurrency", "",
        f"Each level: that many streaming requests sent at once, each a course prompt with "
        f"{info['new_tokens']} new tokens (EOS ignored), against the same server process; "
        f"median over {info['reps']} repetition(s), (min-max) in brackets. Inter-token latency "
        f"(ITL): the time between two consecutive events of one stream, as the client reads "
        f"them, over every stream of the run. Every request opens its own connection, so TTFT "
        f"includes connecting. Plot: [server.png](server.png).", "",
        *markdown_table(["clients", "wall time (s)", "tokens", "tokens/s", "TTFT p50 (ms)",
                         "TTFT p95 (ms)", "ITL p50 (ms)", "ITL p95 (ms)",
                         "server steps, decode / prefill", "failed"], rows), "",
        f"- {last['clients']} clients vs {first['clients']}: {ratio('tokens_per_second'):.1f}x "
        f"the tokens/s; TTFT p50 {ratio('ttft_p50_seconds'):.1f}x, ITL p50 "
        f"{ratio('itl_p50_seconds'):.1f}x. Largest batch the server ran: {info['rows_max']} "
        f"rows."]
    failures = [(row["clients"], e) for row in info["levels"] for e in row["errors"]]
    if failures:
        lines.append(f"- failed requests: {len(failures)}; first: {failures[0][1]} "
                     f"({failures[0][0]} clients).")
    return lines + [""]
