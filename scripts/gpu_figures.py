"""The lessons' headline figures, read from what their cells printed (`make test-gpu`).

Each figure is one line of a small table: the lesson, a label, a marker (text found in the
source of exactly one code cell of that lesson) and a regular expression searched in what
that cell printed. The same table reads the committed lessons (the laptop CPU's outputs) and
the copies a GPU executed, so the report can put the two side by side. A figure whose cell or
pattern is missing says "not found"; nothing here raises on a notebook it cannot read.

Besides the figures, ``TOPICS`` names cells whose whole printed output a lesson quotes from
the GPU record (``helpers.gpu_run.gpu_record``), e.g. lesson 10's CUDA-graph table.

A notebook is read as plain JSON (no Jupyter package needed), so a laptop can rebuild the
report from the copies a GPU machine sent back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NOT_FOUND = "not found"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class Figure:
    """One headline figure: where it is printed and how it is shown.

    ``show`` gets every match of ``pattern`` in the cell's output (at least one) and returns
    the text of the table; without it, the first match's first group is shown. ``gpu_only``:
    the cell prints this figure on a GPU only (its CPU column says so instead of "not found").
    """
    lesson: str
    label: str
    marker: str
    pattern: str
    show: Callable[[list], str] | None = None
    gpu_only: bool = False


# --- how a figure is shown -------------------------------------------------------------------

def _times(group: int = 1) -> Callable[[list], str]:
    return lambda ms: f"{ms[0].group(group)}x"


def _growth(ms) -> str:
    return f"×{ms[0].group(1)}"


def _pair(unit: str, arrow: str = " / ") -> Callable[[list], str]:
    return lambda ms: f"{ms[0].group(1)}{arrow}{ms[0].group(2)} {unit}".rstrip()


def _ratio_of(numerator: int, denominator: int, then: str = "") -> Callable[[list], str]:
    def show(ms):
        a, b = float(ms[0].group(numerator)), float(ms[0].group(denominator))
        return f"{a / b:.2f}x{then}" if b else NOT_FOUND
    return show


def _range_of_last_column(ms) -> str:
    values = sorted(float(m.group(1)) for m in ms)
    return f"{values[0]:.2f}x" if len(values) == 1 else f"{values[0]:.2f}–{values[-1]:.2f}x"


def _graph_table(ms) -> dict[str, dict[int, float]]:
    """Lesson 10's table "ms per step  batch 1  batch 8 ..." as {row: {batch: ms}}."""
    block = ms[0].group(0).splitlines()
    sizes = [int(b) for b in re.findall(r"batch (\d+)", block[0])]
    rows = {}
    for line in block[1:]:
        found = re.match(r"^(\S.*?)\s+((?:-?[\d.]+\s*)+)$", line)
        if found:
            rows[found.group(1)] = dict(zip(sizes, map(float, found.group(2).split())))
    return rows


def _graphed(row: str, batch: int) -> Callable[[list], str]:
    """The eager step against ``row`` of lesson 10's CUDA-graph table at ``batch`` rows."""
    def show(ms):
        table = _graph_table(ms)
        try:
            eager, other = table["eager"][batch], table[row][batch]
        except KeyError:
            return NOT_FOUND
        return f"{eager / other:.2f}x ({eager:.2f} → {other:.2f} ms)"
    return show


def _speed_up(ms) -> str:
    """Lesson 10's "batch  eager  compiled  speed-up" row as "1.86x (5.78 → 3.10 ms)"."""
    eager, compiled, ratio = ms[0].groups()
    return f"{ratio}x ({eager} → {compiled} ms)"


# lesson 02's sweep: the rows of batch 1, 2 and 8 (tokens/s and TPOT of each)
_SWEEP_ROW = r"^\s*{b}\s+(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s*$"
_SWEEP_ROWS = r"[\s\S]*?".join(_SWEEP_ROW.format(b=b) for b in (1, 2, 8))
_COMPILED_ROW = r"^\s*{b}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x"
# lesson 11's cost table: a link's row for a number of GPUs and a batch size
_LINK_ROW = r"^{link}.*?\s{gpus}\s+{batch}\s+([\d.]+)\s+([\d.]+)\s"
_GRAPH_TABLE = r"^ms per step\s+(?:batch \d+\s*)+\n(?:^\S.*\n?)+"

FIGURES = [
    # lesson 01: the KV cache
    Figure("01", "KV cache speed-up, 200 tokens", "speedup = no_cache.latency / kv.latency",
           r"made 200 tokens ([\d.]+)x faster", _times()),
    Figure("01", "time per output token, without / with the KV cache",
           "speedup = no_cache.latency / kv.latency",
           r"^no cache\s+[\d.]+\s+([\d.]+)[\s\S]*?^KV cache\s+[\d.]+\s+([\d.]+)", _pair("ms")),
    Figure("01", "decode step without the cache, start → after 200 tokens",
           "def step_growth(run",
           r"^no cache\s*: a decode step took\s+([\d.]+) ms at the start and\s+([\d.]+) ms "
           r"after 200 tokens \(x([\d.]+)\)",
           lambda ms: f"x{ms[0].group(3)} ({ms[0].group(1)} → {ms[0].group(2)} ms)"),
    Figure("01", "decode step with the KV cache, start → after 200 tokens",
           "def step_growth(run",
           r"^KV cache\s*: a decode step took\s+([\d.]+) ms at the start and\s+([\d.]+) ms "
           r"after 200 tokens \(x([\d.]+)\)",
           lambda ms: f"x{ms[0].group(3)} ({ms[0].group(1)} → {ms[0].group(2)} ms)"),
    # lesson 02: batching
    Figure("02", "this device: memory copied, matrix-product arithmetic", "rates = measure_rates(",
           r"this device \(.*?\): ([\d,.]+) GB/s copied, ([\d,.]+) GFLOP/s in a matrix product",
           lambda ms: f"{ms[0].group(1)} GB/s, {ms[0].group(2)} GFLOP/s"),
    Figure("02", "the step's fixed overhead (the model with almost no data)",
           "rates = measure_rates(",
           r"the model's step with almost no data: ([\d.]+) ms", lambda ms: f"{ms[0].group(1)} ms"),
    Figure("02", "what bounds the step, batch 1 / batch 128", 'cost = step_cost(model, r["batch"]',
           r"^batch\s+1: .*bound by (\w+)[\s\S]*?^batch 128: .*bound by (\w+)", _pair("")),
    Figure("02", "measured decode step (TPOT), batch 1 / batch 128",
           'cost = step_cost(model, r["batch"]',
           r"^batch\s+1: the measured decode step \(TPOT\) ([\d.]+) ms[\s\S]*?^batch 128: the "
           r"measured decode step \(TPOT\) ([\d.]+) ms", _pair("ms")),
    Figure("02", "throughput, batch 1 → 128", "first, last = results[0], results[-1]",
           r"from batch 1 to 128: throughput x([\d.]+)", _growth),
    Figure("02", "latency, batch 1 → 128", "first, last = results[0], results[-1]",
           r"from batch 1 to 128: .*latency x([\d.]+)", _growth),
    Figure("02", "time per decode step, batch 1 → 128", "first, last = results[0], results[-1]",
           r"time per decode step x([\d.]+)", _growth),
    Figure("02", "tokens/s at batch 1 / batch 128", "first, last = results[0], results[-1]",
           r"^\s+1\s+(\d+)\s[\s\S]*?^\s*128\s+(\d+)\s", _pair("")),
    Figure("02", "tokens/s at batch 1 / 2 / 8", "first, last = results[0], results[-1]",
           _SWEEP_ROWS, lambda ms: " / ".join(ms[0].group(1, 3, 5))),
    Figure("02", "decode step (TPOT) at batch 1 / 2 / 8", "first, last = results[0], results[-1]",
           _SWEEP_ROWS, lambda ms: " / ".join(ms[0].group(2, 4, 6)) + " ms"),
    # lesson 03: continuous batching
    Figure("03", "continuous / static batching, wall time",
           "speedup = static_trace.seconds / continuous_trace.seconds",
           r"continuous batching is ([\d.]+)x faster", _times()),
    Figure("03", "decode steps, static / continuous", "ideal_decode_steps(asked, BATCH_SIZE)",
           r"step ratio: ([\d.]+)x", _times()),
    Figure("03", "with EOS: continuous / static, wall time", "eos_traces = time_schedules(",
           r"with EOS: static [\d.]+ s, continuous [\d.]+ s: ([\d.]+)x faster", _times()),
    Figure("03", "transformers' continuous batching / ours",
           "library_answers = transformers_generate_batch(",
           r"transformers continuous batching: ([\d.]+) s \(set-up included\); ours: ([\d.]+) s",
           _pair("s")),
    # lesson 04: quantization
    Figure("04", "fp32, ms per token", 'timed = {"fp32": model',
           r"^fp32\s+([\d.]+) ms per token"),
    Figure("04", "torchao int8 weight-only, ms per token", 'timed = {"fp32": model',
           r"^torchao int8 weight-only\s+([\d.]+) ms per token"),
    Figure("04", "torchao int8 / fp32, time per token", 'timed = {"fp32": model',
           r"^fp32\s+([\d.]+) ms per token[\s\S]*?^torchao int8 weight-only\s+([\d.]+) ms",
           _ratio_of(2, 1)),
    # lesson 05: LoRA
    Figure("05", "LoRA training, 24 steps (drawing included)", "STEPS, BATCH = recipe",
           r"24 steps in ([\d.]+) s", lambda ms: f"{ms[0].group(1)} s"),
    Figure("05", "held-out sentences the adapter gets right", "def answer(m, sentence",
           r"(\d+/\d+) held-out sentences right"),
    # lesson 06: multi-LoRA
    Figure("06", "one LoRA layer, loop / gathered, batch 64",
           "for batch, (loop, gathered) in toy.items()",
           r"^\s*64\s+[\d.]+\s+[\d.]+\s+([\d.]+)x", _times()),
    Figure("06", "whole toy model, loop / gathered, batch 64",
           'loop, gathered, base = t["loop over rows"]',
           r"^\s*64\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)x", _times()),
    Figure("06", "real model, peft / ours, every batch size",
           "for batch, (ours_s, peft_s) in real.items()",
           r"^\s*\d+\s+[\d.]+\s+[\d.]+\s+([\d.]+)x\s*$", _range_of_last_column),
    Figure("06", "one LoRA layer at batch 64: loop / gathered",
           "for batch, (loop, gathered) in toy.items()",
           r"^\s*64\s+([\d.]+)\s+([\d.]+)\s+[\d.]+x", _pair("ms")),
    Figure("06", "whole toy model at batch 64: loop / gathered / no adapters",
           'loop, gathered, base = t["loop over rows"]',
           r"^\s*64\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+x",
           lambda ms: " / ".join(ms[0].groups()) + " ms"),
    # lesson 07: serving
    Figure("07", "server, 16 clients / 1 client, tokens/s", "def tokens_per_second(n_clients",
           r"16 clients got ([\d.]+) times the tokens/s of one", _times()),
    Figure("07", "server tokens/s, 1 client / 16 clients", "def tokens_per_second(n_clients",
           r"^1: (\d+),.*\b16: (\d+) tokens/s", _pair("")),
    Figure("07", "one stream: TTFT, then tokens/s", "ttft_s, gaps_s, streamed = time_stream(",
           r"TTFT ([\d.]+) ms, then (\d+) tokens/s",
           lambda ms: f"{ms[0].group(1)} ms, {ms[0].group(2)} tokens/s"),
    Figure("07", "TTFT beside a long request: 100-token / 10-token request",
           "async def one_request(",
           r"^\s*100 tokens: TTFT\s+([\d.]+) ms[\s\S]*?^\s*10 tokens: TTFT\s+([\d.]+) ms",
           _pair("ms")),
    # lesson 08: the paged KV cache
    Figure("08", "KV memory reserved / used over the run, padded; paged",
           "padded reserves {sum(reserved) / sum(used)",
           r"padded reserves ([\d.]+)x what is used, paged ([\d.]+)x",
           lambda ms: f"{ms[0].group(1)}x; {ms[0].group(2)}x"),
    Figure("08", "requests at once in one KV budget, padded / paged", "paged_fit = max(",
           r"requests at once: padded (\d+), paged (\d+)", _pair("")),
    Figure("08", "prefix caching, mean TTFT of requests 1–5, without → with",
           "requests 1-5, mean TTFT",
           r"mean TTFT: ([\d.]+) ms without, ([\d.]+) ms with: ([\d.]+)x faster",
           lambda ms: f"{ms[0].group(3)}x faster ({ms[0].group(1)} → {ms[0].group(2)} ms)"),
    Figure("08", "chunked prefill, worst gap between tokens, whole prompt → chunks",
           "worst_inter_token_gap(trace",
           r"whole prompt: worst gap ([\d.]+) ms[\s\S]*?chunks of \d+: worst gap ([\d.]+) ms",
           _pair("ms", " → ")),
    Figure("08", "chunked prefill, the long prompt's first token, whole prompt → chunks",
           "worst_inter_token_gap(trace",
           r"whole prompt: .*first token after (\d+) ms[\s\S]*?chunks of \d+: .*first token "
           r"after (\d+) ms", _pair("ms", " → ")),
    # lesson 09: speculative decoding
    Figure("09", "draft model on stories, best k", "best = max(results, key=lambda k:",
           r"draft model\s*: best k = (\d+), \d+ tokens/s = ([\d.]+)x plain",
           lambda ms: f"k = {ms[0].group(1)}: {ms[0].group(2)}x plain greedy"),
    Figure("09", "prompt lookup on stories, best k", "best = max(results, key=lambda k:",
           r"prompt lookup\s*: best k = (\d+), \d+ tokens/s = ([\d.]+)x plain",
           lambda ms: f"k = {ms[0].group(1)}: {ms[0].group(2)}x plain greedy"),
    Figure("09", "verify pass of 5 tokens / a pass of 1", "pass_cost_figure(pass_seconds",
           r"model: 1 token ([\d.]+) ms, 5 tokens ([\d.]+) ms \(([\d.]+)x\)",
           lambda ms: f"{ms[0].group(3)}x ({ms[0].group(1)} → {ms[0].group(2)} ms)"),
    Figure("09", "draft step / model step", "pass_cost_figure(pass_seconds",
           r"draft: 1 token [\d.]+ ms = ([\d.]+)x a model step", _times()),
    Figure("09", "k that pay with the course's draft", "payoff_figure(",
           r"k that pay with our draft's step: (\[.*\]|none)"),
    Figure("09", "prompt lookup, a rhyme said again, k = 8", 'bars = {"plain": copy_plain',
           r"lookup, k = 8\s*:\s+\d+ tokens/s = ([\d.]+)x plain", _times()),
    # lesson 10: compilation and CUDA graphs
    Figure("10", "the profiler's first row, one eager step",
           "from torch.profiler import ProfilerActivity, profile",
           r"^\s*Name\s.*\n-[- ]+\n\s*(\S+)"),
    Figure("10", "eager step at batch 1; the matrix products' share", "matmul_seconds = sum(",
           r"a decode step at batch 1: ([\d.]+) ms; its matrix products [\d.]+ ms of it "
           r"\((\d+)%\)", lambda ms: f"{ms[0].group(1)} ms; {ms[0].group(2)}%"),
    Figure("10", "operations called from Python, eager → compiled", "step_profile(decode_step",
           r"eager: (\d+) operations called from Python; compiled: (\d+)", _pair("", " → ")),
    Figure("10", "compile time of the first call", "the first call, which compiled",
           r"compiled the decode step: ([\d.]+) s", lambda ms: f"{ms[0].group(1)} s"),
    Figure("10", "compiled step's speed-up over eager, batch 1", "compiled ms/step   speed-up",
           _COMPILED_ROW.format(b=1), _speed_up),
    Figure("10", "compiled step's speed-up over eager, batch 64", "compiled ms/step   speed-up",
           _COMPILED_ROW.format(b=64), _speed_up),
    Figure("10", "CUDA graph: eager → eager replayed, batch 1", "time_graphed(",
           _GRAPH_TABLE, _graphed("eager, graphed", 1)),
    Figure("10", "CUDA graph: eager → eager replayed, batch 64", "time_graphed(",
           _GRAPH_TABLE, _graphed("eager, graphed", 64)),
    Figure("10", "CUDA graph: eager → compiled and replayed, batch 1", "time_graphed(",
           _GRAPH_TABLE, _graphed("compiled, graphed", 1)),
    Figure("10", "kernel launches, one eager step → one replay", "kernel_launches(",
           r"one eager step: (\d+) launches[\s\S]*?one replayed step: (\d+) launches",
           _pair("", " → "), gpu_only=True),
    # lesson 11: sharding
    Figure("11", "2 processes over gloo, the same tokens as lesson 1", "2 processes over {group.backend}",
           r"2 processes over gloo: the \d+ tokens of all \d+ prompts equal lesson 1's: (\w+)"),
    Figure("11", "all-reduces and bytes a decode step, batch 1", "course_prompts",
           r"batch 1: (\d+) all-reduces, ([\d,]+) bytes a decode step", _pair("bytes", ", ")),
    Figure("11", "a rank's weights and resident memory", "group.memory()",
           r"rank 0: ([\d.]+) MiB of weights in a process of (\d+) MiB", _pair("MiB", " in ")),
    Figure("11", "ms a step, 1 process / 2 processes over gloo, batch 1", "load_shard",
           r"1 process\s+([\d.]+) \([\d.]+\).*\n2 processes \(gloo\)\s+([\d.]+)",
           _pair("ms")),
    Figure("11", "ms a step, 1 process / 2 processes without all-reduces, batch 1; batch 8",
           "load_shard",
           r"^1 process\s+([\d.]+) \([\d.]+\)\s+([\d.]+)[\s\S]*?^2 processes, no all-reduce\s+"
           r"([\d.]+) \([\d.]+\)\s+([\d.]+)",
           lambda ms: f"{ms[0].group(1)} / {ms[0].group(3)}; {ms[0].group(2)} / {ms[0].group(4)} ms"),
    Figure("11", "cost model, NVLink, 2 GPUs, batch 1: weights / all-reduce ms", "LLAMA2_70B_SHAPE, gpus",
           _LINK_ROW.format(link="NVLink", gpus=2, batch=1), _pair("ms")),
    Figure("11", "cost model, PCIe, 8 GPUs, batch 64: weights / all-reduce ms", "LLAMA2_70B_SHAPE, gpus",
           _LINK_ROW.format(link="PCIe", gpus=8, batch=64), _pair("ms")),
    Figure("11", "cost model, InfiniBand, 8 GPUs, batch 1: weights / all-reduce ms",
           "LLAMA2_70B_SHAPE, gpus", _LINK_ROW.format(link="InfiniBand", gpus=8, batch=1),
           _pair("ms")),
    Figure("11", "cost model, InfiniBand, 8 GPUs, batch 64: weights / all-reduce ms",
           "LLAMA2_70B_SHAPE, gpus", _LINK_ROW.format(link="InfiniBand", gpus=8, batch=64),
           _pair("ms")),
    Figure("11", "one all-reduce of 1,024 bytes", "load_shard",
           r"one all-reduce of 1,024 bytes alone: ([\d.]+ ms)"),
]

#: What the GPU record's server check printed (``benchmarks/gpu_server.py``), read with the same
#: patterns: the check is no lesson, so these figures have a table of their own, read from a
#: cell that holds the check's lines (``SERVER_MARKER``).
SERVER_MARKER = "benchmarks/gpu_server.py"
SERVER_FIGURES = [
    Figure("server", "server: mixed steps; captures, start → end; compiles, start → end",
           SERVER_MARKER, r"(\d+) mixed steps .*captures (\d+) -> (\d+), compiles (\d+) -> (\d+)",
           lambda ms: "{}; {} → {}; {} → {}".format(*ms[0].groups())),
    Figure("server", "server: GPU memory in use over the mixed steps, start → end", SERVER_MARKER,
           r"GPU memory in use ([\d.]+) -> ([\d.]+) MiB", _pair("MiB", " → ")),
    Figure("server", "server: ms per model step of 1 row, eager / compiled / graph replay",
           SERVER_MARKER, r"^eager\s+([\d.]+)[\s\S]*?^compiled\s+([\d.]+)[\s\S]*?"
           r"^graph replay\s+([\d.]+)", lambda ms: " / ".join(ms[0].groups()) + " ms"),
    Figure("server", "server: one request's tokens equal lesson 01's loop", SERVER_MARKER,
           r"one request against lesson 01's loop: same tokens: (\w+)"),
]

#: Topics of the GPU record that quote whole cells: topic -> (lesson, the cells' markers).
TOPICS = {"lesson 10, CUDA graphs": ("10", ["time_graphed(", "kernel_launches("])}


# --- reading a notebook ----------------------------------------------------------------------

def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def read_notebook(path: Path) -> dict | None:
    """The notebook at ``path`` as JSON, or None if it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def lesson_number(path: Path) -> str:
    """"01" for lessons/01_text_generation.ipynb."""
    return Path(path).name.split("_", 1)[0]


def lesson_title(nb: dict | None) -> str:
    """The first heading of the notebook ("Lesson 1 · Text generation, ..."), or ""."""
    for cell in (nb or {}).get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in _text(cell.get("source")).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def cells_with(nb: dict | None, marker: str) -> list[dict]:
    """The code cells whose source contains ``marker``."""
    return [cell for cell in (nb or {}).get("cells", [])
            if cell.get("cell_type") == "code" and marker in _text(cell.get("source"))]


def printed(cell: dict, streams=("stdout", "stderr")) -> str:
    """What a cell printed: its streams and the text of results that are not images, in
    order, colour codes removed, each progress-bar line as it ended (after its last \\r)."""
    parts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream" and out.get("name") in streams:
            text = _text(out.get("text"))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/plain" not in data or any(k.startswith("image/") for k in data):
                continue
            text = _text(data["text/plain"])
        else:
            continue
        text = "\n".join(line.rsplit("\r", 1)[-1] for line in ANSI.sub("", text).split("\n"))
        parts.append(text if text.endswith("\n") else text + "\n")
    return "".join(parts)


def read_figure(nb: dict | None, figure: Figure) -> str:
    """The figure as ``nb`` printed it, or "not found"."""
    cells = cells_with(nb, figure.marker)
    if not cells:
        return NOT_FOUND
    matches = list(re.finditer(figure.pattern, printed(cells[0]), re.M))
    if not matches:
        return NOT_FOUND
    try:
        return figure.show(matches) if figure.show else matches[0].group(1)
    except (IndexError, ValueError, ZeroDivisionError):
        return NOT_FOUND


def headlines(nb: dict | None, lesson: str) -> dict[str, str]:
    """Label -> value of every figure of ``lesson`` ("01") in ``nb``."""
    return {f.label: read_figure(nb, f) for f in FIGURES if f.lesson == lesson}


def topic_lines(nb: dict | None, markers: list[str]) -> list[str]:
    """The lines the cells with ``markers`` printed to stdout, cell after cell (blank lines
    and a cell that is missing left out)."""
    lines = []
    for marker in markers:
        for cell in cells_with(nb, marker)[:1]:
            lines += [line.rstrip() for line in printed(cell, ("stdout",)).splitlines()
                      if line.strip()]
    return lines
