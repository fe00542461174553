"""Lesson 03's figures (helpers.plots): they build, draw only with the course's palette, and give
every request a colour of its own with a label that can be read.

The traces are made by hand (no model), so every cell of a timeline is known in advance.
"""

import ast
import io
import pathlib

import pytest
from matplotlib.colors import to_hex, to_rgb

import helpers
from helpers.batching import Step, Trace
from helpers.plots import (DRIVER_COLOURS, PALETTE, contrast, durations_figure, finish_times,
                           plot_timeline, request_colours, timelines_figure)

ROOT = pathlib.Path(__file__).resolve().parents[1]
WHITE = "#ffffff"


def hand_made_trace(driver: str, slots_per_step: list[list[int | None]], seconds=0.01) -> Trace:
    """A trace of decode steps only, each with the given slot contents."""
    steps = [Step("decode", [rid for rid in slots if rid is not None], list(slots), seconds,
                  sum(rid is not None for rid in slots)) for slots in slots_per_step]
    return Trace(driver=driver, batch_size=len(slots_per_step[0]), steps=steps,
                 seconds=seconds * len(steps))


def course_like_traces() -> dict:
    """Static and continuous runs of 16 requests on 4 slots: every 4th wants 9 decode steps,
    the others 2 (the shape of lesson 03's queue, smaller)."""
    lengths = [9 if rid % 4 == 0 else 2 for rid in range(16)]
    static = []
    for first in range(0, 16, 4):
        ids = list(range(first, first + 4))
        for step in range(max(lengths[i] for i in ids)):
            static.append([rid if step < lengths[rid] else None for rid in ids])
    continuous, slots, left, queue = [], [None] * 4, [0] * 4, list(range(16))
    while queue or any(rid is not None for rid in slots):
        for slot in range(4):
            if slots[slot] is None and queue:
                slots[slot] = queue.pop(0)
                left[slot] = lengths[slots[slot]]
        continuous.append(list(slots))
        for slot in range(4):
            if slots[slot] is not None:
                left[slot] -= 1
                if left[slot] == 0:
                    slots[slot] = None
    return {"static": hand_made_trace("static", static),
            "continuous": hand_made_trace("continuous", continuous)}


def png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# --- the palette -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 6, 7, 8, 32, 100, 300])
def test_every_request_gets_a_colour_of_its_own(n):
    colours = request_colours(n)
    assert len(colours) == n and len(set(colours)) == n
    # Readable on a white page: none is as light as an empty slot.
    assert min(contrast(colour, WHITE) for colour in colours) > 1.5


def test_request_colours_start_with_the_palette():
    first = request_colours(6)
    assert set(first) <= {to_hex(colour) for colour in PALETTE}
    assert request_colours(40)[:6] == first


def test_driver_colours_come_from_the_palette():
    assert set(DRIVER_COLOURS.values()) <= set(PALETTE)
    assert DRIVER_COLOURS["static"] != DRIVER_COLOURS["continuous"]


def test_live_plots_use_the_same_palette():
    import helpers.widgets

    assert helpers.widgets.PALETTE is PALETTE


def test_bad_input_raises():
    with pytest.raises(ValueError, match="n must be a non-negative integer"):
        request_colours(-1)
    with pytest.raises(ValueError, match="traces must be a non-empty dict"):
        durations_figure({})
    with pytest.raises(ValueError, match="traces must be a non-empty dict"):
        timelines_figure([Trace()])


# --- the figures -----------------------------------------------------------------------------

def test_durations_figure_draws_both_runs_in_their_colours():
    traces = course_like_traces()
    fig = durations_figure(traces)
    bars, curve = fig.axes
    assert [to_hex(patch.get_facecolor()) for patch in bars.patches] == \
        [to_hex(DRIVER_COLOURS["static"]), to_hex(DRIVER_COLOURS["continuous"])]
    assert [line.get_label() for line in curve.get_lines()] == ["static", "continuous"]
    assert [to_hex(line.get_color()) for line in curve.get_lines()] == \
        [to_hex(DRIVER_COLOURS["static"]), to_hex(DRIVER_COLOURS["continuous"])]
    assert png(fig).startswith(b"\x89PNG")


def test_finish_times_are_the_end_of_each_requests_last_step():
    trace = hand_made_trace("static", [[0, 1], [0, None], [0, None]], seconds=0.5)
    assert finish_times(trace) == [0.5, 1.5]


def timeline_cells(ax) -> dict:
    """(slot, step) -> RGB of the timeline image on ``ax``."""
    image = ax.get_images()[0].get_array()
    return {(slot, step): tuple(round(float(c), 6) for c in image[slot, step][:3])
            for slot in range(image.shape[0]) for step in range(image.shape[1])}


@pytest.mark.parametrize("name", ["static", "continuous"])
def test_timeline_colours_each_request_by_itself(name):
    trace = course_like_traces()[name]
    fig = plot_timeline(trace)
    ax = fig.axes[0]
    cells = timeline_cells(ax)
    colour_of = {}
    for step, slots in enumerate(trace.occupancy("decode")):
        for slot, rid in enumerate(slots):
            colour = cells[(slot, step)]
            if rid is None:
                assert colour == (1.0, 1.0, 1.0)                  # white: serves nobody
            else:
                assert colour_of.setdefault(rid, colour) == colour   # one colour per request
    assert len(set(colour_of.values())) == len(colour_of) == 16      # none shared
    expected = {rid: tuple(round(c, 6) for c in to_rgb(hexa))
                for rid, hexa in enumerate(request_colours(16))}
    assert colour_of == expected
    # Every request labelled once per stay, legibly, in black or white, whichever contrasts more.
    labels = [text for text in ax.texts]
    assert sorted(int(text.get_text()) for text in labels) == list(range(16))
    for text in labels:
        assert text.get_fontsize() >= 8
        background = request_colours(16)[int(text.get_text())]
        assert contrast(text.get_color(), background) >= 4.5
    assert ax.get_xlabel() == "decode step"
    assert png(fig).startswith(b"\x89PNG")


def test_timelines_share_the_step_scale_and_stay_legible_with_many_slots():
    traces = course_like_traces()
    fig = timelines_figure(traces)
    assert len(fig.axes) == 2
    longest = max(trace.decode_steps for trace in traces.values())
    assert all(ax.get_xlim() == (0, longest) for ax in fig.axes)
    assert fig.axes[0].get_title().startswith("static: ")
    # 32 slots: smaller labels, never unreadably small.
    wide = hand_made_trace("continuous", [list(range(32))] * 3)
    fig = timelines_figure({"continuous": wide})
    assert min(text.get_fontsize() for text in fig.axes[0].texts) >= 6
    assert png(fig).startswith(b"\x89PNG")


def test_plot_timeline_is_still_exported_from_helpers():
    assert helpers.plot_timeline is plot_timeline
    assert helpers.timelines_figure is timelines_figure


def test_lower_layers_do_not_import_the_plots():
    """helpers.batching records traces and draws nothing: no matplotlib, no helpers.plots."""
    tree = ast.parse((ROOT / "helpers" / "batching.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert not any(name.startswith(("matplotlib", ".plots", "helpers.plots")) for name in imported)


# --- lesson 08's figures -----------------------------------------------------------------------

from helpers.plots import COMPARISON_COLOURS, bars_figure, kv_memory_figure, ttft_figure  # noqa: E402


def test_lesson_8_colours_come_from_the_palette():
    assert set(COMPARISON_COLOURS) <= set(PALETTE)
    assert len(set(COMPARISON_COLOURS)) == len(COMPARISON_COLOURS)


def test_kv_memory_figure_draws_the_three_series_as_given():
    reserved, paged, used = [40.0, 64.0, 96.0], [32.0, 32.0, 64.0], [20.0, 30.0, 40.0]
    fig = kv_memory_figure(reserved, paged, used, block_size=16)
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [list(line.get_ydata()) for line in lines] == [reserved, paged, used]
    assert [list(line.get_xdata()) for line in lines] == [[0, 1, 2]] * 3
    assert "blocks of 16" in lines[1].get_label()
    assert to_hex(lines[2].get_color()) == "#000000"                 # used: the black floor
    assert {to_hex(line.get_color()) for line in lines} <= {to_hex(c) for c in PALETTE}
    assert ax.get_xlabel() == "decode step" and ax.get_ylabel() == "KV memory (KiB)"
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > max(reserved)
    assert png(fig).startswith(b"\x89PNG")


def test_bars_figure_draws_one_bar_per_value_in_order():
    fig = bars_figure({"padded": 8, "paged": 27}, "requests running at once", "one KV budget")
    (ax,) = fig.axes
    assert [patch.get_height() for patch in ax.patches] == [8, 27]
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["padded", "paged"]
    assert [to_hex(patch.get_facecolor()) for patch in ax.patches] == \
        [to_hex(colour) for colour in COMPARISON_COLOURS[:2]]
    assert [text.get_text() for text in ax.texts] == ["8", "27"]     # each value written on top
    assert ax.get_ylabel() == "requests running at once" and ax.get_title() == "one KV budget"
    assert png(fig).startswith(b"\x89PNG")


def test_ttft_figure_draws_each_setting_in_milliseconds():
    ttfts = {"no prefix caching": [0.030, 0.025, 0.027], "prefix caching": [0.031, 0.005, 0.004]}
    fig = ttft_figure(ttfts)
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == list(ttfts)
    for line, times in zip(lines, ttfts.values()):
        assert list(line.get_xdata()) == [0, 1, 2]
        assert list(line.get_ydata()) == pytest.approx([t * 1000 for t in times])
    assert [to_hex(line.get_color()) for line in lines] == \
        [to_hex(colour) for colour in COMPARISON_COLOURS[:2]]
    assert ax.get_xlabel() == "request" and ax.get_ylabel() == "TTFT (ms)"
    assert png(fig).startswith(b"\x89PNG")


def test_lesson_8_figures_refuse_bad_input():
    with pytest.raises(ValueError, match="one value per decode step"):
        kv_memory_figure([1, 2, 3], [1, 2], [1, 2, 3], block_size=16)
    with pytest.raises(ValueError, match="used must be a non-empty list"):
        kv_memory_figure([1], [1], [], block_size=16)
    with pytest.raises(ValueError, match="values must be a non-empty dict"):
        bars_figure({}, "requests")
    with pytest.raises(ValueError, match="ttfts must be a non-empty dict"):
        ttft_figure({"prefix caching": []})


# --- lesson 09's figures -----------------------------------------------------------------------

from helpers.plots import pass_cost_figure, payoff_figure  # noqa: E402


def test_pass_cost_figure_draws_milliseconds_and_the_draft_line():
    pass_seconds = {1: 0.001, 2: 0.0015, 3: 0.002}
    fig = pass_cost_figure(pass_seconds, draft_step=0.0004)
    (ax,) = fig.axes
    model_line, draft_line = ax.get_lines()
    assert list(model_line.get_xdata()) == [1, 2, 3]
    assert list(model_line.get_ydata()) == pytest.approx([1.0, 1.5, 2.0])
    assert list(draft_line.get_ydata()) == pytest.approx([0.4, 0.4])   # a horizontal line
    assert [model_line.get_label(), draft_line.get_label()] == ["model", "draft, 1 token"]
    assert {to_hex(line.get_color()) for line in ax.get_lines()} <= {to_hex(c) for c in PALETTE}
    assert ax.get_xlabel() == "tokens fed in one pass" and ax.get_ylabel() == "ms per pass"
    assert len(pass_cost_figure(pass_seconds).axes[0].get_lines()) == 1   # no draft: no line
    assert png(fig).startswith(b"\x89PNG")


def test_payoff_figure_draws_one_curve_per_k_and_the_break_even_line():
    ratios = [0.0, 0.5, 1.0]
    speedups = {1: [1.5, 1.0, 0.7], 4: [2.5, 0.9, 0.5]}
    fig = payoff_figure(ratios, speedups, ours=0.4)
    (ax,) = fig.axes
    curves = [line for line in ax.get_lines() if line.get_label().startswith("k = ")]
    assert [line.get_label() for line in curves] == ["k = 1", "k = 4"]
    for line, values in zip(curves, speedups.values()):
        assert list(line.get_xdata()) == ratios and list(line.get_ydata()) == values
    labels = {line.get_label(): line for line in ax.get_lines()}
    assert list(labels["our draft"].get_xdata()) == [0.4, 0.4]      # a vertical line at ours
    assert any(list(line.get_ydata()) == [1, 1] for line in ax.get_lines())   # break-even at 1
    assert ax.get_xlabel() == "draft step / plain decoding step"
    assert ax.get_ylabel() == "predicted speed-up"
    assert png(fig).startswith(b"\x89PNG")


def test_lesson_9_figures_refuse_bad_input():
    with pytest.raises(ValueError, match="pass_seconds must be a non-empty dict"):
        pass_cost_figure({})
    with pytest.raises(ValueError, match="draft_step must be a positive"):
        pass_cost_figure({1: 0.001}, draft_step=0)
    with pytest.raises(ValueError, match="ratios must be a non-empty list"):
        payoff_figure([], {1: []})
    with pytest.raises(ValueError, match="one predicted speed-up per ratio"):
        payoff_figure([0.0, 0.5], {1: [1.0]})
