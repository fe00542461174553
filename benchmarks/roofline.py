"""Part 3 of ``bench_decoding.py``: a roofline for the decode step. Bytes it reads (the weights
once, plus every row's KV cache) for the bundled model and for GPT-2 small (124M parameters,
random weights: the shapes are what matters). The memory-bandwidth bound on tokens/s at batch
b is b × bandwidth / bytes(b), for this CPU (its copy bandwidth and matrix-multiply rate
measured as lesson 02 measures them, ``helpers.costs.measure_rates``, in fp32) and for a T4
(320 GB/s, fp16); the rate gives the compute bound. The measured tokens/s of one decode step
at batch 1..128 (a random KV cache of ``--context`` positions) is drawn against both."""

from __future__ import annotations

import torch

from benchmarks.plots import pyplot, save_figure
from benchmarks.results_io import markdown_table
from benchmarks.timing import Candidate, crop_cache, time_in_turns
from helpers.costs import measure_rates
from helpers.generation import kv_cache_bytes_for

T4_BANDWIDTH = 320e9  # bytes/s, NVIDIA's figure for the T4 (Colab's free GPU)


def weights_read(model) -> int:
    """Weights one decode step reads: every parameter once, except the position table (one
    row per token). GPT-2's token table is read whole by its tied output layer."""
    return sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()


def step_flops(model, batch: int, context: int) -> int:
    """Floating-point operations of one decode step: 2 per weight per row (multiply, add),
    plus attention over the context (scores and weighted sum: 4 × context × width per layer)."""
    config = model.config
    attention = 4 * context * config.n_embd * config.n_layer
    return batch * (2 * weights_read(model) + attention)


@torch.no_grad()
def measured_decode(model, batch: int, context: int, reps: int) -> float:
    """Seconds of one decode step at ``batch`` rows over a random KV cache of ``context``
    positions (the cache is cropped back after every step, so each step sees the same)."""
    from helpers import cache_from_layers

    config = model.config
    heads, head_dim = config.n_head, config.n_embd // config.n_head
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(batch, heads, context, head_dim, generator=gen),
               torch.randn(batch, heads, context, head_dim, generator=gen))
              for _ in range(config.n_layer)]
    cache = cache_from_layers(layers)
    token = torch.randint(config.vocab_size, (batch, 1), generator=gen)
    mask = torch.ones(batch, context + 1, dtype=torch.long)
    position = torch.full((batch, 1), context)
    step = Candidate(lambda: model(input_ids=token, attention_mask=mask, position_ids=position,
                                   past_key_values=cache, use_cache=True),
                     prepare=lambda: crop_cache(cache, context))
    return time_in_turns({"step": step}, repeats=reps).median("step")


def bench_roofline(models, batches, context, reps, threads):
    rates = measure_rates("cpu", torch.float32, repeats=10)      # lesson 02's measurement
    bandwidth, flops = rates.bandwidth, rates.compute
    print(f"  this CPU ({threads} thread(s)): copy bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 "
          f"matmul {flops / 1e9:.1f} GFLOP/s", flush=True)
    result = {"cpu_copy_bandwidth_bytes_s": bandwidth, "cpu_matmul_flops": flops,
              "t4_bandwidth_bytes_s": T4_BANDWIDTH, "context": context, "models": {}}
    for name, model in models.items():
        rows = []
        for batch in batches:
            fp32 = 4 * weights_read(model) + kv_cache_bytes_for(model.config, context, batch, 4)
            fp16 = 2 * weights_read(model) + kv_cache_bytes_for(model.config, context, batch, 2)
            seconds = measured_decode(model, batch, context, reps)
            row = {"batch": batch, "bytes_fp32": fp32, "bytes_fp16": fp16,
                   "cpu_bandwidth_bound_tok_s": batch * bandwidth / fp32,
                   "cpu_compute_bound_tok_s": batch * flops / step_flops(model, batch, context),
                   "t4_bandwidth_bound_tok_s": batch * T4_BANDWIDTH / fp16,
                   "measured_step_s": seconds, "measured_tok_s": batch / seconds}
            row["measured_over_bound"] = row["measured_tok_s"] / min(
                row["cpu_bandwidth_bound_tok_s"], row["cpu_compute_bound_tok_s"])
            rows.append(row)
            print(f"  {name:12s} batch {batch:3d}: {fp32 / 1e6:7.1f} MB/step, bound "
                  f"{row['cpu_bandwidth_bound_tok_s']:8.0f} tok/s (memory) "
                  f"{row['cpu_compute_bound_tok_s']:8.0f} (compute), measured "
                  f"{row['measured_tok_s']:7.0f} tok/s", flush=True)
        result["models"][name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "layers": model.config.n_layer, "hidden": model.config.n_embd, "rows": rows}
    return result


def plot_roofline(roof, path):
    plt = pyplot()

    names = list(roof["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = roof["models"][name]["rows"]
        x = [r["batch"] for r in rows]
        ax.plot(x, [r["t4_bandwidth_bound_tok_s"] for r in rows], "--", color="tab:purple",
                label="T4 memory bound (320 GB/s, fp16)")
        ax.plot(x, [r["cpu_bandwidth_bound_tok_s"] for r in rows], "-", color="tab:blue",
                label=f"this CPU, memory bound ({roof['cpu_copy_bandwidth_bytes_s'] / 1e9:.0f}"
                      " GB/s, fp32)")
        ax.plot(x, [r["cpu_compute_bound_tok_s"] for r in rows], ":", color="tab:orange",
                label=f"this CPU, compute bound ({roof['cpu_matmul_flops'] / 1e9:.0f} GFLOP/s)")
        ax.plot(x, [r["measured_tok_s"] for r in rows], "o-", color="black",
                label="measured on this CPU")
        ax.set(xscale="log", yscale="log", xlabel="batch (rows decoded together)",
               ylabel="tokens / second", title=f"{name}: one decode step, context "
                                               f"{roof['context']}")
        ax.set_xticks(x, [str(b) for b in x])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def roofline_markdown(roof, threads):
    table = [[name, r["batch"], f"{r['bytes_fp32'] / 1e6:.1f}",
              f"{r['cpu_bandwidth_bound_tok_s']:,.0f}", f"{r['cpu_compute_bound_tok_s']:,.0f}",
              f"{r['t4_bandwidth_bound_tok_s']:,.0f}", f"{r['measured_tok_s']:,.0f}",
              f"{r['measured_over_bound']:.0%}"]
             for name, info in roof["models"].items() for r in info["rows"]]
    small, big = (roof["models"][n]["rows"][0] for n in roof["models"])
    return [
        "## Roofline of a decode step", "",
        f"This CPU moves **{roof['cpu_copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s** (the best "
        f"copy of 128 MiB, read + write) and multiplies fp32 matrices at "
        f"**{roof['cpu_matmul_flops'] / 1e9:.1f} GFLOP/s** with {threads} thread(s); a T4 "
        f"reads {T4_BANDWIDTH / 1e9:.0f} GB/s. Bytes per step = weights (fp32 here, fp16 on "
        f"the T4) + every row's KV cache at a context of {roof['context']} tokens.", "",
        *markdown_table(["model", "batch", "MB read / step (fp32)", "CPU memory bound (tok/s)",
                         "CPU compute bound (tok/s)", "T4 memory bound, fp16 (tok/s)",
                         "measured (tok/s)", "measured / CPU bound"], table, "lrrrrrrr"),
        "", "How to read it: one decode step reads every weight once whatever the batch, so "
        "at batch 1 the weights' bytes set the pace and more rows come almost free, until the "
        "KV cache (which grows with the batch) or the arithmetic takes over. GPT-2 small "
        f"({big['bytes_fp32'] / 1e6:.0f} MB a step) reaches {big['measured_over_bound']:.0%} of "
        "this CPU's memory bound at batch 1: it is memory-bound, as the lessons say. The "
        f"bundled model ({small['bytes_fp32'] / 1e6:.0f} MB) reaches only "
        f"{small['measured_over_bound']:.0%}: its weights fit in a CPU's last-level cache and "
        "its matrices are so small that the fixed cost of each operation (Python, dispatch, "
        "the cache's bookkeeping) dominates. That is also why torch.compile and batching pay "
        "off so well for it.", "", "![Roofline](roofline.png)", ""]
