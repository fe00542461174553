"""Benchmark of lesson 07's JSON mode: grammar engines side by side on the bundled tokenizer.

    python -m benchmarks.bench_grammar            # a few minutes: slow cases are cut
    python -m benchmarks.bench_grammar --quick    # fewer repetitions, shorter cut-off

For every engine installed (outlines-core, llguidance, xgrammar) and every case, each in a
fresh process: compile time, peak memory above the process's before compiling (VmHWM), and the
cost per token (mask, apply, advance) along a seeded random walk of up to 64 tokens. The cases
are lesson 07's schemas and hostile ones (long strings, a big enum, deep nesting,
unsatisfiable schemas, exponential regular expressions); one past the cut-off is stopped.
Writes ``bench_grammar.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.grammar_engines import ENGINE_CLASSES, ENGINES
from benchmarks.results_io import (arguments, load_average, machine, markdown_table, numbers,
                                   verdicts, write_results)

ROOT = pathlib.Path(__file__).resolve().parents[1]
WALK = 64          # tokens of the random walk that prices the mask
STARTUP_S = 300    # a child process that has not set up by then has failed


# --- the cases -------------------------------------------------------------------------------

def _string(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


def object_schema(**properties) -> dict:
    """An object with these properties, all required (tests/test_grammar.py uses it too)."""
    return {"type": "object", "properties": properties, "required": list(properties)}


def nested_schema(depth: int) -> dict:
    """Objects nested ``depth`` deep around an integer (tests/test_grammar.py uses it too)."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = object_schema(a=schema)
    return schema


def lesson_schemas() -> dict[str, dict]:
    """Lesson 07's StoryFacts and the schemas the server's tests send (tests/test_server.py),
    written out as the JSON schemas pydantic makes of them."""
    short = lambda n: _string(n)  # noqa: E731
    pet = object_schema(name=short(8), age={"type": "integer", "minimum": 0, "maximum": 20})
    return {
        "lesson 07 StoryFacts": object_schema(characters={"type": "array", "items": short(24),
                                                    "maxItems": 3},
                                        place=short(20), object=short(24)),
        "tests Owner (nested)": object_schema(pet=pet, town=short(10)),
        "tests Ball (enum)": object_schema(colour={"enum": ["red", "green", "blue"], "type": "string"},
                                     size={"type": "integer", "minimum": 1, "maximum": 3}),
        "tests Score (integers)": object_schema(points={"type": "integer"},
                                          rank={"type": "integer", "minimum": 1, "maximum": 10}),
        "tests Entities": object_schema(characters={"type": "array", "items": short(12), "maxItems": 3},
                                  animals={"type": "array", "items": short(12), "maxItems": 3},
                                  place=short(15), object=short(20)),
    }


def hostile_cases() -> dict[str, tuple[str, object]]:
    words = [f"value-{i:05d}-{'xyz'[i % 3] * (i % 7)}" for i in range(1000)]
    return {
        'string maxLength 12': ("json", _string(12)),
        'string maxLength 16': ("json", _string(16)),
        'string maxLength 20': ("json", _string(20)),
        'string maxLength 2000': ("json", _string(2000)),
        'string maxLength 100000': ("json", _string(100_000)),
        'enum of 1000 strings': ("json", {"enum": words}),
        'objects nested 40 deep': ("json", nested_schema(40)),
        'object of 200 strings': ("json", object_schema(**{f"key{i}": _string(10) for i in range(200)})),
        '{"enum": []}': ("json", {"enum": []}),
        '{"not": {}}': ("json", {"not": {}}),
        'regex (a|b)*c{1000}': ("regex", "(a|b)*c{1000}"),
        'regex (a|b)*a(a|b){16}': ("regex", "(a|b)*a(a|b){16}"),
    }


def all_cases() -> dict[str, tuple[str, object]]:
    cases = {name: ("json", schema) for name, schema in lesson_schemas().items()}
    cases.update(hostile_cases())
    return cases


# --- one case in one process ---------------------------------------------------------------------

def _status_kb(field: str, pid: str = "self") -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> None:
    """Start the process's peak resident memory (VmHWM) again from what it holds now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def walk(engine, compiled, vocab: int, eos: int, steps: int, seed: int = 0) -> dict:
    """A seeded random walk through the grammar: at each step the mask is applied to a logits
    row and one allowed token (not EOS while others are allowed) is taken. Returns the seconds
    spent on masks and advances, and the tokens taken."""
    import torch

    rng = random.Random(seed)
    matcher = engine.start(compiled)
    spent, tokens = 0.0, []
    for _ in range(steps):
        logits = torch.zeros(vocab)
        start = time.perf_counter()
        engine.mask(matcher, logits)
        spent += time.perf_counter() - start
        allowed = [t for t in torch.isfinite(logits).nonzero().flatten().tolist() if t != eos]
        if not allowed:
            break
        token = rng.choice(allowed)
        start = time.perf_counter()
        engine.advance(matcher, token)
        spent += time.perf_counter() - start
        tokens.append(token)
    return {"seconds": spent, "tokens": tokens}


def run_case(engine_name: str, case: str, repeats: int) -> dict:
    """Measure one engine on one case (in this process, which is fresh)."""
    from benchmarks.timing import Candidate, time_in_turns
    from helpers import load_tokenizer

    tokenizer = load_tokenizer()
    engine = ENGINE_CLASSES[engine_name](tokenizer)
    kind, value = all_cases()[case]
    warm = engine.compile("regex", "[a-z]{0,8}")   # warm up: lazy imports, tables, a walk
    walk(engine, warm, len(tokenizer), tokenizer.eos_token_id, WALK)
    baseline = _status_kb("VmRSS")
    print(json.dumps({"baseline_kb": baseline}), flush=True)
    _reset_peak()
    try:
        first = time_in_turns({"compile": lambda: engine.compile(kind, value)}, repeats=1,
                              warmup=0)
    except Exception as err:                  # the engine refuses the grammar
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return {"refused": message[:160], "peak_mb": _peak_mb(baseline)}
    compiled = first.last["compile"]
    seconds = first.seconds["compile"]
    if seconds[0] < 0.5:                      # quick enough to repeat for a median
        seconds = time_in_turns({"compile": lambda: engine.compile(kind, value)},
                                repeats=repeats, warmup=0).seconds["compile"]
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    walked = time_in_turns({"walk": Candidate(lambda: walk(engine, compiled, vocab, eos, WALK),
                                              clock=lambda r: r["seconds"])},
                           repeats=repeats, warmup=1)
    steps = len(walked.last["walk"]["tokens"])
    return {"compile_s": sorted(seconds)[len(seconds) // 2], "compile_runs": seconds,
            "peak_mb": _peak_mb(baseline), "walk_tokens": steps,
            "per_token_s": walked.median("walk") / max(steps, 1),
            "walk_text": tokenizer.decode(walked.last["walk"]["tokens"])[:80]}


def _peak_mb(baseline_kb, pid: str = "self") -> float | None:
    peak = _status_kb("VmHWM", pid)
    if peak is None or baseline_kb is None:
        return None
    return max(0, peak - baseline_kb) / 1024


def measure(engine_name: str, case: str, repeats: int, cutoff: float) -> dict:
    """Run one case in a fresh process; stop it ``cutoff`` seconds after it has set up (its
    imports and the engine's vocabulary are not timed: on a busy machine they take a while)."""
    command = [sys.executable, "-m", "benchmarks.bench_grammar", "--child", engine_name, case,
               "--repeats", str(repeats)]
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=errors,
                                   text=True, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
        lines: queue.Queue = queue.Queue()

        def read():
            for line in process.stdout:
                if line.startswith("{"):
                    lines.put(json.loads(line))
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        try:
            first = lines.get(timeout=STARTUP_S)
            last = lines.get(timeout=cutoff) if first is not None else None
        except queue.Empty:
            peak = _status_kb("VmHWM", str(process.pid))
            process.kill()
            process.wait()
            if first is None or "baseline_kb" not in first:
                return {"failed": f"did not start within {STARTUP_S} s"}
            return {"timeout_s": cutoff,
                    "peak_mb": (peak - first["baseline_kb"]) / 1024 if peak else None}
        process.wait()
        if last is None:
            errors.seek(0)
            return {"failed": (errors.read().strip().splitlines() or ["no output"])[-1][:160]}
        return last


# --- the report ---------------------------------------------------------------------------------

def _cell(figure: dict | None) -> tuple[str, str, str]:
    if figure is None:
        return ("not installed",) * 3
    if "not_run" in figure:
        return ("not run (a shorter one was cut)", "", "")
    mb = figure.get("peak_mb")
    mem = f"{mb:.1f}" if mb is not None else "?"
    if "timeout_s" in figure:
        return (f"> {figure['timeout_s'] * 1e3:.0f} (cut)", f"> {mem}", "")
    if "refused" in figure:
        return ("refused", mem, "")
    if "failed" in figure:
        return ("failed", "", "")
    return (f"{figure['compile_s'] * 1e3:.1f}", mem, f"{figure['per_token_s'] * 1e6:.0f}")


def markdown(result: dict) -> str:
    engines = result["engines"]
    header = ["case"] + [f"{e} {what}" for e in engines
                         for what in ("compile ms", "peak MB", "µs/token")]
    rows = []
    for case in result["cases"]:
        row = [case.replace("|", "\\|")]
        for e in engines:
            row += _cell(result["figures"][e].get(case) if result["figures"][e] else None)
        rows.append(row)
    refusals = [f"- {e}, {case}: {fig['refused']}" for e in engines
                for case, fig in (result["figures"][e] or {}).items() if "refused" in fig]
    lines = ["# Grammar engines for JSON mode (lesson 07)", "",
             f"Tokenizer: the bundled model's ({result['vocab']} tokens); {result['machine']}; "
             f"versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items())}; "
             f"{result['repeats']} repetitions (median), each case in a fresh process, cut "
             f"after {result['cutoff_s']:.0f} s; load average before the run "
             f"{numbers(result['load_average'])}.", "",
             *markdown_table(header, rows, "l" + "rrr" * len(engines)), "",
             "Peak MB: how far the process's peak resident memory rose while compiling and "
             "walking (for a cut case: by the time it was stopped), above what it held after "
             "a warm-up compilation and walk. µs/token: mask, apply to a logits row, advance; "
             f"a seeded random walk of up to {WALK} tokens. llguidance, the server's engine, "
             "runs with the server's settings (helpers/server/grammar.py).", ""]
    if result["skipped"]:
        lines += [f"Not installed here, skipped: {', '.join(result['skipped'])}.", ""]
    if refusals:
        lines += ["Refusals (the engine's own words):", *refusals, ""]
    return "\n".join(lines + ["Checks: " + verdicts(result["checks"]), ""])


def checks(result: dict) -> dict[str, bool]:
    """The server's engine (llguidance) compiles every satisfiable case well within the cut-off
    and refuses the unsatisfiable ones."""
    figures = result["figures"].get("llguidance")
    if not figures:
        return {}
    hostile = hostile_cases()
    fast = all("compile_s" in figures[c] and figures[c]["compile_s"] < 1.0
               for c in result["cases"] if c not in ('{"enum": []}', '{"not": {}}'))
    refused = all("refused" in figures[c] for c in ('{"enum": []}', '{"not": {}}') if c in hostile)
    return {"llguidance compiles every case in < 1 s": fast,
            "llguidance refuses the unsatisfiable schemas": refused}


def main(argv=None):
    parser = arguments(__doc__, "2 repetitions instead of 5, cases cut after 10 s instead of "
                                "30 s", threads=False)
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(run_case(*args.child, args.repeats)), flush=True)
        return 0
    repeats, cutoff = (2, 10.0) if args.quick else (5, 30.0)
    installed = [e for e, module in ENGINES.items() if importlib.util.find_spec(module)]
    skipped = [e for e in ENGINES if e not in installed]
    from importlib.metadata import version

    from helpers import load_tokenizer

    result = {"machine": machine(), "load_average": load_average(), "repeats": repeats,
              "cutoff_s": cutoff, "vocab": len(load_tokenizer()), "engines": installed,
              "skipped": skipped, "versions": {e: version(e) for e in installed},
              "cases": list(all_cases()), "figures": {}}
    for engine in installed:
        figures = result["figures"][engine] = {}
        for case in result["cases"]:
            shorter = [c for c in figures if c.startswith("string maxLength")]
            if case.startswith("string maxLength") and any("timeout_s" in figures[c]
                                                           for c in shorter):
                figures[case] = {"not_run": "a shorter string was cut already"}
                continue
            print(f"{engine}: {case} ...", flush=True)
            figures[case] = measure(engine, case, repeats, cutoff)
    result["checks"] = checks(result)
    write_results(args.out, "bench_grammar", result, markdown(result))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
