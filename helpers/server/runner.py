"""How a pass of the paged step runs the model: one call, three ways. (Lessons 08 and 10.)

Lesson 08's ``paged_next_token`` decides which rows feed which tokens and books them; the model
pass in the middle (its ``forward``) is what changes with the way a step runs:

* **eager**: the pass with the rows packed, no padding (``PackedStep``, not compiled);
* **compiled** (lesson 10, ``--compile``): the same pass through ``torch.compile``, its three
  graphs compiled at start-up;
* **CUDA graphs** (lesson 10, ``--cuda-graphs``, on a GPU): a decode pass replayed from the
  graph of its capture size (``graphs.GraphedDecode``);

and a pass in which a row uses a LoRA adapter runs lesson 08's own pass, each row with its
adapter (lesson 06's adapters work per row of a padded batch). ``Runner.pick(batch)`` says
which. Everything is compiled and captured here, at start-up, and nothing after
(``PackedStep.seal``): a step that would need a new graph runs eager instead and is counted
(``steps_eager_instead``), rather than stall every stream for the seconds a compile takes.

**The packed pass.** Lesson 08 pads the rows' new tokens into a (rows, longest) batch; here they
are packed one row after another into one sequence of T tokens, as vLLM does: the linear layers
see only real tokens, and the attention regroups the queries by row
(``packed_paged_attention``, beside lesson 08's own in ``helpers.paged.attention``). What keeps
``torch.compile`` to three graphs, not one per step:

* **the cache keeps its shape**: lesson 08's pool is allocated once; a step writes each new
  token's keys and values into it in place (``index_copy_``) and reads each row's history by
  pool index (lesson 03's contiguous cache grows by a column a step: a new shape every step);
* **the sizes that change are dynamic**: T tokens, R rows, Q new tokens at most a row, L
  positions in the longest history. One graph serves every decode step (Q = 1) of two rows or
  more, one every step that reads prompts (Q > 1), and one the decode step of a single row
  (torch compiles a size of 1 apart; a single row reading a prompt gets a second row on the
  scratch block instead of a fourth graph);
* **attention reads the pool in place**: in a compiled decode step it is written as two sums
  over the pool's entries (``in_place_decode_attention``), which inductor turns into loops that
  read each row's history where it lies: what vLLM's PagedAttention kernel does by hand.
"""

from __future__ import annotations

import logging
import time

import torch

from ..compilation import CAPTURE_SIZES
from ..paged import KVPool, PagedBatch
from ..paged.attention import COMPILED_ATTENTION, PackedInputs, packed_paged_attention
from . import startup
from .graphs import GraphedDecode, check_sizes

log = logging.getLogger("helpers.server")


#: The three kinds of step, each compiled at start-up: (what it is, starts, counts). Sizes that
#: differ from one another (T, R, Q, L), so that torch does not take two of them for one (it
#: would guard on their being equal).
WARM_UP = (("the decode step of one row", [2], [1]),
           ("every decode step of two rows or more", [4, 0, 0], [1, 1, 1]),
           ("every step that reads prompts", [2, 0], [3, 1]))


class PackedStep:
    """The paged layout's model pass with no padding: the new tokens of every row (a decode
    row's one token, a prompt's tokens or a chunk of them) packed into one sequence, its
    tensors built in a few vectorized operations; compiled once and reused, or eager.
    (Lessons 08, 10.)

    ``PackedStep(model, pool, scratch_block, pad_id, compile)``: ``scratch_block`` is a block
    of ``pool`` the block manager never hands out; padding entries read there. ``warm_up()``
    compiles; calling it is the model pass of lesson 08's ``paged_next_token`` (its
    ``forward``); batches with a LoRA row take lesson 08's own pass (``runner.Runner``).
    """

    def __init__(self, model, pool: KVPool, scratch_block: int, pad_id: int,
                 compile: bool = True):
        from transformers import AttentionInterface

        AttentionInterface.register(COMPILED_ATTENTION, packed_paged_attention)
        self.model, self.pool, self.pad_id = model, pool, pad_id
        self.scratch = scratch_block * pool.block_size    # the scratch block's first entry
        self.compiles = 0
        self.compile_seconds = 0.0
        self.compiled = compile
        self.sealed = False          # after start-up: a step that needs a new graph runs eager
        self.eager_instead = 0       # steps that did (each would have been a compile)
        self._forward = self._run_model
        if compile:
            self._forward = torch.compile(self._run_model, backend=self._counting_backend)

    # --- compiling ---------------------------------------------------------------------------

    def _counting_backend(self, graph_module, example_inputs):
        """torch.compile's backend: inductor, with each graph it compiles counted and timed."""
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        start = time.perf_counter()
        compiled = compile_fx(graph_module, example_inputs)
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def warm_up(self) -> None:
        """Compile the step for the three kinds of step there are (``WARM_UP``), saying each
        in the log as it starts and ends. Only the scratch block is read and written: no
        request's keys or values are touched."""
        start = time.perf_counter()
        block = self.scratch // self.pool.block_size
        with torch.inference_mode():
            for number, (what, starts, counts) in enumerate(WARM_UP, 1):
                began = time.perf_counter()
                startup.report("compiling graph %d of %d (%s)", number, len(WARM_UP), what)
                self._run(starts, counts, [[block]] * len(counts), [self.pad_id] * sum(counts))
                startup.report("graph %d of %d compiled in %.1f s", number, len(WARM_UP),
                               time.perf_counter() - began)
        startup.report("compiled the model's step in %.1f s (%d graphs; --compile off skips "
                       "it)", time.perf_counter() - start, self.compiles)

    def seal(self) -> None:
        """Start-up is over: from now on a step that would need a graph the warm-up did not
        make runs eager instead (and is counted in ``eager_instead``), so that no request ever
        waits for a compile. (Compiling takes seconds; one client's odd request would freeze
        every other client's stream for that long.)"""
        self.sealed = True

    def run_eager(self, why: str) -> None:
        """From now on, run the model eager (and say why in the log)."""
        self.compiled, self._forward = False, self._run_model
        log.warning("%s: running the model's step eager from now on", why)

    # --- one pass ---------------------------------------------------------------------------

    def __call__(self, batch: PagedBatch, rows: list[int], starts: list[int],
                 counts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Lesson 08's model pass with the rows' new tokens packed (``paged_next_token``'s
        ``forward``): row ``rows[i]`` feeds ``counts[i]`` tokens from position ``starts[i]``
        on, its blocks being ``tables[i]``. Returns each row's last-token logits, (R, 1,
        vocab)."""
        ids = [token for row, start, new in zip(rows, starts, counts)
               for token in batch.sequence(row)[start:start + new]]
        starts, counts, tables = list(starts), list(counts), list(tables)
        if len(rows) == 1 and counts[0] > 1:     # see _scratch_row
            self._scratch_row(starts, counts, tables, ids)
        return self._run(starts, counts, tables, ids)[:len(rows)]

    def _scratch_row(self, starts: list[int], counts: list[int], tables: list[list[int]],
                     ids: list[int]) -> None:
        """Add a row that reads and writes the scratch block only, one token at position 0
        (its output is dropped), to a step in which one row reads a prompt. torch compiles a
        dimension of size 1 apart from larger ones, so such a step would need a graph of its
        own; one token more is cheaper. (A step of one row and one token, the decode step of
        a single request, does get its graph: it is the most frequent step of all, and its
        graph of fixed sizes is the fastest.)"""
        starts.append(0)
        counts.append(1)
        tables.append([self.scratch // self.pool.block_size])
        ids.append(self.pad_id)

    def _run(self, starts: list[int], counts: list[int], tables: list[list[int]],
             ids: list[int]) -> torch.Tensor:
        """The model on one step's new tokens: row r feeds ``counts[r]`` tokens from position
        ``starts[r]`` on, its blocks being ``tables[r]``; ``ids`` are all the new tokens, row
        after row. Returns each row's last-token logits, (R, 1, vocab)."""
        device = self.model.device
        paged = PackedInputs.build(self.pool, self.scratch, tables, starts, counts, device)
        logits = self._call(torch.tensor([ids], device=device), paged)
        return logits[0][:, None]

    def _call(self, ids, paged: PackedInputs):
        """The model on one step's tensors (each contiguous: a compiled graph guards strides
        too), with the sizes that vary (T, R, Q and L) marked dynamic for the compiler; a
        size of 1 stays static (torch would specialize it anyway)."""
        dims = [(ids, 1), (paged.positions, 1), (paged.write_indices, 0),      # T
                (paged.output_indices, 0), (paged.last, 0), (paged.read_indices, 0),  # T, R
                (paged.query_indices, 0), (paged.mask, 0),                            # R
                (paged.query_indices, 1), (paged.mask, 2),                            # Q
                (paged.read_indices, 1), (paged.mask, 3)]                             # L
        for tensor, dim in dims:
            if tensor.shape[dim] > 1:
                torch._dynamo.mark_dynamic(tensor, dim)
        config = self.model.config        # the attention function the model's layers call
        previous, config._attn_implementation = config._attn_implementation, COMPILED_ATTENTION
        try:
            if not (self.sealed and self.compiled):
                return self._forward(ids, paged)
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._forward(ids, paged)
            except RuntimeError as err:
                if "fail_on_recompile" not in str(err):
                    raise
                if not self.eager_instead:
                    log.warning("a step needed a graph that start-up did not compile; it ran "
                                "eager instead (so do any such steps from now on): %s",
                                str(err).splitlines()[0])
                self.eager_instead += 1
                return self._run_model(ids, paged)
        finally:
            config._attn_implementation = previous

    def _run_model(self, ids, paged: PackedInputs):
        return self.model(input_ids=ids, position_ids=paged.positions, use_cache=False,
                          logits_to_keep=paged.last, paged=paged).logits


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
