"""Part 4 of lesson 06's benchmark (``bench_lora.py`` runs it and writes its figures).

The bundled model, a grid: 64 random LoRA adapters (rank 8, on every ``c_attn``, ``c_proj``
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

Also the pieces parts 2-4 share: the rows of a grid cell (``rows_for``), peft's way of loading
adapters (``load_peft``), the grid's markdown matrix (``ratio_matrix``).
"""

import pathlib
import tempfile
import warnings

import torch

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import markdown_table
from benchmarks.timing import Candidate, crop_cache, time_in_turns, timed_once
from helpers.batching import position_ids_from_mask
from helpers.corpus import task_examples
from helpers.lora import load_adapters
from helpers.models import load_model

#: The model of parts 3 and 4 (the shipped adapters and GPT-2's layer names need it).
MODEL = "bundled"
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


def rows_for(batch: int, distinct: int, pool: int, seed: int) -> list[int]:
    """Adapter indices for the rows of a batch: ``distinct`` adapters drawn (seeded) from
    0..pool-1, taken in turn by the rows, so each of them serves at least one row."""
    if not 1 <= distinct <= min(batch, pool):
        raise ValueError(f"need 1 <= distinct <= batch and pool, got distinct={distinct}, "
                         f"batch={batch}, pool={pool}")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(pool, generator=generator)[:distinct].tolist()
    return [chosen[i % distinct] for i in range(batch)]


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
        folders, setup["make_and_save_s"] = timed_once(
            lambda: save_random_adapters(pathlib.Path(tmp), GRID_ADAPTERS, args.device))
        names = list(folders)
        peft_model, setup["peft_load_s"] = timed_once(lambda: load_peft(folders, args.device))
        ours = load_model(MODEL, device=args.device)[0]
        lora, setup["ours_load_s"] = timed_once(lambda: load_adapters(ours, folders))

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


def subtitle(result) -> str:
    m = result["machine"]
    return f"{m['device']}, {m['threads']} torch thread(s), torch {m['torch']}, {result['date']}"


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


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def ratio_matrix(cells, batches, distincts, key) -> list[str]:
    """A markdown table: one row per batch size, one column per distinct-adapter count."""
    by_cell = {(c["batch"], c["distinct"]): c[key] for c in cells}
    rows = [[b] + [f"{by_cell[b, d]:.2f}x" if (b, d) in by_cell else "" for d in distincts]
            for b in batches]
    return markdown_table(["batch \\ adapters", *map(str, distincts)], rows,
                          "r" * (len(distincts) + 1))


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
