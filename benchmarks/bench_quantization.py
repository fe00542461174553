"""Lesson 04's figures: what 8-bit quantization saves and costs on the bundled model.

    python -m benchmarks.bench_quantization            # about a minute on 2 CPU cores

For fp32, hand-made uint8 (per-tensor and per-channel), torchao int8 weight-only (Conv1D
turned into nn.Linear first) and torchao on the model as it is: footprint, perplexity on
held-out text (and at 4 bits for contrast), decode speed (``--tokens`` greedy tokens, the
variants taking turns) and the greedy continuations. Writes ``quantization.json``, ``.md`` and
``quantization.png``.
"""

import copy
import datetime

import torch

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import arguments, begin, machine, positive_int, write_results
from benchmarks.timing import Candidate, time_in_turns, timed_once
from helpers.quantization import (dequantize_model, footprint, perplexity, quantize_model,
                                  torchao_int8_weight_only)
from helpers.quiet import import_torchao, quiet_stderr


PROMPTS = ["The quick brown fox jumped over the", "Jack and Jill", "Humpty Dumpty sat"]


def decode_seconds(models: dict, tokenizer, tokens: int, repeats: int) -> dict[str, dict]:
    """Seconds to generate ``tokens`` greedy tokens, for each model: median, min and max
    (``timing.spread``).

    The models take turns (one run each per round, after a warm-up round), so that a change
    in the machine's load during the measurement hits all of them alike.
    """
    from helpers import generate_with_cache

    def decode(model):
        return Candidate(lambda: generate_with_cache(model, tokenizer, PROMPTS[0], tokens,
                                                     stop_at_eos=False),
                         clock=lambda out: out.latency)

    timings = time_in_turns({name: decode(model) for name, model in models.items()},
                            repeats=repeats)
    return {name: timings.spread(name) for name in models}


def continuations(model, tokenizer, tokens: int = 20) -> dict[str, str]:
    from helpers import generate_with_cache

    return {p: generate_with_cache(model, tokenizer, p, tokens, stop_at_eos=False).text
            for p in PROMPTS}


def parse_args(argv=None):
    ap = arguments(__doc__, "20 documents, 2 timed runs")
    ap.add_argument("--docs", type=positive_int, default=200,
                    help="held-out documents for perplexity")
    ap.add_argument("--tokens", type=positive_int, default=50, help="greedy tokens per timed run")
    ap.add_argument("--repeats", type=positive_int, default=5,
                    help="timed runs (the median is kept)")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.repeats = 20, 2
    return args


def measure_variants(model, tokenizer, texts, torchao) -> tuple[list[dict], dict]:
    """Footprint, perplexity and greedy continuations of every variant: one row each, and
    the models whose decode speed is timed, by variant name."""
    base = footprint(model)
    rows, timed = [], {}

    def record(name, fp, ppl_model, speed_model=None, extra=None):
        row = {"variant": name, "bytes": fp["total"], "bytes_parameters": fp["parameters"],
               "bytes_states": fp["states"], "ratio_to_fp32": fp["total"] / base["total"],
               "perplexity": perplexity(ppl_model, tokenizer, texts)}
        if speed_model is not None:
            timed[name] = speed_model
            row["text"] = continuations(speed_model, tokenizer)
        row.update(extra or {})
        rows.append(row)
        print(f"  {name}: ratio {row['ratio_to_fp32']:.4f}, perplexity {row['perplexity']:.4f}")

    print("fp32 and hand-made uint8 ...")
    record("fp32", base, model, model)
    for label, axis, bits in [("uint8 per-tensor", None, 8), ("uint8 per-channel (axis=-1)", -1, 8),
                              ("uint8 per-channel (axis=0)", 0, 8), ("4-bit per-tensor", None, 4),
                              ("4-bit per-channel (axis=-1)", -1, 4)]:
        qmodel, states = quantize_model(model, axis=axis, bits=bits)
        restored, seconds = timed_once(lambda: dequantize_model(qmodel, states))
        speed_model = restored if bits == 8 and axis != 0 else None  # the others run alike
        record(label, footprint(qmodel, states), restored, speed_model,
               {"dequantize_seconds": seconds, "axis": axis, "bits": bits})

    if torchao is not None:
        print("torchao int8 weight-only ...")
        small = torchao_int8_weight_only(model)
        record("torchao int8 weight-only (Conv1D -> Linear)", footprint(small), small, small,
               {"quantized_layers": sum(type(m.weight) is not torch.nn.Parameter
                                        for m in small.modules() if isinstance(m, torch.nn.Linear))})
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        naive = copy.deepcopy(model)
        with quiet_stderr():
            quantize_(naive, Int8WeightOnlyConfig())
        record("torchao quantize_ on the model as it is", footprint(naive), naive, None,
               {"quantized_layers": [n for n, m in naive.named_modules()
                                     if isinstance(m, torch.nn.Linear)
                                     and type(m.weight) is not torch.nn.Parameter],
                "lm_head_still_tied": naive.lm_head.weight is naive.transformer.wte.weight})
    return rows, timed


def main(argv=None):
    args = parse_args(argv)
    out = begin(args)
    try:
        torchao = import_torchao()  # first, so that loading the model prints nothing either
    except ImportError as err:
        torchao = None
        print(f"[torchao missing: {err}]")

    from helpers import load_model
    from helpers.corpus import corpus

    model, tokenizer = load_model(device="cpu")
    rows, timed = measure_variants(model, tokenizer, corpus(seed=1, n_docs=args.docs), torchao)
    print(f"decode speed ({args.repeats} rounds of {args.tokens} tokens, models taking turns) ...")
    seconds = decode_seconds(timed, tokenizer, args.tokens, args.repeats)
    for row in rows:
        if row["variant"] in seconds:
            spread = seconds[row["variant"]]
            row["decode_seconds"] = spread["median"]
            row["decode_seconds_min_max"] = [spread["min"], spread["max"]]
            row["ms_per_token"] = 1000 * spread["median"] / args.tokens
            row["fp32_over_this"] = seconds["fp32"]["median"] / spread["median"]

    result = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{machine()}, torch threads: {torch.get_num_threads()}",
        "torch": torch.__version__, "torchao": getattr(torchao, "__version__", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out_docs": args.docs, "decode_tokens": args.tokens, "repeats": args.repeats,
        "rows": rows,
    }
    plot(result, out / "quantization.png")
    write_results(args.out, "quantization", result, to_markdown(result))


def plot(result, path) -> None:
    """Footprint and perplexity of every variant, side by side."""
    plt = pyplot()

    rows = result["rows"]
    names = [r["variant"].replace(" (", "\n(") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    left.barh(names, [r["bytes"] / 2**20 for r in rows], color="tab:blue")
    left.set(xlabel="MiB (weights + quantization states)", title="Memory footprint")
    right.barh(names, [r["perplexity"] for r in rows], color="tab:orange")
    low = min(r["perplexity"] for r in rows)
    right.set_xlim(low * 0.995, max(r["perplexity"] for r in rows) * 1.002)
    right.set(xlabel=f"perplexity on {result['held_out_docs']} held-out documents "
                     "(lower is better; axis cut)", title="Quality")
    right.set_yticks([])
    for ax in (left, right):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path)


def to_markdown(result) -> str:
    lines = [
        "# Quantization of the bundled model (lesson 04)",
        "",
        f"{result['when']}, {result['machine']}, torch {result['torch']}, torchao "
        f"{result['torchao']}. {result['parameters']:,} parameters; perplexity on "
        f"{result['held_out_docs']} held-out documents (`corpus(seed=1)`); decode time = median "
        f"of {result['repeats']} runs of {result['decode_tokens']} greedy tokens with the KV cache "
        f"(the timed models take turns). Timings depend on the machine and its load.",
        "",
        "| variant | bytes | ratio to fp32 | of which states | perplexity | decode s (min-max) "
        "| ms/token | speed vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        low, high = r.get("decode_seconds_min_max", (0, 0))
        speed = (f"{r['decode_seconds']:.3f} ({low:.3f}-{high:.3f}) | {r['ms_per_token']:.1f} | "
                 f"{r['fp32_over_this']:.2f}x" if "decode_seconds" in r else " | | ")
        lines.append(f"| {r['variant']} | {r['bytes']:,} | {r['ratio_to_fp32']:.4f} | "
                     f"{r['bytes_states']:,} | {r['perplexity']:.4f} | {speed} |")
    lines += ["", "Hand-made rows: the bytes are those of the uint8 codes plus the states; the "
              "perplexity is that of the dequantized model (which runs at fp32 speed again).", ""]
    for r in result["rows"]:
        if "dequantize_seconds" in r and "decode_seconds" in r:
            lines.append(f"`dequantize_model` for `{r['variant']}` took "
                         f"{r['dequantize_seconds']:.3f} s (once, before generating).")
            lines.append("")
    for r in result["rows"]:
        if "quantized_layers" in r and isinstance(r["quantized_layers"], list):
            lines.append(f"`{r['variant']}` quantized only {r['quantized_layers']}; lm_head still "
                         f"tied to the embedding: {r['lm_head_still_tied']}.")
            lines.append("")
    lines += ["![Footprint and perplexity](quantization.png)", "", "## Greedy continuations", ""]
    for r in result["rows"]:
        if "text" in r:
            lines.append(f"**{r['variant']}**")
            lines.append("")
            lines += [f"- {p!r} → {t!r}" for p, t in r["text"].items()]
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
