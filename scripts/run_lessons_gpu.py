"""Run every lesson on a CUDA GPU and write a report (`make test-gpu`).

    python scripts/run_lessons_gpu.py                          # all lessons, report in results/gpu/
    python scripts/run_lessons_gpu.py --report docs/gpu-run.md # the copy to commit
    python scripts/run_lessons_gpu.py --allow-cpu lessons/02_batching.ipynb   # check this script

Each lesson runs in a fresh kernel with lessons/ as working directory, like `make execute`,
but from a copy: the lessons themselves are not written. The executed copies land in
results/gpu/. Outputs are not compared with the saved ones (timings and memory differ on a
GPU); a cell that raises fails the run. Each lesson's wall time is printed as it finishes.

Then the headline speedups of the lessons are measured again in this process, on the same
device, with the helpers the lessons teach: the KV cache (lesson 1), one batch against one
request at a time (lesson 2), continuous against static batching (lesson 3) and gathered
against looped multi-LoRA (lesson 6). The report (markdown) gives the device, the versions,
each lesson's time and the speedups.

Exit status: 0 when every lesson ran, 1 when one failed, 2 when there is no CUDA device
(without --allow-cpu, nothing is run then).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import statistics
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

OUT = ROOT / "results" / "gpu"
PROMPT = "Humpty Dumpty sat"


def cpu_seconds(path: pathlib.Path) -> float | None:
    """The lesson's wall time as `make execute` recorded it on the reference CPU."""
    return nbformat.read(path, as_version=4).metadata.get("course", {}).get("execution_seconds")


def run_lesson(path: pathlib.Path, out_dir: pathlib.Path) -> tuple[float, str | None]:
    """Execute a copy of one lesson; (wall seconds, None) or (seconds, what failed)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as exc:
        # The message's last line is "ErrorName: value" of the failing cell.
        error = str(exc).strip().splitlines()[-1]
    except Exception as exc:  # a dead kernel or a timeout: still report, then go on
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
    return seconds, error


# --- the speedups, measured again with the helpers ---------------------------------------

def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn, repeats: int) -> float:
    """Least wall seconds of ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return min(times)


def speedups(repeats: int = 3) -> list[tuple[str, str, float, str, float]]:
    """(what, slow way, seconds, fast way, seconds) for each lesson's headline comparison."""
    from helpers import load_model
    from helpers.batching import (generate_batched, generate_continuous, generate_sequential,
                                  generate_static)
    from helpers.generation import generate_no_cache, generate_with_cache
    from helpers.lora import linear_lora_gathered, linear_lora_loop, random_adapters

    model, tokenizer = load_model()
    rows = []

    tokens = 200
    rows.append((f"KV cache, {tokens} new tokens (lesson 1)",
                 "no cache", _best(lambda: generate_no_cache(model, tokenizer, PROMPT, tokens,
                                                             stop_at_eos=False), repeats),
                 "with cache", _best(lambda: generate_with_cache(model, tokenizer, PROMPT, tokens,
                                                                 stop_at_eos=False), repeats)))

    prompts = [PROMPT] * 32
    requests = [(p, 50) for p in prompts]
    rows.append(("32 requests of 50 tokens (lesson 2)",
                 "one at a time", _best(lambda: generate_sequential(model, tokenizer, requests,
                                                                    stop_at_eos=False), repeats),
                 "one batch of 32", _best(lambda: generate_batched(model, tokenizer, prompts, 50,
                                                                   stop_at_eos=False), repeats)))

    # Lesson 3's queue: 32 requests, every 8th wants 100 tokens and the rest 10, 8 slots.
    queue = [(PROMPT, 100 if i % 8 == 0 else 10) for i in range(32)]
    rows.append(("the lesson-3 queue, batch size 8 (lesson 3)",
                 "static", _best(lambda: generate_static(model, tokenizer, queue, 8, progress=False,
                                                         stop_at_eos=False), repeats),
                 "continuous", _best(lambda: generate_continuous(model, tokenizer, queue, 8,
                                                                 progress=False, stop_at_eos=False),
                                     repeats)))

    device = model.device
    loras_a, loras_b = random_adapters(64, hidden=1024, rank=2, seed=0)
    loras_a, loras_b = loras_a.to(device), loras_b.to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 1024, generator=g).to(device)
    idx = torch.randint(0, 64, (64,), generator=g).to(device)

    def many(fn, n=20):          # one call is microseconds: time 20 of them
        for _ in range(n):
            fn(x, loras_a, loras_b, idx)

    rows.append(("multi-LoRA layer, batch 64, 64 adapters (lesson 6)",
                 "loop over rows", _best(lambda: many(linear_lora_loop), 5 * repeats) / 20,
                 "gathered + bmm", _best(lambda: many(linear_lora_gathered), 5 * repeats) / 20))
    return rows


# --- the report -------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    import transformers

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        device = f"CPU only ({platform.processor() or platform.machine()}): not a GPU run"
    return {"device": device, "CUDA (torch built with)": str(torch.version.cuda),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "Python": platform.python_version(), "date": datetime.date.today().isoformat()}


def report(times: dict[str, tuple[float, str | None]], rows, cpu: dict[str, float | None]) -> str:
    lines = ["# The lessons on a GPU", "",
             "Written by `make test-gpu` (`scripts/run_lessons_gpu.py`): every lesson executed in a",
             "fresh kernel (outputs not compared), then the lessons' headline speedups measured",
             "again with the helpers on the same device (best of a few runs). The CPU column is",
             "the time `make execute` recorded in each lesson (2 cores, one torch thread).", ""]
    lines += [f"- {k}: {v}" for k, v in _versions().items()]
    lines += ["", "| lesson | wall time (s) | on the reference CPU (s) | result |",
              "|---|---:|---:|---|"]
    for name, (seconds, error) in times.items():
        recorded = "" if cpu.get(name) is None else f"{cpu[name]:.1f}"
        result = "ok" if error is None else "FAILED: " + error.replace("|", "/")
        lines.append(f"| {name} | {seconds:.1f} | {recorded} | {result} |")
    if rows:
        lines += ["", "| what | slow way | s | fast way | s | speedup |", "|---|---|---:|---|---:|---:|"]
        for what, slow, slow_s, fast, fast_s in rows:
            lines.append(f"| {what} | {slow} | {slow_s:.4g} | {fast} | {fast_s:.4g} | "
                         f"{slow_s / fast_s:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="lessons to run (default: every lesson)")
    ap.add_argument("--report", default=str(OUT / "gpu-run.md"), help="where to write the report")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run without a GPU (to check this script; the report says CPU)")
    ap.add_argument("--no-speedups", action="store_true", help="only run the lessons")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per speedup (best kept)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available() and not args.allow_cpu:
        why = (f"torch {torch.__version__} is a build without CUDA" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU")
        print(f"No CUDA device: {why}. `make test-gpu` runs the lessons on an NVIDIA GPU with a "
              "CUDA build of torch; nothing was run. (--allow-cpu runs them here anyway, to check "
              "this script.)", file=sys.stderr)
        return 2
    print("device:", _versions()["device"], flush=True)
    paths = [pathlib.Path(p) for p in args.notebooks] or sorted((ROOT / "lessons").glob("*.ipynb"))
    times, cpu = {}, {}
    for path in paths:
        cpu[path.name] = cpu_seconds(path)
        seconds, error = run_lesson(path.resolve(), OUT)
        times[path.name] = (seconds, error)
        print(f"{path.name}: {seconds:.1f} s" + ("" if error is None else f"  FAILED: {error}"),
              flush=True)
    rows = [] if args.no_speedups else speedups(args.repeats)
    for what, slow, slow_s, fast, fast_s in rows:
        print(f"{what}: {slow} {slow_s:.4g} s, {fast} {fast_s:.4g} s: {slow_s / fast_s:.1f}x")
    target = pathlib.Path(args.report)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(report(times, rows, cpu))
    print("report:", target)
    failed = [name for name, (_, error) in times.items() if error is not None]
    if failed:
        print("FAILED:", ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
