"""CUDA graphs for the paged layout's decode passes, each replayed with a launch or two
(a small model's decode step is bound by kernel launches). (Lessons 08 and 10.)

A graph's shapes and addresses are fixed: a batch of n rows replays the graph of the smallest
capture size that holds it (the rest padding, on the scratch block), every row reading
L = ``max_total_tokens`` pool entries, from one GPU buffer filled by one copy a step. Steps that
read prompts or use adapters, and larger batches, run the packed step instead (``fallbacks``).
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from ..compilation import CAPTURE_SIZES, capture_size, record
from ..paged.attention import PackedInputs
from . import startup

#: A row's columns in ``inputs``: its new token, the token's position, the pool index its keys
#: and values go to, its history's length; then the L pool indices of its history.
ID, POSITION, WRITE, LENGTH, READ = 0, 1, 2, 3, 4


def _fresh(view: torch.Tensor) -> torch.Tensor:
    """A copy of part of ``inputs`` with plain contiguous strides, even where a size is 1, as
    the compiled step was traced with (torch guards on strides)."""
    return view.clone(memory_format=torch.contiguous_format)


class GraphedDecode:
    """The decode step of ``packed`` (a ``PackedStep``) captured as one graph per capture size
    (``capture_all()``); called, it replays the step as ``PackedStep`` runs it. ``length``: L,
    the most positions a row's history may have. (Lesson 10.)"""

    def __init__(self, packed, length: int, sizes=CAPTURE_SIZES, capture=None):
        self.packed = packed
        self.sizes = tuple(sorted(sizes))
        self.length = length
        device = packed.model.device
        largest = self.sizes[-1]
        on_gpu = device.type == "cuda"
        # Made as the engine's steps make their tensors (in inference mode), so that the
        # compiled step's guards see the same kind of tensor.
        with torch.inference_mode():
            self.staging = torch.zeros(largest, READ + length, dtype=torch.long,
                                       pin_memory=on_gpu)
            self.inputs = torch.zeros(largest, READ + length, dtype=torch.long, device=device)
            # A padding row: reads and writes the scratch entry only, a history of one.
            self.padding = torch.full((READ + length,), packed.scratch, dtype=torch.long)
            self.padding[ID], self.padding[POSITION], self.padding[LENGTH] = packed.pad_id, 0, 1
            self._positions = torch.arange(length, device=device)
            # Row r's query, output and last token are token r: three tensors, or torch would
            # guard on two arguments being one.
            self._query = torch.arange(largest, device=device)[:, None].contiguous()
            self._output = torch.arange(largest, device=device)
            self._last = torch.arange(largest, device=device)
        self.capture = capture          # None: lesson 10's ``record`` (the tests: a stand-in)
        self.pool = None                # the graphs' shared memory pool
        self.graphs: dict[int, tuple] = {}         # size -> (replay, output)
        self.replays = 0
        self.padded_rows = 0                       # rows replayed for nothing
        self.fallbacks: Counter = Counter()        # decode-or-not steps that did not replay
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def capture_all(self) -> None:
        """Record one graph per capture size on padding rows, largest first (the later ones
        reuse its memory pool)."""
        start = time.perf_counter()
        on_gpu = self.inputs.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.inputs.device) if on_gpu else 0
        for number, size in enumerate(reversed(self.sizes), 1):
            startup.report("capturing the decode step for %d rows (graph %d of %d)", size,
                           number, len(self.sizes))
            with torch.inference_mode():
                self._stage([], [], [], size)
                body = lambda size=size: self._body(size)   # noqa: E731
                if self.capture is None:
                    replay, output, self.pool = record(body, self.inputs.device, self.pool)
                    self.graphs[size] = (replay, output)
                else:
                    self.graphs[size] = self.capture(body)
        if on_gpu:
            torch.cuda.synchronize(self.inputs.device)
            self.memory_bytes = torch.cuda.memory_reserved(self.inputs.device) - before
        self.capture_seconds = time.perf_counter() - start
        startup.report("captured %d CUDA graphs (sizes %s) in %.1f s, %.1f MiB",
                       len(self.graphs), ",".join(map(str, self.sizes)), self.capture_seconds,
                       self.memory_bytes / 2**20)

    def _body(self, size: int) -> torch.Tensor:
        """The step a graph records: the model on the first ``size`` rows of ``inputs``."""
        rows = self.inputs[:size]
        lengths = rows[:, LENGTH]
        mask = (self._positions[None, :] < lengths[:, None])[:, None, None, :]   # (R,1,1,L)
        paged = PackedInputs(self.packed.pool, _fresh(rows[:, WRITE]), _fresh(rows[:, READ:]),
                             self._query[:size], self._output[:size], mask,
                             _fresh(rows[:, POSITION].reshape(1, size)), self._last[:size])
        return self.packed._call(_fresh(rows[:, ID].reshape(1, size)), paged)

    def replays_for(self, batch) -> bool:
        """Whether this batch can replay a graph; if not, the reason is counted."""
        why = ("prompt" if not batch.prefilled          # some row reads prompt tokens
               else "adapter" if any(batch.adapters)
               else "rows" if sum(not done for done in batch.done) > self.sizes[-1] else None)
        if why is not None:
            self.fallbacks[why] += 1
        return why is None

    def __call__(self, batch, rows, starts, counts, tables) -> torch.Tensor:
        return self.run(starts, tables, [batch.sequence(row)[start]
                                         for row, start in zip(rows, starts)])

    def run(self, starts: list[int], tables: list[list[int]], ids: list[int]) -> torch.Tensor:
        """Replay the graph of their capture size for these rows (row r: ``starts[r]`` tokens in
        its blocks ``tables[r]``, feeding ``ids[r]``); their logits, (rows, 1, vocab)."""
        size = capture_size(len(ids), self.sizes)
        self._stage(starts, tables, ids, size)
        replay, output = self.graphs[size]
        replay()
        self.replays += 1
        self.padded_rows += size - len(ids)
        return output[0, :len(ids), None]

    def _stage(self, starts, tables, ids, size: int) -> None:
        """Fill the first ``size`` rows of ``staging`` (the real rows, then padding) and copy
        them to ``inputs`` in one transfer."""
        rows = len(ids)
        staging = self.staging
        if rows:
            built = PackedInputs.build(self.packed.pool, self.packed.scratch, tables, starts,
                                       [1] * rows, "cpu", length=self.length)
            staging[:rows, ID] = torch.tensor(ids)
            staging[:rows, POSITION] = built.positions[0]
            staging[:rows, WRITE] = built.write_indices
            staging[:rows, LENGTH] = torch.tensor(starts) + 1
            staging[:rows, READ:] = built.read_indices
        staging[rows:size] = self.padding
        self.inputs[:size].copy_(staging[:size], non_blocking=True)

    def snapshot(self) -> dict:
        return {"cuda_graph_captures": len(self.graphs), "cuda_graph_replays": self.replays,
                "cuda_graph_padded_rows": self.padded_rows,
                "cuda_graph_fallbacks": dict(self.fallbacks),
                "cuda_graph_memory_bytes": self.memory_bytes,
                "cuda_graph_capture_seconds": self.capture_seconds}
