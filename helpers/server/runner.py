"""How a pass of the paged step runs the model: one call, three ways. (Lessons 08 and 10.)

Lesson 08's ``paged_next_token`` decides which rows feed which tokens and books them; the model
pass in the middle is what changes with the way a step runs (``paged_next_token``'s
``forward``):

* **eager**: the pass packed without padding (``compiled.PackedStep``, not compiled);
* **compiled** (lesson 10, ``--compile``): the same pass through ``torch.compile``, its few
  graphs compiled at start-up;
* **CUDA graphs** (lesson 10, ``--cuda-graphs``, on a GPU): a decode pass replayed from the graph
  of its capture size (``graphs.GraphedDecode``);

and a pass in which a row uses a LoRA adapter runs lesson 08's own pass, each row with its
adapter. ``Runner.pick(batch)`` says which; everything is compiled and captured here, at
start-up, and nothing after (``PackedStep.seal``).
"""

from __future__ import annotations

import logging

from ..compilation import CAPTURE_SIZES
from .compiled import PackedStep
from .graphs import GraphedDecode, check_sizes

log = logging.getLogger("helpers.server")


def switch(name: str, value) -> str:
    """"auto", "on" or "off" (True and False stand for the last two); ValueError otherwise."""
    value = {True: "on", False: "off"}.get(value, value)
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{name} must be 'auto', 'on' or 'off', got {value!r}")
    return value


class Runner:
    """The model pass of the paged step, eager, compiled or replayed. (Lessons 08 and 10.)

    compile:     "on" (or True), "off" (or False), or "auto": on, but eager (with a warning in
                 the log) where compiling fails
    cuda_graphs: "auto" (on with a CUDA device, off elsewhere; off with a warning where
                 capturing fails), "on" (fail instead) or "off"
    graph_sizes: the capture sizes (those above ``max_batch_size`` are left out)
    capture:     how a step is recorded (default: lesson 10's ``record``); the tests give
                 ``helpers.compilation.rerun_each_replay`` to run the graphs' bookkeeping on a
                 CPU
    """

    def __init__(self, model, cache, scratch_block: int, pad_id: int, lora=None, *,
                 compile="off", cuda_graphs="off", graph_sizes=CAPTURE_SIZES, capture=None,
                 max_batch_size: int, max_total_tokens: int):
        compile, cuda_graphs = switch("compile", compile), switch("cuda_graphs", cuda_graphs)
        on_gpu = model.device.type == "cuda"
        graphs_wanted = cuda_graphs == "on" or (cuda_graphs == "auto" and on_gpu)
        if cuda_graphs == "on" and not on_gpu and capture is None:
            raise ValueError(f"cuda_graphs='on' needs a CUDA device; the model is on "
                             f"{model.device}")
        sizes = check_sizes(graph_sizes, max_batch_size) if graphs_wanted else ()
        self.packed = PackedStep(model, cache.pool, scratch_block, pad_id, compile != "off")
        if (compile != "off" or graphs_wanted) and lora is not None:
            # Every layer an adapter could touch is wrapped first, so that loading an adapter
            # later never changes the model the graphs were traced or captured from.
            lora.wrap_all()
        if compile != "off":
            try:
                self.packed.warm_up()
            except Exception as err:
                if compile == "on":
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    raise RuntimeError(f"compiling the step failed ({type(err).__name__}: "
                                       f"{first}); --compile auto would serve it eager "
                                       f"instead") from err
                self.packed.run_eager(f"compiling failed ({type(err).__name__}: {err})")
        self.graphs = None
        if graphs_wanted:
            self.graphs = GraphedDecode(self.packed, max_total_tokens, sizes, capture)
            try:
                self.graphs.capture_all()
            except Exception as err:
                if cuda_graphs == "on":
                    raise
                log.warning("capturing CUDA graphs failed (%s: %s): decode steps run without "
                            "them", type(err).__name__, err)
                self.graphs = None
        self.packed.seal()                   # nothing is compiled or captured from now on
        self.steps_compiled = 0

    def pick(self, batch, lora):
        """The model pass for this batch (``paged_next_token``'s ``forward``): a graph's
        replay, the packed step (compiled or eager), or None for lesson 08's own pass where a
        row uses an adapter. ``lora``: the engine's ``MultiLora``, or None without adapters."""
        why = self.graphs.why_not(batch) if self.graphs is not None else "no graphs"
        if why is not None and self.graphs is not None:
            self.graphs.fallbacks[why] += 1
        if any(batch.adapters):
            return None
        if lora is not None:                 # no row uses an adapter: none may be left set
            lora.set_rows(None)
        if why is None:
            return self._replay
        self.steps_compiled += self.packed.compiled
        return self.packed

    def _replay(self, batch, rows, starts, counts, tables):
        """A decode pass, one token a row, replayed from the graph of its capture size."""
        ids = [batch.sequence(row)[start] for row, start in zip(rows, starts)]
        return self.graphs.run(starts, tables, ids)

    def snapshot(self) -> dict:
        packed = self.packed
        graphs = self.graphs.snapshot() if self.graphs is not None else {}
        return {"compiles": packed.compiles, "compile_seconds": packed.compile_seconds,
                "steps_eager_instead": packed.eager_instead,
                "steps_compiled": self.steps_compiled, **graphs}

    def info(self) -> dict:
        return {"compiled": self.packed.compiled,
                "cuda_graph_sizes": list(self.graphs.sizes) if self.graphs is not None else []}
