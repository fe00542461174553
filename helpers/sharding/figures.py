"""Lesson 11's figures: the time of a decode step with and without communication, the
pipeline's bubble, and the cost model for a 70B model. (Lesson 11.)

Each returns a matplotlib ``Figure`` (no pyplot); show it with ``helpers.show_figure``.
matplotlib is imported inside the functions, so that a rank process, which draws nothing,
never pays for it.
"""

from __future__ import annotations

from ..plots import PALETTE
from .cost import H100_SXM, LINKS, ModelShape, tp_decode_step

COMPUTE_COLOUR, COMM_COLOUR = PALETTE[0], PALETTE[1]


def step_time_figure(steps: dict, title: str | None = None):
    """Milliseconds per decode step at each batch size, one bar per setup, the share spent in
    all-reduces hatched. ``steps`` maps a setup's name to ``{batch: (seconds per step, seconds
    of it in all-reduces)}``. (Lesson 11.)"""
    from matplotlib.figure import Figure

    if not steps or any(not v for v in steps.values()):
        raise ValueError("steps must map each setup to {batch: (step seconds, comm seconds)}")
    batches = sorted(next(iter(steps.values())))
    fig = Figure(figsize=(10, 3.6), dpi=90, layout="constrained")
    axes = fig.subplots(1, len(batches), squeeze=False)[0]
    for ax, batch in zip(axes, batches):
        names = list(steps)
        total = [steps[n][batch][0] * 1e3 for n in names]
        comm = [min(steps[n][batch][1], steps[n][batch][0]) * 1e3 for n in names]
        ax.bar(names, [t - c for t, c in zip(total, comm)], color=COMPUTE_COLOUR,
               label="the rest of the step")
        ax.bar(names, comm, bottom=[t - c for t, c in zip(total, comm)], color=COMM_COLOUR,
               hatch="//", label="in all-reduces")
        for i, t in enumerate(total):
            ax.text(i, t, f"{t:.1f}", ha="center", va="bottom")
        ax.set_title(f"batch {batch}")
        ax.set_ylabel("ms per decode step")
        ax.margins(y=0.15)
        ax.tick_params(axis="x", labelsize=8)
    axes[0].legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def pipeline_figure(runs: dict, title: str | None = None, unit: str = "time units"):
    """When each pipeline stage worked, one row per stage, coloured by micro-batch; one panel
    per run. ``runs`` maps a label to a ``PipelineSchedule`` (times in units of one stage's
    work, ``unit``) or a ``PipelineRun`` (seconds: give ``unit="ms"``). (Lesson 11.)"""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 1.3 + 1.2 * len(runs)), dpi=90, layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (label, run) in zip(axes, runs.items()):
        scale = 1e3 if unit == "ms" else 1
        for s, stage in enumerate(run.busy):
            for start, stop, m in stage:
                ax.barh(s, (stop - start) * scale, left=start * scale, height=0.6,
                        color=PALETTE[m % len(PALETTE)], edgecolor="white", linewidth=0.5)
        ax.set_yticks(range(len(run.busy)), [f"stage {s}" for s in range(len(run.busy))])
        ax.invert_yaxis()
        ax.set_xlim(0, run.span * scale)
        ax.set_title(f"{label}: stages idle {run.idle_share():.0%} of the time", fontsize=10)
    axes[-1].set_xlabel(f"{unit} (a colour per micro-batch)")
    if title:
        fig.suptitle(title)
    return fig


def cost_figure(model: ModelShape, world_sizes=(2, 4, 8), links=LINKS, device=H100_SXM,
                batch: int = 1, title: str | None = None):
    """The cost model's decode step of ``model`` for each world size and link: reading the
    weights and the all-reduces stacked, ms; world sizes whose weights do not fit the devices
    are marked. (Lesson 11.)"""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), dpi=90, layout="constrained")
    axes = fig.subplots(1, len(links), sharey=True, squeeze=False)[0]
    for ax, link in zip(axes, links):
        estimates = [tp_decode_step(model, w, link, device, batch) for w in world_sizes]
        labels = [str(w) for w in world_sizes]
        ax.bar(labels, [e.weights * 1e3 for e in estimates], color=COMPUTE_COLOUR,
               label="reading the weights")
        ax.bar(labels, [e.comm * 1e3 for e in estimates],
               bottom=[e.weights * 1e3 for e in estimates], color=COMM_COLOUR, hatch="//",
               label="all-reduces")
        for i, e in enumerate(estimates):
            ax.text(i, e.total * 1e3, f"{e.total * 1e3:.1f}" + ("" if e.fits else "\ndoes not fit"),
                    ha="center", va="bottom", fontsize=8)
        ax.set_title(link.name, fontsize=10)
        ax.set_xlabel("GPUs")
        ax.margins(y=0.2)
    axes[0].set_ylabel("ms per decode step (model)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title or f"{model.name} at batch {batch} on {device.name}s: the cost model")
    return fig
