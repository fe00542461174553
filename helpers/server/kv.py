"""The KV layouts the engine is given, and how the paged one runs its passes. (Lessons 03,
07, 08 and 10.)

A layout answers ``Engine.step``'s questions: ``admits()`` (may requests join now?),
``admit(sequence)`` (room for it? then reserved), ``passes()`` (this turn's batches) and
``forward(batch, adapters, choose)``. ``PagedKV``'s ``Runner`` runs a pass packed as vLLM does
(``PackedStep``), eager or compiled, or replays it as a CUDA graph (``graphs.py``).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..batching import (Batch, batch_from_token_ids, filter_batch, generate_next_token,
                        merge_batches)
from ..paged import (KVPool, PagedBatch, PagedKVCache, PoolExhausted, filter_paged_batch,
                     kv_shape, merge_paged_batches, paged_next_token)
from ..paged.attention import COMPILED_ATTENTION, PackedInputs, packed_paged_attention
from ..paged.batching import check_prefill_budget, paged_batch_from_token_ids
from . import startup
from .graphs import GraphedDecode

log = logging.getLogger("helpers.server")

#: The most memory the default pool takes (vLLM's CPU build asks for its KV space in GiB too).
POOL_BYTES = 2**30


class ContiguousKV:
    """Lesson 03's KV cache: one padded tensor per layer for the running batch (``Batch``).
    Every request fits: the cache grows with the batch, so room is only the batch's slots."""

    name = "contiguous"

    def __init__(self, model, tokenizer, pad_id: int):
        self.model, self.tokenizer, self.pad_id = model, tokenizer, pad_id
        self.batch = Batch.empty()
        self._new: list = []

    def admits(self) -> bool:
        return True

    def admit(self, sequence) -> bool:
        self._new.append(sequence)
        return True

    def passes(self):
        """The new prompts in one prefill pass (lesson 03's ``init_batch``, from token ids),
        merged into the running batch; then one decode pass over every row."""
        new, self._new = self._new, []
        if new:
            prefill = batch_from_token_ids([s.prompt_ids for s in new],
                                           [max(1, s.max_new_tokens) for s in new],
                                           [s.id for s in new], self.pad_id)
            yield prefill
            self.batch = merge_batches(self.batch, filter_batch(prefill))
        if len(self.batch):
            yield self.batch
            self.batch = filter_batch(self.batch)

    def forward(self, batch: Batch, adapters, choose) -> None:
        """Lesson 03's ``generate_next_token``; ``adapters``: a ``MultiLora`` and each row's."""
        if adapters is not None:
            lora, names = adapters
            lora.set_rows(names)
        rows = list(range(len(batch)))
        generate_next_token(self.model, self.tokenizer, batch, stop_at_eos=False,
                            choose=lambda logits: choose(logits, rows))

    def drop(self, request_ids) -> None:
        self.batch = filter_batch(_done(self.batch, request_ids))

    def clear(self) -> None:
        self.batch, self._new = Batch.empty(), []

    def snapshot(self) -> dict:
        return {}

    def info(self) -> dict:
        return {"kv_cache": self.name}


def _done(batch, request_ids):
    for row, rid in enumerate(batch.request_ids):
        batch.done[row] = batch.done[row] or rid in request_ids
    return batch


class PagedKV:
    """Lesson 08's KV cache: a pool of blocks, prefix caching and chunked prefill. A request is
    admitted when the pool can hold its worst case (prompt plus every new token it may get),
    and not while the last newcomers are still reading their prompts."""

    name = "paged"

    def __init__(self, model, tokenizer, runner, *, cache: PagedKVCache,
                 max_prefill_tokens: int | None):
        check_prefill_budget(max_prefill_tokens)
        self.model, self.tokenizer, self.runner, self.cache = model, tokenizer, runner, cache
        self.max_prefill_tokens = max_prefill_tokens
        self.batch = PagedBatch.empty()
        self._new = PagedBatch.empty()
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens looked up / found cached

    def admits(self) -> bool:
        return self.batch.prefilled

    def admit(self, sequence) -> bool:
        try:
            row = paged_batch_from_token_ids(self.cache, [sequence.prompt_ids],
                                             [max(1, sequence.max_new_tokens)], [sequence.id],
                                             [sequence.adapter])
        except PoolExhausted:
            return False
        if self.cache.prefix_caching:        # vLLM's prefix_cache_queries and _hits, in tokens
            self.prefix_queries += len(sequence.prompt_ids)
            self.prefix_hits += row.computed[0]
        self._new = merge_paged_batches(self._new, row)
        return True

    def passes(self):
        """One pass over every row: the running rows' next tokens and the newcomers' prompt
        tokens (a chunk of them, at most ``max_prefill_tokens``) together, as vLLM does."""
        self.batch = merge_paged_batches(self.batch, self._new)
        self._new = PagedBatch.empty()
        if len(self.batch):
            yield self.batch
            self.batch = filter_paged_batch(self.cache, self.batch)

    def forward(self, batch: PagedBatch, adapters, choose) -> None:
        lora = adapters[0] if adapters is not None else None
        forward = self.runner.pick(batch, lora)
        # EOS is the engine's to handle (per row: ignore_eos, grammars), not the helper's.
        paged_next_token(self.model, self.tokenizer, self.cache, batch, False,
                         self.max_prefill_tokens, lora, choose=choose, forward=forward)

    def drop(self, request_ids) -> None:
        self.batch = filter_paged_batch(self.cache, _done(self.batch, request_ids))

    def clear(self) -> None:
        for rid in list(self.cache.manager.tables):     # every block back to the pool
            self.cache.manager.free_request(rid)
        self.batch, self._new = PagedBatch.empty(), PagedBatch.empty()

    def snapshot(self) -> dict:
        manager = self.cache.manager
        prefix = ({"prefix_cache_queries": self.prefix_queries,
                   "prefix_cache_hits": self.prefix_hits} if self.cache.prefix_caching else {})
        return {"kv_blocks_used": manager.used, "kv_blocks_total": manager.num_blocks,
                **prefix, **self.runner.snapshot()}

    def info(self) -> dict:
        return {"kv_cache": self.name, "kv_block_size": self.cache.block_size,
                "kv_blocks": self.cache.manager.num_blocks,
                "prefix_caching": self.cache.prefix_caching,
                "max_prefill_tokens": self.max_prefill_tokens, **self.runner.info()}


def make_kv(kind: str, model, tokenizer, pad_id: int, *, max_batch_size: int,
            max_total_tokens: int, lora=None, **layout):
    """The layout ``kind`` names. The paged one's options (``layout``): block_size (16),
    prefix_caching (True), max_prefill_tokens (512), num_blocks (as many as ``POOL_BYTES``
    holds), and the ``Runner``'s (judged already by ``options.check``)."""
    if kind == "contiguous":
        if layout:
            raise ValueError(f"{', '.join(layout)}: options of the paged KV layout, not of "
                             f"kv_cache='contiguous'")
        return ContiguousKV(model, tokenizer, pad_id)
    block_size = layout.pop("block_size", 16)
    max_prefill_tokens = layout.pop("max_prefill_tokens", 512)
    num_blocks = layout.pop("num_blocks", None)
    one_request = math.ceil(max_total_tokens / block_size)
    if num_blocks is None:    # room for max_batch_size requests, within POOL_BYTES (or one)
        layers, kv_heads, head_dim = kv_shape(model.config)
        block_bytes = 2 * layers * kv_heads * head_dim * block_size * model.dtype.itemsize
        num_blocks = max(one_request, min(max_batch_size * one_request, POOL_BYTES // block_bytes))
    if num_blocks < one_request:         # such a request would wait for blocks forever
        raise ValueError(
            f"num_blocks={num_blocks} blocks of {block_size} tokens cannot hold one request "
            f"of max_total_tokens={max_total_tokens}: give at least {one_request} "
            f"blocks, or a smaller max_total_tokens")
    # One spare block, which no request owns: the runner's padding reads and writes it.
    cache = PagedKVCache(model, num_blocks, block_size, layout.pop("prefix_caching", True),
                         spare_blocks=1)
    runner = Runner(model, cache, num_blocks, pad_id, lora, max_total_tokens=max_total_tokens,
                    **layout)
    return PagedKV(model, tokenizer, runner, cache=cache, max_prefill_tokens=max_prefill_tokens)


# --- how the paged layout runs a pass (lesson 10) ------------------------------------------

#: The three kinds of step compiled at start-up: (what, starts, counts), with sizes T, R, Q, L
#: all different, or torch would guard on two of them being equal.
WARM_UP = (("the decode step of one row", [2], [1]),
           ("every decode step of two rows or more", [4, 0, 0], [1, 1, 1]),
           ("every step that reads prompts", [2, 0], [3, 1]))


class PackedStep:
    """The paged model pass (lesson 08's ``forward``) with every row's new tokens packed into
    one sequence, compiled (``warm_up()``) or eager. (Lessons 08, 10.) ``scratch_block``: a
    block the manager never hands out, which padding entries read and write."""

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
        self._forward = (torch.compile(self._run_model, backend=self._counting_backend)
                         if compile else self._run_model)

    def _counting_backend(self, graph_module, example_inputs):
        """Inductor, each graph it compiles counted and timed."""
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        start = time.perf_counter()
        compiled = compile_fx(graph_module, example_inputs)
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def warm_up(self) -> None:
        """Compile the three kinds of step (``WARM_UP``) on the scratch block alone."""
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

    def __call__(self, batch: PagedBatch, rows: list[int], starts: list[int],
                 counts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Row ``rows[i]`` feeds ``counts[i]`` tokens from position ``starts[i]`` on, its blocks
        being ``tables[i]``; each row's last-token logits, (R, 1, vocab)."""
        ids = [token for row, start, new in zip(rows, starts, counts)
               for token in batch.sequence(row)[start:start + new]]
        starts, counts, tables = list(starts), list(counts), list(tables)
        if len(rows) == 1 and counts[0] > 1:
            # One row reading a prompt gets a second, one scratch token (its output dropped):
            # torch compiles a size of 1 apart, and a token is cheaper than a graph.
            starts.append(0)
            counts.append(1)
            tables.append([self.scratch // self.pool.block_size])
            ids.append(self.pad_id)
        return self._run(starts, counts, tables, ids)[:len(rows)]

    def _run(self, starts: list[int], counts: list[int], tables: list[list[int]],
             ids: list[int]) -> torch.Tensor:
        device = self.model.device
        paged = PackedInputs.build(self.pool, self.scratch, tables, starts, counts, device)
        return self._call(torch.tensor([ids], device=device), paged)[0][:, None]

    def _call(self, ids, paged: PackedInputs):
        """The model on one step's (contiguous) tensors, the sizes that vary (T, R, Q, L) marked
        dynamic for the compiler unless 1 (torch would specialize that anyway)."""
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
        stance = "fail_on_recompile" if self.sealed and self.compiled else "default"
        try:
            with torch.compiler.set_stance(stance):
                return self._forward(ids, paged)
        except RuntimeError as err:
            if "fail_on_recompile" not in str(err):
                raise
            if not self.eager_instead:
                log.warning("a step needed a graph that start-up did not compile; it ran eager "
                            "instead (so do any such steps from now on): %s",
                            str(err).splitlines()[0])
            self.eager_instead += 1
            return self._run_model(ids, paged)
        finally:
            config._attn_implementation = previous

    def _run_model(self, ids, paged: PackedInputs):
        return self.model(input_ids=ids, position_ids=paged.positions, use_cache=False,
                          logits_to_keep=paged.last, paged=paged).logits


class Runner:
    """The paged step's model pass, eager, compiled or replayed. (Lessons 08 and 10.)
    ``capture``: how a step is recorded (default: lesson 10's ``record``)."""

    def __init__(self, model, cache, scratch_block: int, pad_id: int, lora=None, *,
                 graph_sizes, compile="off", cuda_graphs="off", capture=None,
                 max_total_tokens: int):
        graphs_wanted = cuda_graphs == "on" or (cuda_graphs == "auto"
                                                and model.device.type == "cuda")
        self.packed = PackedStep(model, cache.pool, scratch_block, pad_id, compile != "off")
        if (compile != "off" or graphs_wanted) and lora is not None:
            # Every layer an adapter could touch is wrapped now, so that loading one later never
            # changes the model the graphs were traced or captured from.
            lora.wrap_all()
        if compile != "off":
            try:
                self.packed.warm_up()
            except Exception as err:
                if compile == "on":
                    first = (str(err).strip().splitlines() or [""])[0]
                    raise RuntimeError(f"compiling the step failed ({type(err).__name__}: "
                                       f"{first}); --compile auto would serve it eager") from err
                log.warning("compiling failed (%s: %s): running the model's step eager from "
                            "now on", type(err).__name__, err)
                self.packed.compiled, self.packed._forward = False, self.packed._run_model
        self.graphs = None
        if graphs_wanted:
            self.graphs = GraphedDecode(self.packed, max_total_tokens, graph_sizes, capture)
            try:
                self.graphs.capture_all()
            except Exception as err:
                if cuda_graphs == "on":
                    raise
                log.warning("capturing CUDA graphs failed (%s: %s): decode steps run without "
                            "them", type(err).__name__, err)
                self.graphs = None
        # Start-up is over: a step that would need a new graph runs eager (and is counted),
        # rather than freeze every stream for the seconds a compile takes.
        self.packed.sealed = True
        self.steps_compiled = 0

    def pick(self, batch, lora):
        """A graph's replay, the packed step, or None (lesson 08's own pass) where a row uses
        an adapter."""
        replays = self.graphs is not None and self.graphs.replays_for(batch)
        if any(batch.adapters):
            return None
        if lora is not None:                 # no row uses an adapter: none may be left set
            lora.set_rows(None)
        if replays:
            return self.graphs
        self.steps_compiled += self.packed.compiled
        return self.packed

    def snapshot(self) -> dict:
        graphs = self.graphs.snapshot() if self.graphs is not None else {}
        return {"compiles": self.packed.compiles, "compile_seconds": self.packed.compile_seconds,
                "steps_eager_instead": self.packed.eager_instead,
                "steps_compiled": self.steps_compiled, **graphs}

    def info(self) -> dict:
        return {"compiled": self.packed.compiled,
                "cuda_graph_sizes": list(self.graphs.sizes) if self.graphs is not None else []}
