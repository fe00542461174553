"""The claims ledger: every sentence of the course that states a measured effect, bound to the
figures it rests on and checked against each record of a run.

A claim is one sentence (found by a stable fragment of its words, in a lesson's markdown cell
named by its cell id, or after a text anchor in the README or the instructors' guide), the
figures of ``gpu_figures`` it rests on, a predicate over them, and the records it speaks for:

- ``cpu``: the lessons' committed outputs, recorded on a laptop CPU (``make test``);
- ``colab``: the copies that ``make test-colab`` executes under Colab's versions;
- ``gpu``: the GPU record, docs/gpu-run.json (``make test-gpu`` writes the verdicts into it).

A sentence that holds on some devices only says so in its words, and its claim speaks for
those records only. A claim is evaluated on a record as *holds*, *false* (the figure that
breaks it is named) or *no evidence* (a figure the record does not have). The GPU record is
also *stale* for a claim whose sentence changed after the run: the record keeps a hash of
each sentence it judged, and an older record without one is compared by commit (the sentence
must be in its file at the record's commit).

    python scripts/claims.py            # every claim on the committed outputs and the GPU record
    python scripts/claims.py --counts   # claims per lesson and per record
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_figures  # noqa: E402
from gpu_figures import NOT_FOUND  # noqa: E402

RECORDS = {"cpu": "the committed CPU outputs", "colab": "the Colab-runtime run",
           "gpu": "the GPU record"}
#: The run ``make test-colab`` makes executes two notebooks at once on the CI machine's cores,
#: beside nothing quiet: its times measure that contention, not the device. So a claim that
#: rests on a time (any figure but these counts, sizes and tokens) speaks for the committed
#: outputs, recorded on a quiet machine, and for the GPU record; the Colab run judges the rest.
NOT_TIMES = frozenset({"decode steps, static / continuous",
                       "KV memory reserved / used over the run, padded; paged",
                       "requests at once in one KV budget, padded / paged",
                       "kernel launches, one eager step → one replay",
                       "2 processes over gloo, the same tokens as lesson 1",
                       "cost model, NVLink, 2 GPUs, batch 1: weights / all-reduce ms",
                       "cost model, PCIe, 8 GPUs, batch 64: weights / all-reduce ms",
                       "cost model, InfiniBand, 8 GPUs, batch 1: weights / all-reduce ms",
                       "cost model, InfiniBand, 8 GPUs, batch 64: weights / all-reduce ms"})
ALL = frozenset(RECORDS)
CPU = frozenset({"cpu", "colab"})          # a laptop's CPU: the committed run and make test-colab
GPU = frozenset({"gpu"})
GPU_RECORD = ROOT / "docs" / "gpu-run.json"
FILES = ("README.md", "docs/instructors.md")

HOLDS, FALSE, NO_EVIDENCE = "holds", "FALSE", "no evidence"


@dataclass(frozen=True)
class Claim:
    """One sentence and what it rests on. ``where``: a lesson ("01"), "README.md" or
    "docs/instructors.md"; ``anchor``: the lesson's markdown cell id, or text of the file that
    comes before the sentence; ``words``: a fragment of the sentence; ``figures``: labels of
    ``gpu_figures``' tables; ``holds``: the predicate, given a ``Figures``; ``says``: the
    predicate in words; ``records``: the records the sentence speaks for."""
    id: str
    where: str
    anchor: str
    words: str
    figures: tuple
    holds: Callable
    says: str
    records: frozenset = ALL

    def __post_init__(self):                  # a time is judged on a quiet recording only
        if not set(self.figures) <= NOT_TIMES:
            object.__setattr__(self, "records", self.records - {"colab"})

    def place(self) -> str:
        if self.where in FILES:
            return self.where
        return f"{lesson_path(self.where).relative_to(ROOT)}, cell {self.anchor}"


_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


def numbers(value: str) -> list[float]:
    """The numbers in a figure as the tables show it: "x4.1 (8.82 → 36.23 ms)" -> [4.1, 8.82,
    36.23]; thousands separators allowed ("8, 8,192 bytes" -> [8, 8192])."""
    return [float(n.replace(",", "")) for n in _NUMBER.findall(value)]


class Missing(LookupError):
    """A figure the record does not have (or whose value has too few numbers)."""


@dataclass
class Figures:
    """The figures a predicate reads: ``f(label)`` is the first number of the figure,
    ``f(label, i)`` the i-th, ``f.text(label)`` its words; ``f.quoted(label)``: every number
    of the figure is written in the sentence (for a sentence that quotes a record)."""
    values: dict
    sentence: str = ""

    def text(self, label: str) -> str:
        value = self.values.get(label, NOT_FOUND)
        if value in (NOT_FOUND, "not run", "GPU only"):
            raise Missing(label)
        return value

    def __call__(self, label: str, index: int = 0) -> float:
        found = numbers(self.text(label))
        if len(found) <= index:
            raise Missing(label)
        return found[index]

    def quoted(self, label: str) -> bool:
        written = set(_NUMBER.findall(self.sentence.replace(",", "")))
        return all(n in written for n in _NUMBER.findall(self.text(label).replace(",", "")))


def lesson_path(number: str) -> Path:
    return next((ROOT / "lessons").glob(f"{number}_*.ipynb"))


# --- the ledger ------------------------------------------------------------------------------

L01_SPEEDUP = "KV cache speed-up, 200 tokens"
L01_TPOT = "time per output token, without / with the KV cache"
L01_GROWTH = "decode step without the cache, start → after 200 tokens"
L01_CACHED = "decode step with the KV cache, start → after 200 tokens"
L03_SPEEDUP = "continuous / static batching, wall time"
L03_STEPS = "decode steps, static / continuous"
L03_EOS = "with EOS: continuous / static, wall time"
L04_INT8 = "torchao int8 / fp32, time per token"
L05_TRAINING = "LoRA training, 24 steps (drawing included)"
L06_LAYER_RATIO = "one LoRA layer, loop / gathered, batch 64"
L06_MODEL_RATIO = "whole toy model, loop / gathered, batch 64"
L07_CLIENTS = "server, 16 clients / 1 client, tokens/s"
L08_FIRST = "chunked prefill, the long prompt's first token, whole prompt → chunks"
L09_DRAFT = "draft model on stories, best k"
L09_DRAFT_STEP = "draft step / model step"
L09_RHYME = "prompt lookup, a rhyme said again, k = 8"
L02_BOUNDS = "what bounds the step, batch 1 / batch 128"
L02_STEP = "time per decode step, batch 1 → 128"
L02_THROUGHPUT = "throughput, batch 1 → 128"
L02_LATENCY = "latency, batch 1 → 128"
L02_TOKENS = "tokens/s at batch 1 / 2 / 8"
L02_TPOT = "decode step (TPOT) at batch 1 / 2 / 8"
L06_LAYER = "one LoRA layer at batch 64: loop / gathered"
L06_MODEL = "whole toy model at batch 64: loop / gathered / no adapters"
L08_RESERVED = "KV memory reserved / used over the run, padded; paged"
L08_FIT = "requests at once in one KV budget, padded / paged"
L08_PREFIX = "prefix caching, mean TTFT of requests 1–5, without → with"
L08_GAP = "chunked prefill, worst gap between tokens, whole prompt → chunks"
L09_PASS = "verify pass of 5 tokens / a pass of 1"
L10_SP1 = "compiled step's speed-up over eager, batch 1"
L10_SP64 = "compiled step's speed-up over eager, batch 64"
L10_COMPILE = "compile time of the first call"
L10_G1 = "CUDA graph: eager → eager replayed, batch 1"
L10_G64 = "CUDA graph: eager → eager replayed, batch 64"
L10_CG1 = "CUDA graph: eager → compiled and replayed, batch 1"
L10_LAUNCHES = "kernel launches, one eager step → one replay"
L11_GLOO = "ms a step, 1 process / 2 processes over gloo, batch 1"
L11_SPLIT = "ms a step, 1 process / 2 processes without all-reduces, batch 1; batch 8"
L11_TOKENS = "2 processes over gloo, the same tokens as lesson 1"
L11_NVLINK = "cost model, NVLink, 2 GPUs, batch 1: weights / all-reduce ms"
L11_PCIE = "cost model, PCIe, 8 GPUs, batch 64: weights / all-reduce ms"
L11_IB1 = "cost model, InfiniBand, 8 GPUs, batch 1: weights / all-reduce ms"
L11_IB64 = "cost model, InfiniBand, 8 GPUs, batch 64: weights / all-reduce ms"
S_STEP = "server: ms per model step of 1 row, eager / compiled / graph replay"
S_FIXED = "server: mixed steps; captures, start → end; compiles, start → end"
S_MEMORY = "server: GPU memory in use over the mixed steps, start → end"
S_TOKENS = "server: one request's tokens equal lesson 01's loop"
GUIDE = "docs/instructors.md"


# Predicates shared by several sentences (the same effect said in a lesson, the README, the guide)
def _cache_saves_a_fraction(f):           # the no-cache step barely grows; cache < 2x
    return f(L01_GROWTH) < 1.5 and f(L01_TPOT, 0) < 2 * f(L01_TPOT, 1)


def _cache_saves_a_multiple(f):           # the no-cache step climbs; the cache > 2x
    return f(L01_GROWTH) > 2 and f(L01_SPEEDUP) > 2


def _rows_nearly_free(f):                 # the whole sweep: the step grows by a fraction
    return f.text(L02_BOUNDS).split(" / ")[1] == "overhead" and f(L02_STEP) < 2


def _rows_add_up(f):                      # the step grows with its rows
    return f(L02_TPOT, 2) > 1.2 * f(L02_TPOT, 0)


def _ratio_largest_at_batch_1(f):
    return f(L10_SP64) < f(L10_SP1)


def _replay_a_launch_or_two(f):
    return f(L10_LAUNCHES, 1) <= 2 < 50 <= f(L10_LAUNCHES, 0)


def _stand_in_no_faster(f):               # a stand-in replay is no compile
    return f(L10_G1) < 0.75 * f(L10_SP1)


def _draft_costs_its_operations(f):          # a large part of a model step, not its weights' share
    return f(L09_DRAFT_STEP) > 0.4


def _pass_nearly_free(f):
    return f(L09_PASS) < 1.3


def _pass_less_than_half_a_step_a_token(f):   # (t5 − t1) / 4 < t1 / 2
    return 1 < f(L09_PASS) < 3


C = Claim
CLAIMS = [
    # --- lesson 01 ---------------------------------------------------------------------------
    C("01-cached-step-flat", "01", "9e50c004", "With the cache a step feeds one token, and its "
      "time grows slowly", (L01_CACHED,), lambda f: f(L01_CACHED) < 2,
      "the cached step grows less than x2 over 200 tokens"),
    C("01-cpu-cache-saves-more-each-token", "01", "9e50c004", "the no-cache line climbs early, "
      "and the cache's saving grows with every token", (L01_GROWTH, L01_SPEEDUP),
      _cache_saves_a_multiple, "the no-cache step grows more than x2 and the cache is more "
      "than 2x faster", CPU),
    C("01-gpu-cache-saves-a-fraction", "01", "9e50c004", "the no-cache line stays nearly flat, "
      "and the cache saves a fraction of a step", (L01_GROWTH, L01_TPOT),
      _cache_saves_a_fraction, "the no-cache step grows less than x1.5 and takes less than "
      "twice the cached step", GPU),
    C("01-summary-gpu", "01", "e439d227", "the no-cache step barely grows and the cache saves a "
      "fraction of a step", (L01_GROWTH, L01_TPOT), _cache_saves_a_fraction,
      "the no-cache step grows less than x1.5 and takes less than twice the cached step", GPU),
    C("01-exercise-1-gpu", "01", "a59557d6", "the ratio stays far below a CPU's", (L01_SPEEDUP,),
      lambda f: f(L01_SPEEDUP) < 2, "the speed-up at 200 tokens is under 2x", GPU),
    # --- lesson 02 ---------------------------------------------------------------------------
    C("02-overhead-bound-at-batch-1", "02", "625316cb", "at batch 1 its overhead is the largest "
      "of the three", (L02_BOUNDS,), lambda f: f.text(L02_BOUNDS).startswith("overhead /"),
      "the bound printed for batch 1 is the overhead"),
    C("02-gpu-overhead-every-batch", "02", "625316cb", "there the overhead is usually the bound "
      "at every batch of the table", (L02_BOUNDS,),
      lambda f: f.text(L02_BOUNDS) == "overhead / overhead",
      "the bound printed for batch 1 and 128 is the overhead", GPU),
    C("02-gpu-small-and-large-gains", "02", "625316cb", "sees small gains from the KV cache",
      (L01_SPEEDUP, L10_G1), lambda f: f(L01_SPEEDUP) < 2 and f(L10_G1) > 3,
      "lesson 1's cache gains under 2x, lesson 10's replayed graph over 3x", GPU),
    C("02-gpu-extra-row-free", "02", "00270849", "while reading or overhead bounds it an extra row "
      "is nearly free", (L02_BOUNDS, L02_STEP), _rows_nearly_free,
      "the step grows less than x2 from batch 1 to 128, bound by overhead at 128", GPU),
    C("02-cpu-costs-add-up", "02", "00270849", "every extra row adds its arithmetic to the step",
      (L02_TPOT,), _rows_add_up, "TPOT at batch 8 more than 20% above batch 1",
      CPU),
    C("02-gpu-throughput-in-proportion", "02", "e0f4c831", "On a GPU, while the step is bound by "
      "the overhead or by reading the weights", (L02_THROUGHPUT, L02_STEP),
      lambda f: f(L02_THROUGHPUT) > 64 and f(L02_STEP) < 2,
      "throughput grows more than x64 over batch 1 to 128, the step less than x2", GPU),
    C("02-cpu-first-doubling", "02", "e0f4c831", "the step grows with the rows",
      (L02_TPOT, L02_TOKENS), lambda f: _rows_add_up(f) and f(L02_TOKENS, 2) < 7.5 * f(L02_TOKENS),
      "TPOT at batch 8 more than 20% above batch 1; throughput at batch 8 under 7.5 times batch "
      "1's", CPU),
    C("02-arithmetic-bound-slower", "02", "e0f4c831", "Once the arithmetic is the bound, every "
      "doubling of the batch makes each step markedly slower", (L02_BOUNDS, L02_STEP),
      lambda f: not f.text(L02_BOUNDS).endswith("arithmetic") or f(L02_STEP) > 3,
      "where batch 128 is bound by arithmetic, the step grows more than x3 from batch 1"),
    C("02-overhead-whole-sweep", "02", "e0f4c831", "the whole sweep lies on the nearly free part",
      (L02_BOUNDS, L02_STEP),
      lambda f: not f.text(L02_BOUNDS).endswith("overhead") or f(L02_STEP) < 2,
      "where batch 128 is still bound by overhead, the step grows less than x2"),
    C("02-summary-gpu", "02", "2945a234", "On a GPU extra rows are therefore cheap",
      (L02_BOUNDS, L02_STEP), _rows_nearly_free,
      "the step grows less than x2 from batch 1 to 128, bound by overhead at 128", GPU),
    C("02-summary-cpu", "02", "2945a234", "every extra row costs its arithmetic",
      (L02_TPOT,), _rows_add_up, "TPOT at batch 8 more than 20% above batch 1",
      CPU),
    C("02-summary-throughput", "02", "2945a234", "Batching raises throughput, and latency with it",
      (L02_THROUGHPUT, L02_LATENCY), lambda f: f(L02_THROUGHPUT) > 2 and f(L02_LATENCY) > 1,
      "throughput more than x2 from batch 1 to 128, latency up"),
    # --- lessons 03 to 05 ---------------------------------------------------------------------
    C("03-far-fewer-steps", "03", "5c800041", "It needs far fewer decode steps", (L03_STEPS,),
      lambda f: f(L03_STEPS) > 2, "static takes more than twice the decode steps"),
    C("03-gpu-passes-pull-below-the-step-ratio", "03", "5c800041", "the extra passes pull the "
      "speed-up below the step ratio", (L03_SPEEDUP, L03_STEPS),
      lambda f: f(L03_SPEEDUP) <= f(L03_STEPS), "continuous / static at most the step ratio",
      GPU),
    C("03-cpu-arithmetic-pushes-above", "03", "5c800041", "that pushes the speed-up above the "
      "step ratio", (L03_SPEEDUP, L03_STEPS), lambda f: f(L03_SPEEDUP) > f(L03_STEPS),
      "continuous / static above the step ratio", CPU),
    C("03-eos-wins-back-less", "03", "89a767c3", "continuous batching only wins back the steps",
      (L03_EOS, L03_SPEEDUP), lambda f: f(L03_EOS) < f(L03_SPEEDUP),
      "with EOS continuous batching gains less than without"),
    C("03-finishes-sooner-by-the-step-ratio", "03", "840ef52d", "finishes sooner, by about the "
      "step ratio", (L03_SPEEDUP, L03_STEPS),
      lambda f: 1 < f(L03_SPEEDUP) and 0.6 < f(L03_SPEEDUP) / f(L03_STEPS) < 1.6,
      "continuous is faster, by 0.6 to 1.6 times the step ratio"),
    C("04-int8-not-faster-by-itself", "04", "3c9e7734", "does not make a model faster by itself",
      (L04_INT8,), lambda f: f(L04_INT8) > 0.95,
      "torchao's int8 step takes at least 95% of the fp32 step's time"),
    C("05-adapter-in-seconds", "05", "12213f60", "train an adapter in seconds", (L05_TRAINING,),
      lambda f: f(L05_TRAINING) < 60, "24 training steps in under a minute"),
    # --- lesson 06 ---------------------------------------------------------------------------
    C("06-cpu-model-gains-less", "06", "746434c9", "the whole model gains far less from "
      "gathering than the adapter part alone did", (L06_LAYER_RATIO, L06_MODEL_RATIO),
      lambda f: f(L06_MODEL_RATIO) < 0.5 * f(L06_LAYER_RATIO),
      "the whole model's loop/gathered under half the layer's", CPU),
    C("06-summary-cpu-small-share", "06", "2fe72483", "a small one where the base layers' "
      "arithmetic dominates", (L06_MODEL_RATIO,), lambda f: f(L06_MODEL_RATIO) < 1.5,
      "the whole toy model's loop/gathered under 1.5x at batch 64", CPU),
    C("06-summary-gpu-most-of-the-step", "06", "2fe72483", "most of the loop's step where each "
      "operation's fixed cost does", (L06_MODEL_RATIO,), lambda f: f(L06_MODEL_RATIO) > 2,
      "the whole toy model's loop/gathered over 2x at batch 64", GPU),
    C("06-exercise-1-differences", "06", "2fe72483-12", "they come out larger than section 2's",
      (L06_MODEL, L06_LAYER),
      lambda f: (f(L06_MODEL, 0) - f(L06_MODEL, 2) > f(L06_MODEL, 1) - f(L06_MODEL, 2)
                 > f(L06_LAYER, 1)) and f(L06_MODEL, 0) - f(L06_MODEL, 2) > f(L06_LAYER, 0),
      "at batch 64 each whole-model difference exceeds section 2's time, the loop's the larger",
      CPU),
    # --- lesson 07 ---------------------------------------------------------------------------
    C("07-clients-share-steps", "07", "5b91a532", "tokens/s climbs with the number of clients, "
      "but more slowly than the number itself", (L07_CLIENTS,),
      lambda f: 1 < f(L07_CLIENTS) < 16, "16 clients get between 1 and 16 times one's tokens/s"),
    # --- lesson 08 ---------------------------------------------------------------------------
    C("08-gpu-ttft-saving-small", "08", "68b72ed6", "so the saving in TTFT is small",
      (L08_PREFIX,), lambda f: f(L08_PREFIX) < 1.5,
      "mean TTFT of requests 1-5 less than 1.5x faster with prefix caching", GPU),
    C("08-cpu-chunks-cut-the-pause", "08", "d4f048ee", "chunks cut the pause a lot", (L08_GAP,),
      lambda f: f(L08_GAP, 1) < 0.75 * f(L08_GAP, 0), "the worst gap at least 25% shorter",
      CPU),
    C("08-long-prompt-pays", "08", "d4f048ee", "its first token comes later", (L08_FIRST,),
      lambda f: f(L08_FIRST, 1) > f(L08_FIRST, 0), "the long prompt's first token later with "
      "chunks"),
    C("08-padded-reserves-more", "08", "4c458347", "reserves more than its rows use",
      (L08_RESERVED,), lambda f: f(L08_RESERVED, 0) > f(L08_RESERVED, 1) > 1,
      "padded reserved/used above paged's, both above 1"),
    C("08-several-times-the-requests", "08", "4c458347", "runs several times as many requests",
      (L08_FIT,), lambda f: f(L08_FIT) == 8 and f(L08_FIT, 1) >= 2 * f(L08_FIT),
      "padded fits 8, paged at least twice as many"),
    C("08-cpu-prefix-much-sooner", "08", "4c458347", "their first token comes much sooner where a "
      "prefill's work sets its pace", (L08_PREFIX,), lambda f: f(L08_PREFIX) > 2,
      "mean TTFT of requests 1-5 more than 2x faster with prefix caching", CPU),
    C("08-gpu-prefix-hardly-sooner", "08", "4c458347", "hardly sooner where its fixed cost does",
      (L08_PREFIX,), lambda f: f(L08_PREFIX) < 1.5,
      "mean TTFT of requests 1-5 less than 1.5x faster with prefix caching", GPU),
    C("08-cpu-chunks-shorten-the-gap", "08", "4c458347", "their worst gap shrinks where a long "
      "prompt makes a long pass", (L08_GAP,), lambda f: f(L08_GAP, 1) < f(L08_GAP, 0),
      "the worst gap is shorter with chunks", CPU),
    C("08-gpu-chunks-do-not", "08", "4c458347", "not where a pass costs about the same whatever "
      "its length", (L08_GAP,), lambda f: f(L08_GAP, 1) > 0.8 * f(L08_GAP, 0),
      "the worst gap with chunks is not 20% shorter", GPU),
    # --- lesson 09 ---------------------------------------------------------------------------
    C("09-gpu-pass-of-a-few", "09", "8b7f1b88", "a pass over a few rows costs little more than "
      "over one", (L09_PASS,), _pass_nearly_free, "a 5-token pass under 1.3x a 1-token pass",
      GPU),
    C("09-cpu-pass-of-a-few", "09", "8b7f1b88", "each extra row or position adds its arithmetic, "
      "though far less than a step", (L09_PASS,), _pass_less_than_half_a_step_a_token,
      "a 5-token pass between 1x and 3x a 1-token pass", CPU),
    C("09-gpu-draft-costs-its-operations", "09", "e5b2bc3a", "a draft step costs what its "
      "operations cost, not what its weights cost", (L09_DRAFT_STEP,),
      _draft_costs_its_operations, "a draft step over 0.4 of a model step", GPU),
    C("09-summary-cpu", "09", "2d8a3fa5-5", "on a CPU a draft step is cheap but a verify pass "
      "grows with its tokens", (L09_DRAFT_STEP, L09_PASS),
      lambda f: f(L09_DRAFT_STEP) < 0.5 and f(L09_PASS) > 1.1,
      "a draft step under half a model step; a 5-token pass over 1.1x a 1-token pass", CPU),
    C("09-summary-gpu", "09", "2d8a3fa5-5", "on a GPU the pass hardly grows, but a draft step "
      "costs what its operations cost", (L09_DRAFT_STEP, L09_PASS),
      lambda f: _pass_nearly_free(f) and _draft_costs_its_operations(f),
      "a 5-token pass under 1.3x a 1-token pass; a draft step over 0.4 of a model step", GPU),
    C("09-lookup-beats-plain-on-a-rhyme", "09", "c13b321f", "beats plain decoding with the same "
      "text", (L09_RHYME,), lambda f: f(L09_RHYME) > 1.5,
      "prompt lookup at k = 8 over 1.5x plain greedy on the rhyme"),
    C("09-thin-margins", "09", "2d8a3fa5-5", "the margins are thin at best", (L09_DRAFT,),
      lambda f: f(L09_DRAFT, 1) < 1.3, "the draft's best k under 1.3x plain greedy"),
    # --- lesson 10 ---------------------------------------------------------------------------
    C("10-over-a-hundred-launches", "10", "a010bb22", "makes over a hundred launches",
      (L10_LAUNCHES,), lambda f: f(L10_LAUNCHES) > 100, "one eager step: over 100 launches",
      GPU),
    C("10-cpu-gains-nothing", "10", "e9e3a37a", "gives the same tokens, and saves no launch",
      (L10_G1, L10_G64, L10_CG1, L10_SP1), _stand_in_no_faster,
      "a stand-in replay at batch 1 gains under 3/4 of what compiling gains", CPU),
    C("10-ratio-falls-with-batch", "10", "c3fafa11", "expect the largest ratio at the smallest "
      "batches", (L10_SP1, L10_SP64), _ratio_largest_at_batch_1,
      "the compiled speed-up at batch 64 is below batch 1's"),
    C("10-cpu-stand-in-no-faster", "10", "e4d6e303", "it stays far from what compiling saved",
      (L10_G1, L10_G64, L10_CG1, L10_SP1),
      _stand_in_no_faster, "a stand-in replay at batch 1 gains under 3/4 of what compiling gains", CPU),
    C("10-gpu-replay-removes-most", "10", "e4d6e303", "a replay removes most of it at every batch "
      "size, and the compiled step gains again", (L10_G1, L10_G64, L10_CG1, L10_SP1),
      lambda f: f(L10_G1) > 2 and f(L10_G64) > 2 and f(L10_CG1) > f(L10_SP1),
      "replays over 2x faster at batch 1 and 64; compiled and replayed faster than compiled",
      GPU),
    C("10-summary-gains", "10", "1f5c14f6", "gained at batch 1 and at batch 64 alike",
      (L10_SP1, L10_SP64, L10_COMPILE),
      lambda f: f(L10_SP64) > 1 and _ratio_largest_at_batch_1(f)
      and f(L10_COMPILE) * 1000 > 100 * f(L10_SP1, 1),
      "speed-up above 1 at batch 64, larger at batch 1; compile over 100 eager steps"),
    C("10-summary-launches", "10", "1f5c14f6", "replays a whole step with a launch or two",
      (L10_LAUNCHES,), _replay_a_launch_or_two,
      "one replay: at most 2 launches; one eager step: at least 50", GPU),
    # --- lesson 11 ---------------------------------------------------------------------------
    C("11-cpu-split-without-all-reduces", "11", "8cc4dc31", "such a step comes out no slower "
      "than the single process's", (L11_SPLIT,),
      lambda f: (all(f(L11_SPLIT, i + 1) < 1.05 * f(L11_SPLIT, i) for i in (0, 2))
                 and f(L11_SPLIT, 1) > 0.6 * f(L11_SPLIT, 0)),
      "without all-reduces the step is at most one process's at batch 1 and 8, and over 0.6 of "
      "it at batch 1", CPU),
    C("11-communication-eats-the-saving", "11", "8cc4dc31", "the communication eats the saving, "
      "or more", (L11_GLOO,), lambda f: f(L11_GLOO, 1) > f(L11_GLOO, 0),
      "2 processes over gloo slower than 1 at batch 1"),
    C("11-nvlink-little", "11", "8d4a5a0c", "the all-reduces cost little next to reading the "
      "weights", (L11_NVLINK,), lambda f: f(L11_NVLINK, 1) < 0.15 * f(L11_NVLINK),
      "NVLink, 2 GPUs, batch 1: all-reduces under 15% of the weights' time"),
    C("11-pcie-matters-at-8", "11", "8d4a5a0c", "start to matter at 8 GPUs", (L11_PCIE,),
      lambda f: f(L11_PCIE, 1) > 0.5 * f(L11_PCIE),
      "PCIe, 8 GPUs, batch 64: all-reduces over half the weights' time"),
    C("11-network-as-much-as-the-weights", "11", "8d4a5a0c", "cost about as much as a GPU's share "
      "of the weights", (L11_IB1, L11_IB64),
      lambda f: 0.5 < f(L11_IB1, 1) / f(L11_IB1) < 1.5 and f(L11_IB64, 1) > f(L11_IB64),
      "InfiniBand, 8 GPUs: all-reduces within 0.5-1.5x the weights at batch 1, above at 64"),
    # --- README ------------------------------------------------------------------------------
    C("readme-02-gpu-row-nearly-free", "README.md", "| 2 | [Batching]", "when an extra row is "
      "nearly free (on a GPU", (L02_BOUNDS, L02_STEP), _rows_nearly_free,
      "the step grows less than x2 from batch 1 to 128, bound by overhead at 128", GPU),
    C("readme-02-cpu-row-not", "README.md", "| 2 | [Batching]", "when it is not (on a CPU",
      (L02_TPOT,), _rows_add_up, "TPOT at batch 8 more than 20% above batch 1",
      CPU),
    C("readme-10-launches", "README.md", "| 10 | [Compilation", "replayed with a launch or two",
      (L10_LAUNCHES,), _replay_a_launch_or_two,
      "one replay: at most 2 launches; one eager step: at least 50", GPU),
    C("readme-server-step", "README.md", "**On a GPU, with CUDA graphs.**", "The replayed decode "
      "step of one row took", (S_STEP,), lambda f: f.quoted(S_STEP),
      "the sentence quotes the record's eager, compiled and replayed step of one row", GPU),
    C("readme-server-fixed", "README.md", "**On a GPU, with CUDA graphs.**", "the graphs and "
      "compiles stayed at their start-up counts", (S_FIXED, S_MEMORY),
      lambda f: (f(S_FIXED, 1) == f(S_FIXED, 2) and f(S_FIXED, 3) == f(S_FIXED, 4)
                 and f.quoted(S_MEMORY) and f"{f(S_FIXED):,.0f}" in f.sentence),
      "captures and compiles equal at start and end; the sentence quotes the steps and memory",
      GPU),
    # --- the instructors' guide --------------------------------------------------------------
    C("guide-01-gpu-fraction", GUIDE, "**01 Text generation.**", "the no-cache line stays nearly "
      "flat and the cache saves a fraction of a step", (L01_GROWTH, L01_TPOT),
      _cache_saves_a_fraction, "the no-cache step grows less than x1.5 and takes less than "
      "twice the cached step", GPU),
    C("guide-01-cpu-climbs", GUIDE, "**01 Text generation.**", "On a laptop's CPU the no-cache "
      "line climbs", (L01_GROWTH, L01_SPEEDUP), _cache_saves_a_multiple,
      "the no-cache step grows more than x2 and the cache is more than 2x faster", CPU),
    C("guide-02-gpu-nearly-free", GUIDE, "**02 Batching.**", "On a GPU reading and overhead are "
      "paid once per step", (L02_BOUNDS, L02_STEP), _rows_nearly_free,
      "the step grows less than x2 from batch 1 to 128, bound by overhead at 128", GPU),
    C("guide-02-cpu-add-up", GUIDE, "**02 Batching.**", "on a CPU the three add up, so every "
      "extra row adds its arithmetic", (L02_TPOT,), _rows_add_up,
      "TPOT at batch 8 more than 20% above batch 1", CPU),
    C("guide-02-gpu-whole-sweep", GUIDE, "**02 Batching.**", "On a GPU this small model stays "
      "bound by its overhead over the whole sweep", (L02_BOUNDS, L02_LATENCY),
      lambda f: f.text(L02_BOUNDS) == "overhead / overhead" and f(L02_LATENCY) < 2,
      "bound by overhead at batch 1 and 128; latency grows less than x2", GPU),
    C("guide-09-gpu-pass", GUIDE, "**09 Speculative decoding**", "on a GPU a pass over k + 1 "
      "tokens costs little more than over one", (L09_PASS,), _pass_nearly_free,
      "a 5-token pass under 1.3x a 1-token pass", GPU),
    C("guide-09-cpu-pass", GUIDE, "**09 Speculative decoding**", "on a CPU more, but far less "
      "than k + 1 steps", (L09_PASS,), _pass_less_than_half_a_step_a_token,
      "a 5-token pass between 1x and 3x a 1-token pass", CPU),
    C("guide-09-draft-costs-its-operations", GUIDE, "**09 Speculative decoding**", "a draft "
      "costs in proportion to its operations", (L09_DRAFT_STEP,), _draft_costs_its_operations,
      "a draft step over 0.4 of a model step", GPU),
    C("guide-10-launches", GUIDE, "**10 Compilation**", "a CUDA graph replays the whole step with "
      "a launch or two", (L10_LAUNCHES,), _replay_a_launch_or_two,
      "one replay: at most 2 launches; one eager step: at least 50", GPU),
    C("guide-10-ratio-falls", GUIDE, "**10 Compilation**", "so it is largest at small batches",
      (L10_SP1, L10_SP64), _ratio_largest_at_batch_1,
      "the compiled speed-up at batch 64 is below batch 1's"),
    C("guide-10-compile-seconds", GUIDE, "**10 Compilation**", "The compile cell (section 5) "
      "prints its compile time", (L10_COMPILE,), lambda f: f(L10_COMPILE) < 60,
      "the first call compiles in under a minute"),
    C("guide-same-tokens-on-the-gpu", GUIDE, "**Numbers differ from the text.**", "the checks "
      "that compare tokens held", (S_TOKENS, L11_TOKENS),
      lambda f: f.text(S_TOKENS) == "True" and f.text(L11_TOKENS) == "True",
      "the server's tokens equal lesson 01's loop; lesson 11's ranks equal lesson 1", GPU),
]


# --- finding a claim's sentence -------------------------------------------------------------

def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@functools.lru_cache(maxsize=None)
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _cell_text(nb: dict, cell_id: str) -> str | None:
    for cell in nb.get("cells", []):
        if cell.get("id") == cell_id and cell.get("cell_type") == "markdown":
            return gpu_figures._text(cell.get("source"))
    return None


def _passage(claim: Claim, text_of: Callable[[str], str | None]) -> str | None:
    """The text (flattened) in which the claim's sentence must be: its lesson cell, or its
    file after the anchor. ``text_of(path)`` reads a file (relative to the repository)."""
    if claim.where in FILES:
        text = text_of(claim.where)
        if text is None or claim.anchor not in text:
            return None
        return _flat(text[text.index(claim.anchor):])
    path = str(lesson_path(claim.where).relative_to(ROOT))
    text = text_of(path)
    try:
        return _flat(_cell_text(json.loads(text), claim.anchor) or "") or None
    except (TypeError, ValueError):
        return None


_ENDS = re.compile(r"[.!?](?=\s|$)|\s-\s|\s\d+\.\s|\|")


def sentence_in(passage: str, words: str) -> str | None:
    """The sentence of ``passage`` that holds ``words``: from the end of the sentence, list item
    or table cell before them to the end of the one they are in."""
    at = passage.find(_flat(words))
    if at < 0:
        return None
    start = max((m.end() for m in _ENDS.finditer(passage, 0, at)), default=0)
    end = next((m.end() for m in _ENDS.finditer(passage, at + len(_flat(words)))), len(passage))
    return passage[start:end].strip(" |-")


def _worktree(path: str) -> str | None:
    try:
        return _read(ROOT / path)
    except OSError:
        return None


def sentence(claim: Claim) -> str:
    """The claim's sentence as the course has it now; LookupError naming what is missing."""
    passage = _passage(claim, _worktree)
    if passage is None:
        raise LookupError(f"claim {claim.id}: {claim.place()} is missing (anchor "
                          f"{claim.anchor!r})")
    found = sentence_in(passage, claim.words)
    if found is None:
        raise LookupError(f"claim {claim.id}: {claim.place()} no longer says {claim.words!r}: "
                          "update the ledger (scripts/claims.py) with the sentence")
    return found


def sentence_hash(text: str) -> str:
    return hashlib.sha256(_flat(text).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def _at_commit(commit: str, path: str) -> str | None:
    try:
        return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def said_at(claim: Claim, commit: str) -> bool:
    """Whether the claim's sentence, as it is now, was already in its place at ``commit``."""
    passage = _passage(claim, lambda path: _at_commit(commit, path))
    return passage is not None and sentence(claim) in passage


# --- the records ----------------------------------------------------------------------------

def figures_of_notebooks(notebooks: dict) -> dict:
    """Label -> value of every lesson figure, from executed notebooks {"01": nb, ...}."""
    return {f.label: gpu_figures.read_figure(notebooks.get(f.lesson), f)
            for f in gpu_figures.FIGURES}


def committed_notebooks() -> dict:
    return {gpu_figures.lesson_number(p): gpu_figures.read_notebook(p)
            for p in sorted((ROOT / "lessons").glob("[0-9]*.ipynb"))}


def _printed_cell(marker: str, lines: list) -> dict:
    return {"cell_type": "code", "source": marker,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": "\n".join(lines)}]}


def figures_of_record(record: dict) -> dict:
    """Label -> value from a GPU record (docs/gpu-run.json): its table of lesson figures, then
    what it quotes whole (lesson 10's CUDA-graph cells, the server check's lines) read with the
    tables' patterns, for figures that its table lacks."""
    values = {row["label"]: row["gpu"] for lesson in record.get("figures", {}).values()
              for row in lesson.get("rows", [])}
    topics = record.get("topics", {})
    cells = [_printed_cell(" ".join(markers), topics.get(topic, []))
             for topic, (_, markers) in gpu_figures.TOPICS.items()]
    cells.append(_printed_cell(gpu_figures.SERVER_MARKER,
                               record.get("server", {}).get("lines", [])))
    quoted = {"cells": cells}
    for figure in gpu_figures.FIGURES + gpu_figures.SERVER_FIGURES:
        if values.get(figure.label, NOT_FOUND) in (NOT_FOUND, "not run", "GPU only"):
            values[figure.label] = gpu_figures.read_figure(quoted, figure)
    return values


@dataclass
class Verdict:
    claim: Claim
    record: str
    status: str                         # HOLDS, FALSE or NO_EVIDENCE
    figures: dict = field(default_factory=dict)
    stale: bool = False

    def line(self) -> str:
        """One line naming the claim, its sentence and the figures."""
        shown = "; ".join(f"{k} = {v}" for k, v in self.figures.items())
        try:
            said = sentence(self.claim)
        except LookupError as exc:
            said = str(exc)
        return (f"claim {self.claim.id} ({self.claim.place()}): {self.status} on "
                f"{RECORDS[self.record]}{' (stale)' if self.stale else ''}: \"{said}\" -- "
                f"{shown} (it needs: {self.claim.says})")


def judge(claim: Claim, values: dict, record: str) -> Verdict:
    figures = {label: values.get(label, NOT_FOUND) for label in claim.figures}
    try:
        said = sentence(claim)
    except LookupError:
        said = ""
    try:
        held = bool(claim.holds(Figures(values, said)))
    except (Missing, ZeroDivisionError, ValueError):
        return Verdict(claim, record, NO_EVIDENCE, figures)
    return Verdict(claim, record, HOLDS if held else FALSE, figures)


def evaluate(values: dict, record: str, claims=None) -> list[Verdict]:
    """The verdicts of every claim that speaks for ``record``, on ``values`` (label -> value)."""
    return [judge(c, values, record) for c in (CLAIMS if claims is None else claims)
            if record in c.records]


def lessons_of(claim: Claim) -> set:
    by_label = {f.label: f.lesson for f in gpu_figures.FIGURES + gpu_figures.SERVER_FIGURES}
    return {by_label[label] for label in claim.figures}


def run_verdicts(notebooks: dict, record: str) -> list[Verdict]:
    """The verdicts on executed lessons {"01": nb, ...} (make test-colab): the claims whose
    figures all come from lessons that ran."""
    claims = [c for c in CLAIMS if lessons_of(c) <= set(notebooks)]
    return evaluate(figures_of_notebooks(notebooks), record, claims)


def gpu_verdicts(record: dict) -> list[Verdict]:
    """The GPU claims judged on ``record``; a claim is stale where the record judged another
    sentence (its hash) or, in an older record without hashes, where the sentence was not yet
    in its place at the record's commit."""
    values = figures_of_record(record)
    judged = {c["id"]: c for c in record.get("claims", [])}
    verdicts = evaluate(values, "gpu")
    for verdict in verdicts:
        claim = verdict.claim
        try:
            now = sentence_hash(sentence(claim))
        except LookupError:
            verdict.stale = True
            continue
        if claim.id in judged and judged[claim.id].get("sentence"):
            verdict.stale = judged[claim.id]["sentence"] != now
        else:
            commit = record.get("commit")
            verdict.stale = not (commit and said_at(claim, commit))
    return verdicts


def record_entries(record: dict, fresh: bool = False) -> list[dict]:
    """What a GPU record keeps of its verdicts: id, place, verdict, figures, and the hash of the
    sentence judged. ``fresh``: the run executed the lessons of this checkout, so every sentence
    is the one judged; else a sentence not yet in place at the record's commit is stale (and
    no hash is kept for it)."""
    verdicts = gpu_verdicts({k: v for k, v in record.items() if k != "claims"})
    entries = []
    for v in verdicts:
        stale = v.stale and not fresh
        try:
            judged = None if stale else sentence_hash(sentence(v.claim))
        except LookupError:
            stale, judged = True, None
        entries.append({"id": v.claim.id, "place": v.claim.place(), "verdict": v.status,
                        "stale": stale, "figures": v.figures, "sentence": judged})
    return entries


def git_commit() -> str:
    """The repository's commit (short), with "+changes" when the course's text differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lessons", *FILES],
                               cwd=ROOT, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty.strip() else "")


def last_change(path: str) -> str:
    """The commit that last changed ``path`` (short), or "unknown"."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h", "--", path], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out or "unknown"


def versions_of(notebooks: dict) -> list[str]:
    """The version lines the lessons' setup cells printed ("torch 2.13.0, transformers ...")."""
    lines = set()
    for nb in notebooks.values():
        code = [c for c in (nb or {}).get("cells", []) if c.get("cell_type") == "code"]
        for cell in code[1:2]:
            first = gpu_figures.printed(cell, ("stdout",)).splitlines()[:1]
            lines.update(line for line in first if line.startswith("torch "))
    return sorted(lines)


# --- the command line -----------------------------------------------------------------------

def counts() -> list[str]:
    """Claims per place, and how many speak for each record."""
    places = {}
    for c in CLAIMS:
        key = f"lesson {c.where}" if c.where not in FILES else c.where
        row = places.setdefault(key, {"claims": 0, **{r: 0 for r in RECORDS}})
        row["claims"] += 1
        for r in c.records:
            row[r] += 1
    lines = [f"{'':22} {'claims':>6} {'cpu':>4} {'colab':>5} {'gpu':>4}"]
    for key, row in places.items():
        lines.append(f"{key:22} {row['claims']:6} {row['cpu']:4} {row['colab']:5} {row['gpu']:4}")
    total = {k: sum(r[k] for r in places.values()) for k in ("claims", *RECORDS)}
    lines.append(f"{'all':22} {total['claims']:6} {total['cpu']:4} {total['colab']:5} "
                 f"{total['gpu']:4}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", action="store_true", help="claims per lesson and record only")
    args = ap.parse_args(argv)
    if args.counts:
        print("\n".join(counts()))
        return 0
    notebooks = committed_notebooks()
    print(f"committed CPU outputs (lessons/ last changed in {last_change('lessons')}; "
          f"{'; '.join(versions_of(notebooks))}):")
    cpu = evaluate(figures_of_notebooks(notebooks), "cpu")
    for v in cpu:
        print(f"  {v.status:11} {v.claim.id}")
    record = json.loads(GPU_RECORD.read_text()) if GPU_RECORD.exists() else {}
    versions = ", ".join(f"{k} {v}" for k, v in record.get("versions", {}).items())
    print(f"GPU record ({record.get('device', 'none')}, commit {record.get('commit', 'unknown')}"
          f"; {versions}):")
    gpu = gpu_verdicts(record)
    for v in gpu:
        print(f"  {v.status:11} {'stale' if v.stale else 'current':7} {v.claim.id}")
    bad = [v for v in cpu if v.status != HOLDS] + [v for v in gpu if v.status == FALSE
                                                     and not v.stale]
    for v in bad:
        print(v.line(), file=sys.stderr)
    print(f"{len(cpu)} claims on the CPU outputs, {sum(v.status == HOLDS for v in cpu)} hold; "
          f"{len(gpu)} on the GPU record: {sum(v.status == HOLDS for v in gpu)} hold, "
          f"{sum(v.status == FALSE for v in gpu)} false, "
          f"{sum(v.status == NO_EVIDENCE for v in gpu)} without evidence, "
          f"{sum(v.stale for v in gpu)} stale")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
