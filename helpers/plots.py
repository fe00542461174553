"""Figures of the batching runs: one palette for every chart. (Lesson 03.)

Lesson 03 compares static and continuous batching with two figures, built here so that the
lesson can show the batching code itself and leave the drawing aside:

- ``durations_figure(traces)``: the wall time of each run, and how many requests were finished
  as time went on (``finish_times``);
- ``timelines_figure(traces)``: for each run, which request sat in which slot at every decode
  step (``plot_timeline`` draws one of them).

Each figure is drawn from the ``Trace`` objects that the drivers of ``helpers.batching`` fill in
and comes back as a matplotlib ``Figure`` (no pyplot: nothing global, nothing drawn twice); show
it with ``helpers.show_figure``. This module sits above ``helpers.batching``: it reads traces,
and batching never imports it (nor matplotlib).

All colours come from ``PALETTE``, which ``helpers.widgets`` draws its live plots with too. A timeline needs one colour per request, often more than the
palette has, so ``request_colours`` makes darker and lighter shades of the palette's colours.
"""

from __future__ import annotations

from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure

#: The course's colours, in order (Okabe-Ito: told apart with every common colour blindness).
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"]

#: The colour of each driver in the figures that compare them.
DRIVER_COLOURS = {"static": PALETTE[1], "continuous": PALETTE[0], "sequential": PALETTE[2],
                  "generate_batch": PALETTE[3]}

# Request colours: the palette without its yellow and black, which stand out too little from
# the white of an empty slot and from black labels; reordered so that the two blues (and the
# two oranges) are three requests apart rather than next to each other.
_HUES = [PALETTE[i] for i in (0, 1, 2, 5, 4, 3)]
# How far a shade may go towards black (negative) or white (positive). Not further: the
# lightest shade must stay apart from the white of an empty slot.
_DARKEST, _LIGHTEST = -0.6, 0.35


def request_colours(n: int) -> list[str]:
    """``n`` different colours, one per request, all made from ``PALETTE``. (Lesson 03.)

    Request ``k`` gets the ``k % 6``-th of six palette colours (yellow and black left out) in a
    shade that changes every 6 requests: first the palette's own colours, then darker, lighter, darker
    still, ... So requests that run at the same time (their ids are close) differ in hue or in
    shade, and no two requests share a colour however many there are.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    levels = -(-n // len(_HUES))                 # shades needed: ceil(n / hues)
    steps = max(1, levels // 2)                  # shade steps on each side of the palette
    shades = [0.0]
    for i in range(1, levels):
        k = (i + 1) // 2
        shades.append(_DARKEST * k / steps if i % 2 else _LIGHTEST * k / steps)
    colours = []
    for rid in range(n):
        rgb = to_rgb(_HUES[rid % len(_HUES)])
        shade = shades[rid // len(_HUES)]
        target = 0.0 if shade < 0 else 1.0
        colours.append(to_hex([c + abs(shade) * (target - c) for c in rgb]))
    return colours


def luminance(colour) -> float:
    """Relative luminance of a colour, 0 (black) to 1 (white), as the WCAG defines it."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(colour)]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(colour1, colour2) -> float:
    """WCAG contrast ratio of two colours: 1 (the same) to 21 (black on white)."""
    light, dark = sorted((luminance(colour1), luminance(colour2)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def _text_colour(colour) -> str:
    """Black or white, whichever stands out more on ``colour``."""
    return "black" if contrast(colour, "black") >= contrast(colour, "white") else "white"


# --- wall time and finish times ------------------------------------------------------------

def finish_times(trace) -> list[float]:
    """Seconds from the start until each request had its last token, sorted. (Lesson 03.)

    Read from the step record: a request is finished at the end of the last step in whose slots
    it sits. Merging and filtering are not in the record, so the times add up to a little less
    than ``trace.seconds``.
    """
    finished, clock = {}, 0.0
    for step in trace.steps:
        clock += step.seconds
        for rid in step.slots:
            if rid is not None:
                finished[rid] = clock
    return sorted(finished.values())


def durations_figure(traces: dict) -> Figure:
    """Left, the wall time of every run; right, requests finished over time. (Lesson 03.)

    ``traces`` maps a name (``"static"``, ``"continuous"``, ...) to a driver's ``Trace``.
    """
    _check_traces(traces)
    fig = Figure(figsize=(9, 3.2), dpi=90, layout="constrained")
    bars, curve = fig.subplots(1, 2, width_ratios=[1, 2])
    for i, (name, trace) in enumerate(traces.items()):
        colour = _colour_of(name, i)
        bars.bar(i, trace.seconds, color=colour)
        bars.text(i, trace.seconds, f"{trace.seconds:.2f} s", ha="center", va="bottom")
        times = finish_times(trace)
        curve.step([0] + times, range(len(times) + 1), where="post", color=colour, label=name)
    bars.set_xticks(range(len(traces)), list(traces))
    bars.set_ylabel("seconds for the whole queue")
    bars.margins(y=0.15)
    curve.set_xlabel("seconds since the queue started")
    curve.set_ylabel("requests finished")
    curve.legend(loc="lower right")
    curve.grid(alpha=0.3)
    return fig


def _colour_of(name: str, index: int) -> str:
    return DRIVER_COLOURS.get(name, PALETTE[index % len(PALETTE)])


# --- the slot-by-step timeline -------------------------------------------------------------

def plot_timeline(trace, ax=None, title: str | None = None, fontsize: float = 9):
    """Draw which request sat in which slot at every decode step. (Lesson 03.)

    One row of the picture per slot, one column per decode step; a coloured cell is a slot
    serving a request (each request has its own colour, see ``request_colours``, and its number
    is written in the middle of its stay), a white cell a slot that computes nothing useful.
    Returns the matplotlib Figure (a new one unless ``ax`` is given).
    """
    table = trace.occupancy("decode")
    n_slots = max([len(slots) for slots in table] + [trace.batch_size, 1])
    n_steps = max(len(table), 1)
    if ax is None:
        fig = Figure(figsize=(9, 1.2 + 0.3 * n_slots), dpi=90, layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    requests = [rid for slots in table for rid in slots if rid is not None]
    colours = request_colours(max(requests, default=-1) + 1)
    white = (1.0, 1.0, 1.0)
    image = [[white] * n_steps for _ in range(n_slots)]
    for step, slots in enumerate(table):
        for slot, rid in enumerate(slots):
            if rid is not None:
                image[slot][step] = to_rgb(colours[rid])
    ax.imshow(image, aspect="auto", interpolation="nearest",
              extent=(0, n_steps, n_slots - 0.5, -0.5))
    # Label every stay of a request in a slot once, in its middle.
    for slot in range(n_slots):
        for rid, first, last in _stays(table, slot):
            ax.text((first + last + 1) / 2, slot, str(rid), ha="center", va="center",
                    fontsize=fontsize, color=_text_colour(colours[rid]))
    ax.set_yticks(range(n_slots))
    ax.tick_params(labelsize=fontsize)
    ax.set_xlabel("decode step", fontsize=fontsize + 1)
    ax.set_ylabel("slot", fontsize=fontsize + 1)
    ax.set_title(title if title is not None else
                 f"{trace.driver}: {len(table)} decode steps, {trace.utilization():.0%} of slots busy",
                 fontsize=fontsize + 2)
    return fig


def _stays(table, slot):
    """(request id, first step, last step) of every uninterrupted stay in ``slot``."""
    stays, current = [], None
    for step, slots in enumerate(table):
        rid = slots[slot] if slot < len(slots) else None
        if current is not None and rid == current[0]:
            current[2] = step
            continue
        if current is not None:
            stays.append(tuple(current))
        current = [rid, step, step] if rid is not None else None
    if current is not None:
        stays.append(tuple(current))
    return stays


def timelines_figure(traces: dict) -> Figure:
    """One timeline per run, stacked, on the same scale of decode steps. (Lesson 03.)"""
    _check_traces(traces)
    slots = max(max(trace.batch_size, 1) for trace in traces.values())
    # About 0.3 inch per slot, less when there are many (a 32-slot run stays readable), and
    # labels that fit the height of a slot (72 points to the inch).
    row = 0.3 if slots <= 8 else max(0.17, 2.4 / slots)
    fontsize = min(9, max(6, round(0.6 * 72 * row, 1)))
    fig = Figure(figsize=(9, (1.1 + row * slots) * len(traces)), dpi=90, layout="constrained")
    axes = fig.subplots(len(traces), 1, squeeze=False)[:, 0]
    longest = max(max(trace.decode_steps, 1) for trace in traces.values())
    for ax, trace in zip(axes, traces.values()):
        plot_timeline(trace, ax=ax, fontsize=fontsize)
        ax.set_xlim(0, longest)          # the same time scale for all
    return fig


def _check_traces(traces) -> None:
    if not isinstance(traces, dict) or not traces:
        raise ValueError("traces must be a non-empty dict of name -> Trace, e.g. "
                         "{'static': static_trace, 'continuous': continuous_trace}")


# --- the paged KV cache (lesson 08) ----------------------------------------------------------

#: Lesson 08 compares a way of doing things with a better one in every figure: the first
#: (padded cache, no prefix caching, whole prompt) in the colour of lesson 03's static
#: batching, the second in that of continuous batching, further ones in the next colours.
COMPARISON_COLOURS = [PALETTE[1], PALETTE[0], PALETTE[2], PALETTE[3], PALETTE[4], PALETTE[5]]


def kv_memory_figure(reserved, paged, used, block_size: int) -> Figure:
    """KV memory at every decode step: padded cache, paged cache, real tokens. (Lesson 8.)

    The three lists hold one number per decode step (lesson 8 gives KiB): what the padded
    cache reserves (rows × width), what a paged cache with blocks of ``block_size`` tokens
    holds, and what the rows' real tokens take. The used memory is drawn in black: the floor
    that the other two are measured against.
    """
    series = {"reserved": reserved, "paged": paged, "used": used}
    for name, values in series.items():
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not len(values):
            raise ValueError(f"{name} must be a non-empty list of numbers, one per decode step")
    if len({len(values) for values in series.values()}) != 1:
        raise ValueError("reserved, paged and used must have one value per decode step each, got "
                         f"{len(reserved)}, {len(paged)} and {len(used)} values")
    fig = Figure(figsize=(8, 3.5), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(reserved, color=COMPARISON_COLOURS[0], label="padded cache: reserved (rows × width)")
    ax.plot(paged, color=COMPARISON_COLOURS[1], label=f"paged cache: blocks of {block_size} held")
    ax.plot(used, color=PALETTE[7], label="used (real tokens)")
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV memory (KiB)")
    ax.set_ylim(0, max(max(values) for values in series.values()) * 1.4)   # room for the legend
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def bars_figure(values: dict, ylabel: str, title: str | None = None) -> Figure:
    """One bar per way of doing something, its value written on top. (Lesson 8.)

    ``values`` maps a name to a number, the way to beat first: lesson 8 draws the requests
    that fit in one KV budget (padded, paged) and the streams' worst inter-token gap (whole
    prompt, chunks). Colours follow ``COMPARISON_COLOURS``.
    """
    if not isinstance(values, dict) or not values:
        raise ValueError("values must be a non-empty dict of name -> number, e.g. "
                         "{'padded': 8, 'paged': 27}")
    fig = Figure(figsize=(1.6 + 1.4 * len(values), 3), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    for i, (name, value) in enumerate(values.items()):
        ax.bar(i, value, color=COMPARISON_COLOURS[i % len(COMPARISON_COLOURS)])
        ax.text(i, value, f"{value:.3g}", ha="center", va="bottom")
    ax.set_xticks(range(len(values)), list(values))
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.margins(y=0.15)
    return fig


def ttft_figure(ttfts: dict) -> Figure:
    """Time to first token of each request, one line per setting. (Lesson 8.)

    ``ttfts`` maps a setting (``"no prefix caching"``, ``"prefix caching"``) to the TTFT of
    request 0, 1, ... in seconds; drawn in milliseconds. Colours follow ``COMPARISON_COLOURS``.
    """
    if not isinstance(ttfts, dict) or not ttfts or not all(
            hasattr(times, "__len__") and len(times) for times in ttfts.values()):
        raise ValueError("ttfts must be a non-empty dict of setting -> TTFT in seconds of each "
                         "request, e.g. {'prefix caching': [0.03, 0.005]}")
    fig = Figure(figsize=(7, 3), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    for i, (name, times) in enumerate(ttfts.items()):
        ax.plot(range(len(times)), [t * 1000 for t in times], marker="o", label=name,
                color=COMPARISON_COLOURS[i % len(COMPARISON_COLOURS)])
    longest = max(len(times) for times in ttfts.values())
    ax.set_xticks(range(longest))
    ax.set_xlabel("request")
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


# --- speculative decoding (lesson 09) --------------------------------------------------------

def speculation_figure(sweeps: dict, plain_tokens_per_second: float,
                       predicted: dict | None = None) -> Figure:
    """Acceptance (left) and tokens per second (right) against k, one line per proposer.
    (Lesson 09.)

    ``sweeps`` maps a proposer's name to ``{k: (acceptance, tokens per second)}``; plain greedy
    decoding is the dashed line at ``plain_tokens_per_second``. ``predicted`` (optional) maps a
    proposer's name to ``{k: tokens per second}`` from the cost model, drawn dotted in the same
    colour, so that model and measurement can be compared point by point.
    """
    if not isinstance(sweeps, dict) or not sweeps or not all(
            isinstance(points, dict) and points for points in sweeps.values()):
        raise ValueError("sweeps must be a non-empty dict of proposer -> {k: (acceptance, "
                         "tokens per second)}, e.g. {'prompt lookup': {1: (0.9, 1500.0)}}")
    if not plain_tokens_per_second > 0:
        raise ValueError(f"plain_tokens_per_second must be positive, got {plain_tokens_per_second!r}")
    fig = Figure(figsize=(9, 3.3), dpi=90, layout="constrained")
    accept, speed = fig.subplots(1, 2)
    for i, (name, points) in enumerate(sweeps.items()):
        colour = PALETTE[i % len(PALETTE)]
        ks = sorted(points)
        accept.plot(ks, [points[k][0] for k in ks], marker="o", color=colour, label=name)
        speed.plot(ks, [points[k][1] for k in ks], marker="o", color=colour, label=name)
        if predicted and name in predicted:
            model_ks = sorted(predicted[name])
            speed.plot(model_ks, [predicted[name][k] for k in model_ks], linestyle=":",
                       color=colour, label=f"{name}: cost model")
    speed.axhline(plain_tokens_per_second, linestyle="--", color=PALETTE[7], label="plain greedy")
    accept.set_ylim(0, 1.05)
    accept.set_ylabel("guesses accepted")
    speed.set_ylim(bottom=0)
    speed.set_ylabel("tokens per second")
    for ax in (accept, speed):
        ax.set_xlabel("k (tokens proposed per verify)")
        ax.grid(alpha=0.3)
    accept.legend(loc="lower left")
    speed.legend(loc="best", fontsize=8)
    return fig


def pass_cost_figure(pass_seconds: dict, draft_step: float | None = None) -> Figure:
    """What one forward pass costs against the tokens it feeds, in milliseconds. (Lesson 09.)

    ``pass_seconds`` maps the number of new tokens fed in one pass (1, 2, ...) to its time in
    seconds; ``draft_step`` (optional) is the draft model's pass over one token, drawn as a
    dashed line to compare with.
    """
    if not isinstance(pass_seconds, dict) or not pass_seconds:
        raise ValueError("pass_seconds must be a non-empty dict of tokens fed -> seconds, "
                         "e.g. {1: 0.001, 2: 0.0012}")
    if draft_step is not None and not draft_step > 0:
        raise ValueError(f"draft_step must be a positive number of seconds, got {draft_step!r}")
    fig = Figure(figsize=(6, 3), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    tokens = sorted(pass_seconds)
    ax.plot(tokens, [pass_seconds[n] * 1000 for n in tokens], marker="o", color=PALETTE[0],
            label="model")
    if draft_step is not None:
        ax.axhline(draft_step * 1000, color=PALETTE[2], linestyle="--", label="draft, 1 token")
    ax.set_xlabel("tokens fed in one pass")
    ax.set_ylabel("ms per pass")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def payoff_figure(ratios, speedups: dict, ours: float | None = None) -> Figure:
    """The cost model's speed-up against the draft's cost, one curve per k. (Lesson 09.)

    ``ratios`` are draft step / plain step values (the x axis); ``speedups`` maps k to the
    predicted speed-up at each ratio. The dashed line at 1 is plain decoding: below it the
    draft does not pay. ``ours`` (optional) marks our draft's ratio with a dotted line.
    """
    ratios = list(ratios)
    if not ratios:
        raise ValueError("ratios must be a non-empty list of draft step / plain step values")
    if not isinstance(speedups, dict) or not speedups or not all(
            hasattr(values, "__len__") and len(values) == len(ratios) for values in speedups.values()):
        raise ValueError(f"speedups must be a non-empty dict of k -> one predicted speed-up per "
                         f"ratio ({len(ratios)} values each)")
    fig = Figure(figsize=(6, 3.2), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    for i, (k, values) in enumerate(speedups.items()):
        ax.plot(ratios, list(values), color=PALETTE[i % len(PALETTE)], label=f"k = {k}")
    ax.axhline(1, color=PALETTE[7], linestyle="--", linewidth=1)
    if ours is not None:
        ax.axvline(ours, color="grey", linestyle=":", label="our draft")
    ax.set_xlabel("draft step / plain decoding step")
    ax.set_ylabel("predicted speed-up")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig
