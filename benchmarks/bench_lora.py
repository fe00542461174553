"""Lesson 06's figures: one batch, one adapter per row -- a loop versus a gathered product.

    python benchmarks/bench_lora.py              # a couple of minutes on 2 CPU cores

1. The toy model (hidden 1024, ten colour words) with 64 random adapters of rank 2: the time
   of one decoding step (one token per row) for batch sizes 1..64, with the adapters' part
   computed by ``linear_lora_loop`` (one row at a time) or ``linear_lora_gathered``
   (``index_select`` + ``torch.bmm``). Timed twice: the adapter part alone, and the whole
   model (embedding -> linear + adapters -> lm_head).
2. The bundled model with the shipped adapters: a batch of 32 task prompts (left-padded),
   row i using adapter i mod (adapters + 1) and the last of each cycle using none; greedy
   generation of the whole answers (at most ``--tokens`` tokens) with ``model.generate``
   through our ``MultiLora`` layers versus peft's mixed-adapter batches
   (``generate(..., adapter_names=[...])``), and of the first token alone. The tokens must be
   identical; the base model without adapters is timed as the floor.

Writes benchmarks/results/lora.json and lora.md and prints the markdown.
"""

import argparse
import datetime
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from helpers.corpus import task_examples, task_prompt  # noqa: E402
from helpers.lora import (ADAPTERS_DIR, NO_ADAPTER, ToyMultiLoraModel,  # noqa: E402
                          linear_lora_gathered, linear_lora_loop, load_adapters,
                          random_adapters, shipped_adapters)
from helpers.models import load_model  # noqa: E402
from results_io import write_results  # noqa: E402  (benchmarks/ is on sys.path)

RESULTS = ROOT / "benchmarks" / "results"


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def bench_toy(args) -> list[dict]:
    loras_a, loras_b = random_adapters(args.adapters, hidden=1024, rank=args.rank, seed=0)
    models = {"loop": ToyMultiLoraModel(linear_lora_loop),
              "gathered": ToyMultiLoraModel(linear_lora_gathered)}
    functions = {"loop": linear_lora_loop, "gathered": linear_lora_gathered}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in [1, 2, 4, 8, 16, 32, 64]:
        ids = torch.randint(10, (batch, 1), generator=gen)
        indices = torch.randint(args.adapters, (batch,), generator=gen)
        x = models["loop"].embedding(ids)
        row = {"batch": batch}
        for name in ("loop", "gathered"):
            fn, model = functions[name], models[name]
            row[f"{name}_lora_s"] = median_seconds(
                lambda: fn(x, loras_a, loras_b, indices), args.repeats * 4)
            row[f"{name}_model_s"] = median_seconds(
                lambda: model(ids, loras_a, loras_b, indices), args.repeats * 4)
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


def bench_real(args) -> dict:
    from peft import PeftModel

    names = shipped_adapters()
    if not names:
        raise SystemExit("no shipped adapters: run scripts/train_adapters.py first")
    ours, tokenizer = load_model(device=args.device)
    lora = load_adapters(ours, names)
    reference, _ = load_model(device=args.device)
    peft_model = PeftModel.from_pretrained(reference, ADAPTERS_DIR / names[0],
                                           adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(ADAPTERS_DIR / name, adapter_name=name)
    peft_model.eval()
    plain, _ = load_model(device=args.device)

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
        times = {f"{k}_{n}": [] for k in kinds for n in ("first", "all")}
        for _ in range(1):  # warm-up
            for k in kinds:
                runner(k, 1)(), runner(k, args.tokens)()
        for _ in range(args.repeats):  # interleaved, so that load changes hit all of them
            for k in kinds:
                for n, count in (("first", 1), ("all", args.tokens)):
                    fn = runner(k, count)
                    start = time.perf_counter()
                    fn()
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    times[f"{k}_{n}"].append(time.perf_counter() - start)
    new_tokens = tokens["ours"].shape[1] - batch.input_ids.shape[1]
    med = {key: statistics.median(v) for key, v in times.items()}
    result = {"batch": args.batch, "adapters": names, "rows": peft_rows,
              "prompt_tokens": int(batch.input_ids.shape[1]), "new_tokens": int(new_tokens),
              "identical_tokens": identical, "all_times_s": times}
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


def markdown(result) -> str:
    toy, real, m = result["toy"], result.get("real"), result["machine"]
    lines = [
        "# Multi-LoRA: one batch, one adapter per row", "",
        f"{result['date']}, {m['device']}, {m['threads']} threads, torch {m['torch']}. "
        "Median wall times; they change from run to run.", "",
        f"## Toy model: {result['args']['adapters']} random adapters of rank "
        f"{result['args']['rank']}, hidden 1024, one token per row", "",
        "| batch | adapters: loop | adapters: gathered | loop / gathered | whole model: loop | "
        "whole model: gathered | loop / gathered |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in toy:
        lines.append(f"| {r['batch']} | {r['loop_lora_s'] * 1e3:.3f} ms | "
                     f"{r['gathered_lora_s'] * 1e3:.3f} ms | {r['lora_ratio']:.1f}x | "
                     f"{r['loop_model_s'] * 1e3:.3f} ms | {r['gathered_model_s'] * 1e3:.3f} ms "
                     f"| {r['model_ratio']:.1f}x |")
    lines += ["", "The \"adapters\" columns time `linear_lora_loop` / `linear_lora_gathered` "
              "alone; the whole model adds the base linear layer (1024 × 1024) and the output "
              "layer, which are the same for both."]
    if real:
        o, p, b = real["ours"], real["peft"], real["base"]
        lines += [
            "", f"## Bundled model, shipped adapters, batch {real['batch']}", "",
            f"Adapters {', '.join(real['adapters'])} and none, cycling over the rows; "
            f"{real['prompt_tokens']} prompt tokens (left-padded), {real['new_tokens']} new "
            "tokens (greedy `generate`, until every row has finished its answer). First token "
            "= `generate(max_new_tokens=1)` (mostly the prefill); per token = the rest divided "
            "by the remaining tokens.", "",
            "| | first token | per token after it | whole answers |", "|---|---:|---:|---:|",
            f"| base model, no adapters | {b['first_token_s'] * 1e3:.0f} ms | "
            f"{b['per_token_s'] * 1e3:.1f} ms | {b['total_s']:.2f} s |",
            f"| ours (`MultiLora`, gathered) | {o['first_token_s'] * 1e3:.0f} ms | "
            f"{o['per_token_s'] * 1e3:.1f} ms | {o['total_s']:.2f} s |",
            f"| peft (`adapter_names=`) | {p['first_token_s'] * 1e3:.0f} ms | "
            f"{p['per_token_s'] * 1e3:.1f} ms | {p['total_s']:.2f} s |",
            f"| peft / ours | {real['peft_over_ours_first_token_s']:.2f}x | "
            f"{real['peft_over_ours_per_token_s']:.2f}x | **{real['peft_over_ours_total_s']:.2f}x** |",
            f"| peft / base model (the ceiling: adapters that cost nothing) | "
            f"{real['peft_over_base_first_token_s']:.2f}x | "
            f"{real['peft_over_base_per_token_s']:.2f}x | {real['peft_over_base_total_s']:.2f}x |",
            "", f"Identical tokens: {real['identical_tokens']}.",
        ]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--adapters", type=int, default=64, help="random adapters of the toy model")
    ap.add_argument("--rank", type=int, default=2, help="rank of the toy adapters")
    ap.add_argument("--batch", type=int, default=32, help="rows of the real-model batch")
    ap.add_argument("--tokens", type=int, default=80,
                    help="most new tokens per real-model run (the JSON answers need ~75)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-real", action="store_true", help="only the toy model")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = {"date": datetime.date.today().isoformat(), "args": vars(args),
              "machine": {"device": (torch.cuda.get_device_name() if args.device == "cuda"
                                     else f"{platform.machine()} CPU"),
                          "threads": args.threads, "torch": torch.__version__},
              "toy": bench_toy(args)}
    if not args.skip_real:
        result["real"] = bench_real(args)
    write_results(RESULTS, "lora", result, markdown(result))


if __name__ == "__main__":
    main()
