"""Lesson 06's figures: one batch, one adapter per row -- a loop versus a gathered product.

    python -m benchmarks.bench_lora              # about a minute (1 torch thread, 2-core CPU)
    python -m benchmarks.bench_lora --quick      # about 30 s

1. The toy model (hidden 1024) with 64 random adapters of rank 2: one decoding step for batch
   1..64, the adapters' part by ``linear_lora_loop`` or ``linear_lora_gathered``, alone and in
   the whole model; again on every core.
2. The toy model, batch sizes times distinct adapters in the batch (rows take them in turn):
   the adapters' part alone, loop versus gathered.
3. The bundled model with the shipped adapters, a batch of 32 task prompts, row i on adapter
   i mod (adapters + 1) (the last: none): greedy ``generate`` through our ``MultiLora`` versus
   peft's mixed-adapter batches (``adapter_names=``), whole answers and first token; identical
   tokens; the base model timed as the floor.

Targets (``targets.LORA``). Writes ``lora.json``, ``lora.md`` and ``lora_toy.png``; exits with
status 1 when a check fails (tokens or logits that differ).
"""

import datetime
import os
import pathlib
import sys
import time
import warnings

import torch

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import (arguments, begin, facts_line, markdown_table, positive_int,
                                   run_facts, write_results)
from benchmarks.timing import calls_per_sample, time_in_turns
from helpers.corpus import task_examples, task_prompt
from helpers.lora import (ADAPTERS_DIR, NO_ADAPTER, ToyMultiLoraModel, linear_lora_gathered,
                          linear_lora_loop, load_adapters, random_adapters, shipped_adapters)
from helpers.models import load_model

#: The model of part 3 (the shipped adapters need it).
MODEL = "bundled"

#: Toy grid (part 2): batch sizes times distinct adapters in the batch.
TOY_BATCHES = [1, 2, 4, 8, 16, 32, 64]
TOY_DISTINCT = [1, 2, 4, 8, 16, 32, 64]


# --- parts 1 and 2: the toy model --------------------------------------------------------

def rows_for(batch: int, distinct: int, pool: int, seed: int) -> list[int]:
    """Adapter indices for the rows of a batch: ``distinct`` adapters drawn (seeded) from
    0..pool-1, taken in turn by the rows, so each of them serves at least one row."""
    if not 1 <= distinct <= min(batch, pool):
        raise ValueError(f"need 1 <= distinct <= batch and pool, got distinct={distinct}, "
                         f"batch={batch}, pool={pool}")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(pool, generator=generator)[:distinct].tolist()
    return [chosen[i % distinct] for i in range(batch)]


@torch.no_grad()
def bench_toy(args) -> list[dict]:
    loras_a, loras_b = random_adapters(args.adapters, hidden=1024, rank=args.rank, seed=0)
    functions = {"loop": linear_lora_loop, "gathered": linear_lora_gathered}
    models = {name: ToyMultiLoraModel(fn) for name, fn in functions.items()}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in TOY_BATCHES:
        ids = torch.randint(10, (batch, 1), generator=gen)
        indices = torch.randint(args.adapters, (batch,), generator=gen)
        x = models["loop"].embedding(ids)
        candidates = {}                    # the adapters' part alone, and the whole model
        for name, fn in functions.items():
            candidates[f"{name}_lora_s"] = lambda fn=fn: fn(x, loras_a, loras_b, indices)
            candidates[f"{name}_model_s"] = lambda m=models[name]: m(ids, loras_a, loras_b,
                                                                     indices)
        timings = time_in_turns(candidates, args.repeats * 4, warmup=2)
        row = {"batch": batch, **{key: timings.median(key) for key in candidates}}
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

# --- plots ---------------------------------------------------------------------------------

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
    m = result["machine"]
    fig.suptitle(f"Toy model (hidden 1024, rank {result['args']['rank']}): one adapter per "
                 f"row, a loop versus a gathered product\n{m['device']}, {m['threads']} torch "
                 f"thread(s), torch {m['torch']}, {result['date']}")
    save_figure(fig, path, dpi=120)


# --- markdown ------------------------------------------------------------------------------

def markdown(result) -> str:
    m = result["machine"]
    lines = [
        "# Multi-LoRA: one batch, one adapter per row", "",
        f"{result['date']}, {m['device']}: {facts_line(m)}; peft {m['peft']}. Median wall "
        "times; they change "
        "from run to run." + (" **Smoke run (`--quick`): too few repetitions to quote.**"
                              if result["args"]["quick"] else ""), "",
    ]
    lines += toy_markdown(result) + toy_grid_markdown(result)
    if result.get("real"):
        lines += real_markdown(result["real"])
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


def ratio_matrix(cells, batches, distincts, key) -> list[str]:
    """A markdown table: one row per batch size, one column per distinct-adapter count."""
    by_cell = {(c["batch"], c["distinct"]): c[key] for c in cells}
    rows = [[b] + [f"{by_cell[b, d]:.2f}x" if (b, d) in by_cell else "" for d in distincts]
            for b in batches]
    return markdown_table(["batch \\ adapters", *map(str, distincts)], rows,
                          "r" * (len(distincts) + 1))


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


# --- command line ---------------------------------------------------------------------------

def parse_args(argv=None):
    ap = arguments(__doc__, "1 repetition (4 in the toy parts), answers of at most 20 tokens")
    ap.add_argument("--adapters", type=positive_int, default=64,
                    help="random adapters of the toy model (the toy grid uses at most this many)")
    ap.add_argument("--rank", type=positive_int, default=2, help="rank of the toy adapters")
    ap.add_argument("--batch", type=positive_int, default=32,
                    help="rows of the real-model batch of part 3")
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help="most new tokens per part-3 run (default 80: the JSON answers need ~75; "
                         "20 with --quick)")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help="repetitions of part 3 (default 5, 1 with --quick); parts 1 and 2 "
                         "take 4 times as many")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the bundled model runs (the toy model stays on the CPU)")
    ap.add_argument("--skip-real", action="store_true", help="only the toy model (parts 1 and 2)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    if pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
        ap.error(f"--out {args.out}: exists and is not a folder")
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.tokens = args.tokens or (20 if args.quick else 80)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import peft

    started = time.perf_counter()
    out = begin(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    result = {"date": datetime.date.today().isoformat(), "args": vars(args),
              "repeats": args.repeats,
              "machine": {**run_facts(), "device": device, "peft": peft.__version__}}
    result["toy"] = bench_toy(args)
    cores = os.cpu_count() or 1
    if args.device == "cpu" and cores > args.threads:  # the toy sweep again on every core
        torch.set_num_threads(cores)
        result["toy_all_cores"] = {"threads": cores, "rows": bench_toy(args)}
        torch.set_num_threads(args.threads)
    result["toy_grid"] = bench_toy_grid(args)
    if not args.skip_real:
        result["real"] = bench_real(args)
    result["wall_s"] = time.perf_counter() - started

    checks = [r["same_logits"] for r in result["toy"] + result.get("toy_all_cores", {}).get("rows", [])]
    checks += [c["same_output"] for c in result["toy_grid"]]
    if not args.skip_real:
        checks.append(result["real"]["identical_tokens"])
    result["checks_passed"] = all(checks)

    plot_toy(result, out / "lora_toy.png")
    write_results(out, "lora", result, markdown(result))
    print(f"{time.perf_counter() - started:.0f} s in all; checks "
          f"{'passed' if all(checks) else 'FAILED'}", flush=True)
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
