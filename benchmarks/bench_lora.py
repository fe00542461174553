"""Lesson 06's figures: one batch, one adapter per row -- a loop versus a gathered product.

    python -m benchmarks.bench_lora              # about a minute (1 torch thread, 2-core CPU)
    python -m benchmarks.bench_lora --quick      # a smoke test of everything (about 30 s)

(from the repository's root folder, as every benchmark: ``benchmarks`` is a package there).

1. The toy model (hidden 1024, ten colour words) with 64 random adapters of rank 2: the time
   of one decoding step (one token per row) for batch sizes 1..64, with the adapters' part
   computed by ``linear_lora_loop`` (one row at a time) or ``linear_lora_gathered``
   (``index_select`` + ``torch.bmm``). Timed twice: the adapter part alone, and the whole
   model (embedding -> linear + adapters -> lm_head).
2. The toy model, a grid: batch sizes 1..64 times the number of distinct adapters in the batch
   (1..64, never more than the batch). ``distinct`` adapters are drawn from the 64 (seeded)
   and the rows take them in turn (round robin), so every one of them is used. Only the
   adapters' part is timed, loop versus gathered, alternating (median of the repetitions).
3. The bundled model with the shipped adapters: a batch of 32 task prompts (left-padded),
   row i using adapter i mod (adapters + 1) and the last of each cycle using none; greedy
   generation of the whole answers (at most ``--tokens`` tokens) with ``model.generate``
   through our ``MultiLora`` layers versus peft's mixed-adapter batches
   (``generate(..., adapter_names=[...])``), and of the first token alone. The tokens must be
   identical; the base model without adapters is timed as the floor.
4. The bundled model, a grid: 64 random LoRA adapters (rank 8, on every ``c_attn``, ``c_proj``
   and ``c_fc``; A and B drawn from a seeded generator, so each adapter really changes the
   output) are saved with peft's ``save_pretrained`` into a temporary folder and loaded twice:
   into a peft model (``PeftModel.from_pretrained`` + ``load_adapter``) and into ours
   (``load_adapters``). For batch sizes 1..64 times distinct adapters 1..64 (never more than
   the batch; rows take them in turn), short left-padded prompts are prefilled once per model,
   then ONE decoding step (one new token per row, on top of the KV cache) is timed for the base
   model, ours (``set_rows`` with the rows it already has, then the forward pass), ours when
   the rows have just changed (``set_rows`` has to gather every row's A and B first) and peft
   (``forward(..., adapter_names=[...])``), alternating, median of the repetitions. Before
   each timed step the cache is cropped back to the prompt, so every repetition sees the same
   cache. Per cell the script checks that ours' and peft's logits agree, that the adapters
   change the logits, and that the cached step gives the logits of a full forward pass.

The toy model always runs on the CPU; ``--device`` moves the bundled model. Writes
benchmarks/results/ (or ``--out``): lora.json (every number, every repetition), lora.md (the
tables), lora_toy.png and lora_grid.png, and prints the markdown. Exits with status 1 when a check
fails (tokens or logits that differ).
"""

import argparse
import datetime
import os
import pathlib
import platform
import sys
import tempfile
import time
import warnings

import torch

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import load_average, machine, markdown_table, numbers, write_results
from benchmarks.timing import Candidate, calls_per_sample, crop_cache, time_in_turns
from helpers.batching import position_ids_from_mask
from helpers.corpus import task_examples, task_prompt
from helpers.lora import (ADAPTERS_DIR, NO_ADAPTER, ToyMultiLoraModel, linear_lora_gathered,
                          linear_lora_loop, load_adapters, random_adapters, shipped_adapters)
from helpers.models import load_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The model of parts 3 and 4 (the shipped adapters and GPT-2's layer names need it).
MODEL = "bundled"

#: Toy grid (part 2): batch sizes times distinct adapters in the batch.
TOY_BATCHES = [1, 2, 4, 8, 16, 32, 64]
TOY_DISTINCT = [1, 2, 4, 8, 16, 32, 64]
#: Real-model grid (part 4), and the random adapters made for it.
GRID_BATCHES = [1, 4, 16, 32, 64]
GRID_DISTINCT = [1, 4, 16, 32, 64]
GRID_ADAPTERS = max(GRID_DISTINCT)
GRID_RANK, GRID_ALPHA = 8, 16
GRID_TARGETS = ["c_attn", "c_proj", "c_fc"]
#: Cells timed again with a peft model that holds only the batch's adapters (see part 4).
FEW_LOADED_CELLS = [(1, 1), (32, 4)]
#: ours' and peft's logits must agree this closely (float32 sums in a different order).
LOGITS_ATOL = LOGITS_RTOL = 1e-4


# --- the rows of a batch ---------------------------------------------------------------

def rows_for(batch: int, distinct: int, pool: int, seed: int) -> list[int]:
    """Adapter indices for the rows of a batch: ``distinct`` adapters drawn (seeded) from
    0..pool-1, taken in turn by the rows, so each of them serves at least one row."""
    if not 1 <= distinct <= min(batch, pool):
        raise ValueError(f"need 1 <= distinct <= batch and pool, got distinct={distinct}, "
                         f"batch={batch}, pool={pool}")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(pool, generator=generator)[:distinct].tolist()
    return [chosen[i % distinct] for i in range(batch)]


# --- parts 1 and 2: the toy model --------------------------------------------------------

@torch.no_grad()
def bench_toy(args) -> list[dict]:
    loras_a, loras_b = random_adapters(args.adapters, hidden=1024, rank=args.rank, seed=0)
    models = {"loop": ToyMultiLoraModel(linear_lora_loop),
              "gathered": ToyMultiLoraModel(linear_lora_gathered)}
    functions = {"loop": linear_lora_loop, "gathered": linear_lora_gathered}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in TOY_BATCHES:
        ids = torch.randint(10, (batch, 1), generator=gen)
        indices = torch.randint(args.adapters, (batch,), generator=gen)
        x = models["loop"].embedding(ids)
        row = {"batch": batch}
        for name in ("loop", "gathered"):
            fn, model = functions[name], models[name]
            row[f"{name}_lora_s"] = time_in_turns(
                {"lora": lambda: fn(x, loras_a, loras_b, indices)}, args.repeats * 4,
                warmup=2).median("lora")
            row[f"{name}_model_s"] = time_in_turns(
                {"model": lambda: model(ids, loras_a, loras_b, indices)}, args.repeats * 4,
                warmup=2).median("model")
        row["lora_ratio"] = row["loop_lora_s"] / row["gathered_lora_s"]
        row["model_ratio"] = row["loop_model_s"] / row["gathered_model_s"]
        same = torch.allclose(models["loop"](ids, loras_a, loras_b, indices),
                              models["gathered"](ids, loras_a, loras_b, indices), atol=1e-4)
        row["same_logits"] = bool(same)
        print(f"toy batch {batch:3d}: adapters loop {row['loop_lora_s'] * 1e3:7.3f} ms, "
              f"gathered {row['gathered_lora_s'] * 1e3:7.3f} ms ({row['lora_ratio']:5.1f}x); "
              f"whole model {row['model_ratio']:4.1f}x", flush=True)
        rows.append(row)
    return rows


@torch.no_grad()
def bench_toy_grid(args) -> list[dict]:
    """Part 2: the adapters' part alone, loop versus gathered, per (batch, distinct) cell."""
    loras_a, loras_b = random_adapters(args.adapters, hidden=1024, rank=args.rank, seed=0)
    embedding = ToyMultiLoraModel().embedding
    gen = torch.Generator().manual_seed(1)
    cells = []
    for batch in TOY_BATCHES:
        x = embedding(torch.randint(10, (batch, 1), generator=gen))  # one token per row
        for distinct in [d for d in TOY_DISTINCT if d <= min(batch, args.adapters)]:
            seed = batch * 100 + distinct
            indices = torch.tensor(rows_for(batch, distinct, args.adapters, seed=seed))
            loop = lambda: linear_lora_loop(x, loras_a, loras_b, indices)  # noqa: E731
            gathered = lambda: linear_lora_gathered(x, loras_a, loras_b, indices)  # noqa: E731
            same = torch.allclose(loop(), gathered(), atol=1e-5)
            # Both use as many calls per sample as the faster one needs to fill one.
            number = calls_per_sample(gathered)
            timings = time_in_turns({"loop": loop, "gathered": gathered},
                                    repeats=args.repeats * 4, warmup=2, number=number)
            cell = {"batch": batch, "distinct": distinct, "calls_per_sample": number,
                    "loop_s": timings.median("loop"), "gathered_s": timings.median("gathered"),
                    "same_output": bool(same), "all_times_s": timings.seconds,
                    "threads": timings.threads}
            cell["loop_over_gathered"] = cell["loop_s"] / cell["gathered_s"]
            cells.append(cell)
        last = [c for c in cells if c["batch"] == batch]
        print(f"toy grid, batch {batch:3d}: loop / gathered "
              + ", ".join(f"{c['loop_over_gathered']:.1f}x ({c['distinct']} adapters)"
                          for c in last), flush=True)
    return cells


# --- part 3: the bundled model, shipped adapters, whole answers ---------------------------

def bench_real(args) -> dict:
    names = shipped_adapters()
    if not names:
        raise SystemExit("no shipped adapters: run scripts/train_adapters.py first")
    ours, tokenizer = load_model(MODEL, device=args.device)
    lora = load_adapters(ours, names)
    peft_model = load_peft({name: ADAPTERS_DIR / name for name in names}, args.device)
    plain, _ = load_model(MODEL, device=args.device)

    cycle = [*names, None]
    rows = [cycle[i % len(cycle)] for i in range(args.batch)]
    sentences = [s for s, _ in task_examples("entities", 31, args.batch)]
    batch = tokenizer([task_prompt(s) for s in sentences], return_tensors="pt",
                      padding=True).to(args.device)
    peft_rows = [r or NO_ADAPTER for r in rows]

    def runner(kind, new_tokens):
        gen = dict(max_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id)
        if kind == "ours":
            return lambda: (lora.set_rows(rows), ours.generate(**batch, **gen))[1]
        if kind == "peft":
            return lambda: peft_model.generate(**batch, adapter_names=peft_rows, **gen)
        return lambda: plain.generate(**batch, **gen)

    kinds = ("ours", "peft", "base")
    with torch.no_grad():
        tokens = {k: runner(k, args.tokens)() for k in ("ours", "peft")}
        identical = tokens["ours"].tolist() == tokens["peft"].tolist()
        timings = time_in_turns({f"{k}_{n}": runner(k, count) for k in kinds
                                 for n, count in (("first", 1), ("all", args.tokens))},
                                repeats=args.repeats, device=args.device)
    new_tokens = tokens["ours"].shape[1] - batch.input_ids.shape[1]
    med = {key: timings.median(key) for key in timings.seconds}
    result = {"batch": args.batch, "adapters": names, "rows": peft_rows,
              "prompt_tokens": int(batch.input_ids.shape[1]), "new_tokens": int(new_tokens),
              "identical_tokens": identical, "all_times_s": timings.seconds,
              "threads": timings.threads}
    for k in kinds:
        result[k] = {"first_token_s": med[f"{k}_first"], "total_s": med[f"{k}_all"],
                     "per_token_s": (med[f"{k}_all"] - med[f"{k}_first"]) / max(1, new_tokens - 1)}
    for what in ("first_token_s", "per_token_s", "total_s"):
        result[f"peft_over_ours_{what}"] = result["peft"][what] / result["ours"][what]
        # the most any adapter layer could gain over peft: adapters that cost nothing
        result[f"peft_over_base_{what}"] = result["peft"][what] / result["base"][what]
    print(f"real model, batch {args.batch}, {new_tokens} new tokens: total ours "
          f"{result['ours']['total_s']:.3f} s, peft {result['peft']['total_s']:.3f} s "
          f"({result['peft_over_ours_total_s']:.2f}x), base {result['base']['total_s']:.3f} s; "
          f"identical tokens: {identical}", flush=True)
    return result


# --- part 4: the bundled model, random adapters, one decoding step -------------------------

def save_random_adapters(folder: pathlib.Path, count: int, device) -> dict[str, pathlib.Path]:
    """Write ``count`` random LoRA adapters for the bundled model with peft's
    ``save_pretrained``, one sub-folder each; returns ``{name: folder}``.

    peft makes the LoRA layers once; for adapter i, every A and B is then filled from a
    generator seeded with i (A ~ N(0, 1/in), B ~ N(0, 0.01/r): not zero, unlike a fresh
    peft adapter, so each adapter really changes the logits) and saved.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=GRID_RANK, lora_alpha=GRID_ALPHA, target_modules=GRID_TARGETS,
                        fan_in_fan_out=True,  # GPT-2's Conv1D stores its weight as (in, out)
                        init_lora_weights=False)
    model, _ = load_model(MODEL, device=device)
    with warnings.catch_warnings():  # a deprecation notice peft triggers in transformers 5
        warnings.simplefilter("ignore", FutureWarning)
        maker = get_peft_model(model, config)
    folders = {}
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for key, weight in maker.named_parameters():
                if ".lora_A." in key:    # (r, in)
                    std = weight.shape[1] ** -0.5
                elif ".lora_B." in key:  # (out, r)
                    std = 0.1 * weight.shape[1] ** -0.5
                else:
                    continue
                weight.copy_(torch.randn(weight.shape, generator=generator) * std)
        name = f"random{i:02d}"
        folders[name] = folder / name
        maker.save_pretrained(folders[name])  # adapter_config.json + adapter_model.safetensors
    return folders


def short_prompts(batch: int) -> list[str]:
    """``batch`` short prompts of 3 to 7 words (so the batch needs left padding)."""
    sentences = [s for s, _ in task_examples("entities", 7, batch)]
    return [" ".join(s.split()[:3 + i % 5]) for i, s in enumerate(sentences)]


@torch.no_grad()
def grid_cell(models: dict, lora, tokenizer, names: list[str], batch: int, distinct: int,
              repeats: int, device) -> dict:
    """One cell of part 4: prefill, checks, then the timed decoding step of each kind."""
    rows = [names[i] for i in rows_for(batch, distinct, len(names), seed=batch * 100 + distinct)]
    inputs = tokenizer(short_prompts(batch), return_tensors="pt", padding=True).to(device)
    prompt_length = inputs.input_ids.shape[1]
    caches, step = prefill(models, lora, rows, inputs)

    def run(kind):
        if kind == "base":
            return lambda: models["base"](**step, past_key_values=caches["base"]).logits
        if kind == "ours":  # set_rows with the rows it already has costs almost nothing
            return lambda: (lora.set_rows(rows),
                            models["ours"](**step, past_key_values=caches["ours"]).logits)[1]
        return lambda: models["peft"](**step, past_key_values=caches["peft"],
                                      adapter_names=rows).logits

    def prepare(kind, forget_rows=False):
        def fn():
            crop_cache(caches[kind], prompt_length)
            if forget_rows:  # the next set_rows must gather every row's A and B again
                lora.set_rows(None)
        return fn

    logits = {}
    for kind in ("base", "ours", "peft"):
        prepare(kind)()
        logits[kind] = run(kind)()
    # The same step without a cache, from the whole sequence: checks masks and positions.
    whole = torch.cat([inputs.input_ids, step["input_ids"]], 1)
    full = models["ours"](input_ids=whole, attention_mask=step["attention_mask"],
                          position_ids=position_ids_from_mask(step["attention_mask"]))

    timings = time_in_turns({"base": Candidate(run("base"), prepare("base")),
                             "ours": Candidate(run("ours"), prepare("ours")),
                             "ours_new_rows": Candidate(run("ours"), prepare("ours", True)),
                             "peft": Candidate(run("peft"), prepare("peft"))},
                            repeats=repeats, warmup=2, device=device)
    prepare("ours")()
    repeated = run("ours")()  # after all the repetitions: the cache must be as it was
    cell = {"batch": batch, "distinct": distinct, "prompt_tokens": prompt_length,
            "rows": rows, "all_times_s": timings.seconds, "threads": timings.threads,
            **cell_checks(logits, full.logits[:, -1:], repeated)}
    for kind in timings.seconds:
        cell[f"{kind}_s"] = timings.median(kind)
    cell["peft_over_ours"] = cell["peft_s"] / cell["ours_s"]
    cell["peft_over_ours_new_rows"] = cell["peft_s"] / cell["ours_new_rows_s"]
    cell["ours_over_base"] = cell["ours_s"] / cell["base_s"]
    cell["peft_over_base"] = cell["peft_s"] / cell["base_s"]
    return cell


def prefill(models: dict, lora, rows: list[str], inputs) -> tuple[dict, dict]:
    """Prefill the prompts once with each kind of model: their KV caches, and the inputs of
    the decoding step, in which every kind gets the same token per row (ours' greedy one)."""
    mask = inputs.attention_mask
    # Left padding: a row's positions count its real tokens only (0, 1, 2 ... after the pads).
    prompts = dict(input_ids=inputs.input_ids, attention_mask=mask,
                   position_ids=position_ids_from_mask(mask), use_cache=True)
    lora.set_rows(rows)
    prefilled = {"base": models["base"](**prompts),
                 "ours": models["ours"](**prompts),
                 "peft": models["peft"](**prompts, adapter_names=rows)}
    next_ids = prefilled["ours"].logits[:, -1:].argmax(-1)
    step = dict(input_ids=next_ids, attention_mask=torch.cat([mask, torch.ones_like(next_ids)], 1),
                position_ids=mask.sum(-1, keepdim=True), use_cache=True)
    return {kind: out.past_key_values for kind, out in prefilled.items()}, step


def cell_checks(logits: dict, full_forward, repeated) -> dict:
    """A grid cell's checks: ours and peft agree, the adapters change the logits, the cached
    step gives the full forward pass's logits, and repeating the step leaves the cache as it was."""
    return {
        "same_logits": bool(torch.allclose(logits["ours"], logits["peft"],
                                           atol=LOGITS_ATOL, rtol=LOGITS_RTOL)),
        "max_diff_ours_peft": float((logits["ours"] - logits["peft"]).abs().max()),
        "max_diff_ours_base": float((logits["ours"] - logits["base"]).abs().max()),
        "adapters_change_logits": not torch.allclose(logits["ours"], logits["base"],
                                                     atol=100 * LOGITS_ATOL),
        "cached_step_matches_full_forward": bool(torch.allclose(
            full_forward, logits["ours"], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)),
        "cache_unchanged_by_repetitions": bool(torch.equal(repeated, logits["ours"]))}


def load_peft(folders: dict[str, pathlib.Path], device):
    """A fresh bundled model with the adapters of ``folders`` loaded the peft way."""
    from peft import PeftModel

    names = list(folders)
    with warnings.catch_warnings():  # a deprecation notice peft triggers in transformers 5
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(load_model(MODEL, device=device)[0],
                                          folders[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    return model.eval()


def bench_real_grid(args) -> dict:
    """Part 4: make the random adapters, load them into peft and into ours, time the grid."""
    tokenizer = load_model(MODEL, device="cpu")[1]
    setup = {}
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        start = time.perf_counter()
        folders = save_random_adapters(pathlib.Path(tmp), GRID_ADAPTERS, args.device)
        setup["make_and_save_s"] = time.perf_counter() - start
        names = list(folders)

        start = time.perf_counter()
        peft_model = load_peft(folders, args.device)
        setup["peft_load_s"] = time.perf_counter() - start

        start = time.perf_counter()
        ours = load_model(MODEL, device=args.device)[0]
        lora = load_adapters(ours, folders)
        setup["ours_load_s"] = time.perf_counter() - start

        # For FEW_LOADED_CELLS: peft models that hold only the first `distinct` adapters.
        few = {d: load_peft({n: folders[n] for n in names[:d]}, args.device)
               for d in sorted({d for _, d in FEW_LOADED_CELLS})}
    print(f"real-model grid: {len(names)} random adapters made and saved in "
          f"{setup['make_and_save_s']:.1f} s; loaded by peft in {setup['peft_load_s']:.1f} s, "
          f"by ours in {setup['ours_load_s']:.1f} s", flush=True)
    models = {"base": load_model(MODEL, device=args.device)[0], "ours": ours, "peft": peft_model}

    cells = []
    for batch in GRID_BATCHES:
        for distinct in [d for d in GRID_DISTINCT if d <= batch]:
            cell = grid_cell(models, lora, tokenizer, names, batch, distinct,
                             repeats=args.repeats * 4, device=args.device)
            cells.append(cell)
            print(f"real grid, batch {batch:2d}, {distinct:2d} adapters: base "
                  f"{cell['base_s'] * 1e3:6.2f} ms, ours {cell['ours_s'] * 1e3:6.2f} ms, peft "
                  f"{cell['peft_s'] * 1e3:7.2f} ms; peft / ours {cell['peft_over_ours']:5.2f}x; "
                  f"same logits: {cell['same_logits']}", flush=True)

    # peft's cost per forward grows with the adapters it holds, used or not. The same kind of
    # cell again, with a peft model that holds only the adapters the batch uses.
    few_loaded = []
    for batch, distinct in FEW_LOADED_CELLS:
        cell = grid_cell({**models, "peft": few[distinct]}, lora, tokenizer, names[:distinct],
                         batch, distinct, repeats=args.repeats * 4, device=args.device)
        cell["peft_adapters_loaded"] = distinct
        few_loaded.append(cell)
        print(f"real grid, batch {batch:2d}, {distinct:2d} adapters, only those loaded in peft: "
              f"peft {cell['peft_s'] * 1e3:7.2f} ms; peft / ours {cell['peft_over_ours']:5.2f}x",
              flush=True)
    return {"adapters": len(names), "rank": GRID_RANK, "lora_alpha": GRID_ALPHA,
            "target_modules": GRID_TARGETS, "setup": setup, "cells": cells,
            "few_loaded": few_loaded}


# --- plots ---------------------------------------------------------------------------------

def subtitle(result) -> str:
    m = result["machine"]
    return f"{m['device']}, {m['threads']} torch thread(s), torch {m['torch']}, {result['date']}"


def plot_toy(result, path: pathlib.Path) -> None:
    """lora_toy.png: the toy model's times against the batch size (left), and loop / gathered
    over the grid, one line per number of distinct adapters (right)."""
    plt = pyplot()

    toy, grid = result["toy"], result["toy_grid"]
    batches = [r["batch"] for r in toy]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, colour in (("loop", "tab:red"), ("gathered", "tab:blue")):
        left.plot(batches, [r[f"{name}_lora_s"] * 1e3 for r in toy], "o-", color=colour,
                  label=f"{name}: adapters' part")
        left.plot(batches, [r[f"{name}_model_s"] * 1e3 for r in toy], "s--", color=colour,
                  alpha=0.6, label=f"{name}: whole model")
    left.set(xscale="log", yscale="log", xlabel="batch size (rows, one token each)",
             ylabel="time of one decoding step (ms)",
             title=f"Time per step, {result['args']['adapters']} adapters")
    right.axhline(1, color="grey", linewidth=0.8)
    for distinct in sorted({c["distinct"] for c in grid}):
        cells = [c for c in grid if c["distinct"] == distinct]
        right.plot([c["batch"] for c in cells], [c["loop_over_gathered"] for c in cells], "o-",
                   label=f"{distinct} distinct")
    right.set(xscale="log", xlabel="batch size (rows, one token each)",
              ylabel="loop time / gathered time (×)",
              title="Adapters' part: loop / gathered, by adapters in the batch")
    for axis in (left, right):
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.minorticks_off()
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"Toy model (hidden 1024, rank {result['args']['rank']}): one adapter per "
                 f"row, a loop versus a gathered product\n{subtitle(result)}")
    save_figure(fig, path, dpi=120)


def plot_grid(result, path: pathlib.Path) -> None:
    """lora_grid.png: peft / ours for one decoding step, a heatmap over batch x adapters."""
    plt = pyplot()
    import numpy as np

    grid = result["real_grid"]
    ratio = np.full((len(GRID_BATCHES), len(GRID_DISTINCT)), np.nan)
    for c in grid["cells"]:
        i, j = GRID_BATCHES.index(c["batch"]), GRID_DISTINCT.index(c["distinct"])
        ratio[i, j] = c["peft_over_ours"]
    fig, axis = plt.subplots(figsize=(7.5, 5.8))
    image = axis.imshow(np.ma.masked_invalid(ratio), cmap="OrRd", origin="lower",
                        vmin=min(1.0, np.nanmin(ratio)))
    for i, batch in enumerate(GRID_BATCHES):
        for j, distinct in enumerate(GRID_DISTINCT):
            if np.isnan(ratio[i, j]):
                axis.text(j, i, "more adapters\nthan rows", ha="center", va="center",
                          color="grey", fontsize=7)
                continue
            dark = ratio[i, j] > np.nanmin(ratio) + 0.6 * (np.nanmax(ratio) - np.nanmin(ratio))
            axis.text(j, i, f"{ratio[i, j]:.2f}×", ha="center", va="center",
                      color="white" if dark else "black", fontsize=10)
    axis.set_xticks(range(len(GRID_DISTINCT)), [str(d) for d in GRID_DISTINCT])
    axis.set_yticks(range(len(GRID_BATCHES)), [str(b) for b in GRID_BATCHES])
    axis.set(xlabel="distinct adapters in the batch", ylabel="batch size (rows)")
    fig.colorbar(image, ax=axis, label="peft time / ours time (above 1: ours is faster)")
    axis.set_title(f"One decoding step of the bundled model, {grid['adapters']} random LoRA "
                   f"adapters (r={grid['rank']}) loaded:\ntime of peft (adapter_names=) / time "
                   f"of ours (MultiLora)\n"
                   f"{subtitle(result)}", fontsize=10)
    save_figure(fig, path, dpi=120)


# --- markdown ------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def ratio_matrix(cells, batches, distincts, key) -> list[str]:
    """A markdown table: one row per batch size, one column per distinct-adapter count."""
    by_cell = {(c["batch"], c["distinct"]): c[key] for c in cells}
    rows = [[b] + [f"{by_cell[b, d]:.2f}x" if (b, d) in by_cell else "" for d in distincts]
            for b in batches]
    return markdown_table(["batch \\ adapters", *map(str, distincts)], rows,
                          "r" * (len(distincts) + 1))


def markdown(result) -> str:
    m = result["machine"]
    lines = [
        "# Multi-LoRA: one batch, one adapter per row", "",
        f"{result['date']}, {m['device']} ({m['cpu']}, {m['cores']} cores; load average "
        f"{m['load_average']} before the run), {m['threads']} torch thread(s), torch {m['torch']}, "
        f"transformers {m['transformers']}, peft {m['peft']}. Median wall times; they change "
        "from run to run." + (" **Smoke run (`--quick`): too few repetitions to quote.**"
                              if result["args"]["quick"] else ""), "",
    ]
    lines += toy_markdown(result) + toy_grid_markdown(result)
    if result.get("real"):
        lines += real_markdown(result["real"])
    if result.get("real_grid"):
        lines += real_grid_markdown(result["real_grid"], result["repeats"] * 4)
        lines += few_loaded_markdown(result["real_grid"])
    return "\n".join(lines) + "\n"


def toy_markdown(result) -> list[str]:
    rows = [[r["batch"], f"{r['loop_lora_s'] * 1e3:.3f} ms", f"{r['gathered_lora_s'] * 1e3:.3f} ms",
             f"{r['lora_ratio']:.1f}x", f"{r['loop_model_s'] * 1e3:.3f} ms",
             f"{r['gathered_model_s'] * 1e3:.3f} ms", f"{r['model_ratio']:.1f}x"]
            for r in result["toy"]]
    lines = [
        f"## Toy model: {result['args']['adapters']} random adapters of rank "
        f"{result['args']['rank']}, hidden 1024, one token per row", "",
        *markdown_table(["batch", "adapters: loop", "adapters: gathered", "loop / gathered",
                         "whole model: loop", "whole model: gathered", "loop / gathered"],
                        rows, "rrrrrrr"),
        "", "The \"adapters\" columns time `linear_lora_loop` / `linear_lora_gathered` "
        "alone; the whole model adds the base linear layer (1024 × 1024) and the output "
        "layer, which are the same for both."]
    wide = result.get("toy_all_cores")
    if wide:
        lines += ["", f"The same with all {wide['threads']} cores ({wide['threads']} torch "
                  "threads): loop / gathered, adapters alone, by batch size: "
                  + ", ".join(f"{r['batch']}: {r['lora_ratio']:.1f}x" for r in wide["rows"])
                  + ". The gathered product spreads over the threads; the loop's tiny "
                  "products cannot, so the gap widens with more cores."]
    return lines


def toy_grid_markdown(result) -> list[str]:
    grid = result["toy_grid"]
    rows = [[c["batch"], c["distinct"], f"{c['loop_s'] * 1e3:.4f} ms",
             f"{c['gathered_s'] * 1e3:.4f} ms", f"{c['loop_over_gathered']:.2f}x"] for c in grid]
    return [
        "", "## Toy model: batch size × distinct adapters in the batch", "",
        f"`distinct` of the {result['args']['adapters']} adapters (seeded choice), taken in "
        "turn by the rows. The adapters' part alone, loop and gathered alternating, "
        f"{result['repeats'] * 4} samples each (a sample averages enough calls to last "
        "≥ 0.5 ms). loop time / gathered time:", "",
        *ratio_matrix(grid, TOY_BATCHES, TOY_DISTINCT, "loop_over_gathered"), "",
        *markdown_table(["batch", "adapters in the batch", "loop", "gathered", "loop / gathered"],
                        rows, "rrrrr"),
        "", "Both functions work row by row (the loop multiplies each row by its "
        "adapter, the gathered version copies each row's A and B), so their cost follows "
        "the batch size, whichever adapters the rows use.", "",
        "![Toy model: time against batch size, and loop / gathered](lora_toy.png)"]


def real_markdown(real) -> list[str]:
    def row(label, r):
        return [label, f"{r['first_token_s'] * 1e3:.0f} ms", f"{r['per_token_s'] * 1e3:.1f} ms",
                f"{r['total_s']:.2f} s"]

    ratios = [[label] + [f"{real[f'{key}_{what}']:.2f}x" for what in
                         ("first_token_s", "per_token_s", "total_s")]
              for label, key in (("peft / ours", "peft_over_ours"),
                                 ("peft / base model (the ceiling: adapters that cost nothing)",
                                  "peft_over_base"))]
    ratios[0][3] = f"**{ratios[0][3]}**"
    return [
        "", f"## Bundled model, shipped adapters, batch {real['batch']}", "",
        f"Adapters {', '.join(real['adapters'])} and none, cycling over the rows; "
        f"{real['prompt_tokens']} prompt tokens (left-padded), {real['new_tokens']} new "
        "tokens (greedy `generate`, until every row has finished its answer). First token "
        "= `generate(max_new_tokens=1)` (mostly the prefill); per token = the rest divided "
        "by the remaining tokens.", "",
        *markdown_table(["", "first token", "per token after it", "whole answers"],
                        [row("base model, no adapters", real["base"]),
                         row("ours (`MultiLora`, gathered)", real["ours"]),
                         row("peft (`adapter_names=`)", real["peft"]), *ratios], "lrrr"),
        "", f"Identical tokens: {real['identical_tokens']}.",
    ]


def real_grid_markdown(rgrid, samples: int) -> list[str]:
    cells, setup = rgrid["cells"], rgrid["setup"]
    rows = [[c["batch"], c["distinct"], ms(c["base_s"]), ms(c["ours_s"]), ms(c["ours_new_rows_s"]),
             ms(c["peft_s"]), f"**{c['peft_over_ours']:.2f}x**", f"{c['ours_over_base']:.2f}x",
             f"{c['peft_over_base']:.2f}x",
             f"{'yes' if c['same_logits'] else 'NO'} ({c['max_diff_ours_peft']:.1e})"]
            for c in cells]

    def yes(key):
        return "yes" if all(c[key] for c in cells) else "NO"

    return [
        "", "## Bundled model, one decoding step: batch size × distinct adapters", "",
        f"{rgrid['adapters']} random LoRA adapters (rank {rgrid['rank']}, lora_alpha "
        f"{rgrid['lora_alpha']}, on every "
        f"{', '.join(f'`{t}`' for t in rgrid['target_modules'])}"
        "; seeded random A and B), saved with peft's `save_pretrained` and loaded into peft "
        f"(`PeftModel.from_pretrained` + `load_adapter`: {setup['peft_load_s']:.1f} s for "
        f"all of them) and into ours (`load_adapters`: {setup['ours_load_s']:.1f} s). Short "
        "prompts (3 to 7 words, left-padded) are prefilled once; the time is that of ONE "
        "decoding step (one new token per row, on the KV cache, which is cropped back to the "
        "prompt before every repetition), kinds alternating, median of "
        f"{samples} repetitions. *ours* = `set_rows` with the rows it already "
        "has, then the forward pass; *ours, rows changed* = the same right after other rows "
        "(so `set_rows` gathers every row's A and B again, as when a batch changes); "
        "*peft* = `forward(..., adapter_names=[...])`.", "",
        "peft time / ours time:", "",
        *ratio_matrix(cells, GRID_BATCHES, GRID_DISTINCT, "peft_over_ours"), "",
        *markdown_table(["batch", "adapters in the batch", "base", "ours", "ours, rows changed",
                         "peft", "peft / ours", "ours / base", "peft / base",
                         "ours = peft (max difference)"], rows, "rrrrrrrrrl"),
        "", f"Logits of ours and peft agree in every cell (atol {LOGITS_ATOL}, rtol "
        f"{LOGITS_RTOL}): {yes('same_logits')}. The adapters do change them: the "
        "largest difference from the base model is at least "
        f"{min(c['max_diff_ours_base'] for c in cells):.2f} in every cell. "
        f"The cached step gives the logits of a full forward pass: "
        f"{yes('cached_step_matches_full_forward')}; "
        "the cache is the same after the repetitions: "
        f"{yes('cache_unchanged_by_repetitions')}.",
    ]


def few_loaded_markdown(rgrid) -> list[str]:
    by_cell = {(c["batch"], c["distinct"]): c for c in rgrid["cells"]}
    rows = []
    for c in rgrid["few_loaded"]:
        full = by_cell.get((c["batch"], c["distinct"]))
        rows.append([c["batch"], c["distinct"], ms(c["peft_s"]), ms(full["peft_s"]) if full else "",
                     ms(c["ours_s"]), f"{c['peft_over_ours']:.2f}x"])
    return [
        "", "peft runs one pair of small products per distinct adapter in each layer; ours "
        "runs one batched product per layer whatever the adapters are.", "",
        "peft also pays per forward pass for the adapters it holds, used or not. The same "
        f"kind of cell with a peft model that holds only the batch's adapters (and "
        f"{rgrid['adapters']} loaded, from the grid above):", "",
        *markdown_table(["batch", "adapters in the batch", "peft, only those loaded",
                         f"peft, {rgrid['adapters']} loaded", "ours",
                         "peft / ours, only those loaded"], rows, "rrrrrr"),
        "", "![Bundled model: peft / ours for one decoding step](lora_grid.png)",
    ]


# --- command line ---------------------------------------------------------------------------

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 1 repetition (4 in the grids), answers of at most "
                         "20 tokens")
    ap.add_argument("--adapters", type=positive_int, default=64,
                    help="random adapters of the toy model (the toy grid uses at most this many)")
    ap.add_argument("--rank", type=positive_int, default=2, help="rank of the toy adapters")
    ap.add_argument("--batch", type=positive_int, default=32,
                    help="rows of the real-model batch of part 3")
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help="most new tokens per part-3 run (default 80: the JSON answers need ~75; "
                         "20 with --quick)")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help="repetitions of part 3 (default 5, 1 with --quick); parts 1, 2 and 4 "
                         "take 4 times as many")
    ap.add_argument("--threads", type=positive_int, default=1,
                    help="torch threads (default 1, as in the lessons: lesson 06 times its "
                         "figures on one thread)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the bundled model runs (the toy model stays on the CPU)")
    ap.add_argument("--skip-real", action="store_true", help="only the toy model (parts 1 and 2)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS,
                    help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out}: exists and is not a folder")
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.tokens = args.tokens or (20 if args.quick else 80)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import peft
    import transformers

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = load_average()
    result = {"date": datetime.date.today().isoformat(),
              "args": {**vars(args), "out": str(args.out)}, "repeats": args.repeats,
              "machine": {"device": (torch.cuda.get_device_name() if args.device == "cuda"
                                     else f"{platform.machine()} CPU"),
                          "cpu": machine(), "cores": os.cpu_count(),
                          "load_average": numbers(load) if load else "n/a",
                          "threads": args.threads, "torch": torch.__version__,
                          "transformers": transformers.__version__, "peft": peft.__version__}}
    result["toy"] = bench_toy(args)
    cores = os.cpu_count() or 1
    if args.device == "cpu" and cores > args.threads:  # the toy sweep again on every core
        torch.set_num_threads(cores)
        result["toy_all_cores"] = {"threads": cores, "rows": bench_toy(args)}
        torch.set_num_threads(args.threads)
    result["toy_grid"] = bench_toy_grid(args)
    if not args.skip_real:
        result["real"] = bench_real(args)
        result["real_grid"] = bench_real_grid(args)
    result["wall_s"] = time.perf_counter() - started

    checks = [r["same_logits"] for r in result["toy"] + result.get("toy_all_cores", {}).get("rows", [])]
    checks += [c["same_output"] for c in result["toy_grid"]]
    if not args.skip_real:
        checks.append(result["real"]["identical_tokens"])
        checks += [c[key] for c in result["real_grid"]["cells"] + result["real_grid"]["few_loaded"]
                   for key in ("same_logits", "adapters_change_logits",
                               "cached_step_matches_full_forward",
                               "cache_unchanged_by_repetitions")]
    result["checks_passed"] = all(checks)

    args.out.mkdir(parents=True, exist_ok=True)
    plot_toy(result, args.out / "lora_toy.png")
    if not args.skip_real:
        plot_grid(result, args.out / "lora_grid.png")
    write_results(args.out, "lora", result, markdown(result))
    print(f"{time.perf_counter() - started:.0f} s in all; checks "
          f"{'passed' if all(checks) else 'FAILED'}", flush=True)
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
