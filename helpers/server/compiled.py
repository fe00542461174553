"""The paged engine's decode step, compiled with ``torch.compile``. (Lessons 08 and 10.)

A decode step feeds every running row one token. On a small model most of its time is
Python and per-op dispatch, not arithmetic (lesson 10): ``torch.compile`` traces the model
once for such a step, and inductor turns the trace into a few fused kernels. What keeps it to
one trace, not one per step:

* **the cache keeps its shape.** Lesson 08's pool of KV blocks is allocated once; a step
  writes each row's new keys and values into it in place (``index_copy_``) and reads each
  row's history back through its pool indices. (Lesson 03's contiguous cache grows by one
  column a step: a new shape every step.)
* **the two sizes that do change are dynamic.** A step's tensors are (rows, 1) and
  (rows, length), where length is the longest row's history. Both dimensions are marked
  dynamic, so one graph serves every batch of two rows or more and every length; a batch of
  one row gets a graph of its own (torch specializes dimensions of size 1). Both graphs are
  compiled at start-up (``warm_up``), on a scratch block that no request owns.
* **the rest stays eager.** Steps that read prompts (their shapes vary with every prompt) and
  batches in which a row uses a LoRA adapter run lesson 08's ``paged_next_token`` unchanged.

On a GPU the same step could be captured as a CUDA graph (``mode="reduce-overhead"``), which
needs fixed shapes: vLLM pads the rows up to a few *capture sizes* and captures one graph for
each. On a CPU there is no graph to replay, and rows are not padded here.

Every compile is counted (``compiles`` and ``compile_seconds`` in ``/metrics``): after the
warm-up the count should not move. If it does ``MAX_COMPILES`` times (an adapter loaded into
the model, a model torch cannot trace without breaks), the engine logs it and runs eager from
then on, rather than stall the batch for each new trace.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..batching import take_token
from ..paged import KVPool, PagedBatch
from ..paged.batching import _book

log = logging.getLogger("helpers.server")

#: The name the compiled step's attention function is registered under with transformers.
COMPILED_ATTENTION = "course_paged_compiled"
#: Compiles after which the engine stops using the compiled step (the warm-up makes two).
MAX_COMPILES = 6


@dataclass
class DecodeInputs:
    """What ``fixed_paged_attention`` needs for one decode step: one new token per row.

    write_indices: (rows,) the pool index each row's new token is written to
    read_indices:  (rows, length) each row's pool indices from position 0 to its new token,
                   then the scratch entry as filler up to the longest row (masked out)
    mask:          (rows, 1, 1, length) True where the row's new token may look
    """

    pool: KVPool
    write_indices: torch.Tensor
    read_indices: torch.Tensor
    mask: torch.Tensor


def fixed_paged_attention(module, query, key, value, attention_mask, scaling=None,
                          dropout=0.0, paged: DecodeInputs | None = None, **kwargs):
    """Lesson 08's ``paged_attention`` for a decode step, written so that a compiler can
    trace it: no row is skipped (``index_copy_`` writes every row's token, with no boolean
    selection whose size depends on the data). query, key, value: (rows, heads, 1, head_dim).
    """
    keys, values = paged.pool.keys[module.layer_idx], paged.pool.values[module.layer_idx]
    at = paged.write_indices
    keys.index_copy_(0, at, key.transpose(1, 2).reshape(-1, *keys.shape[1:]).to(keys.dtype))
    values.index_copy_(0, at, value.transpose(1, 2).reshape(-1, *values.shape[1:])
                       .to(values.dtype))
    # Each row's history, (rows, kv_heads, length, head_dim): lesson 08's gather.
    row_keys, row_values = paged.pool.gather(module.layer_idx, paged.read_indices)
    row_keys, row_values = row_keys.to(query.dtype), row_values.to(query.dtype)
    output = F.scaled_dot_product_attention(query, row_keys, row_values, attn_mask=paged.mask,
                                            scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


class DecodeStep:
    """The decode step of ``PagedEngine``: every row feeds one token, with its tensors built
    in a few vectorized operations; compiled once and reused, or eager. (Lesson 10.)

    ``DecodeStep(model, pool, scratch_block, pad_id, compile)``: ``scratch_block`` is a block
    of ``pool`` the block manager never hands out; padding entries read and write there.
    ``warm_up()`` compiles; ``usable(batch)`` says whether a batch can take this step;
    ``step(batch, cache, choose)`` runs it for every row of ``batch``.
    """

    def __init__(self, model, pool: KVPool, scratch_block: int, pad_id: int,
                 compile: bool = True):
        from transformers import AttentionInterface

        AttentionInterface.register(COMPILED_ATTENTION, fixed_paged_attention)
        self.model, self.pool, self.pad_id = model, pool, pad_id
        self.scratch = scratch_block * pool.block_size    # the scratch entry's pool index
        self.compiles = 0
        self.compile_seconds = 0.0
        self.compiled = compile
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
        """Compile the step for one row and for several (``compiles`` then counts them), on
        the scratch entry only: no request's keys or values are touched."""
        start = time.perf_counter()
        with torch.inference_mode():
            for rows in (2, 1):
                device = self.model.device
                ids = torch.full((rows, 1), self.pad_id, device=device)
                read = torch.full((rows, 2), self.scratch, device=device)
                self._call(ids, torch.ones(rows, 1, dtype=torch.long, device=device),
                           torch.full((rows,), self.scratch, device=device), read,
                           torch.ones(rows, 1, 1, 2, dtype=torch.bool, device=device))
        log.warning("compiled the decode step in %.1f s (%d graphs; --compile off skips it)",
                    time.perf_counter() - start, self.compiles)

    def run_eager(self, why: str) -> None:
        """From now on, run the model eager (and say why in the log)."""
        self.compiled, self._forward = False, self._run_model
        log.warning("%s: running the decode step eager from now on", why)

    def usable(self, batch: PagedBatch) -> bool:
        """This step takes a batch of rows that generate (no prompt left to read) with no
        LoRA adapter. Once compiling has gone out of bounds, it runs eager."""
        if self.compiled and self.compiles > MAX_COMPILES:
            self.run_eager(f"the decode step was compiled {self.compiles} times")
        return (len(batch) > 0 and not any(batch.adapters)
                and not any(batch.prefilling(row) for row in range(len(batch))))

    # --- one step ---------------------------------------------------------------------------

    def step(self, batch: PagedBatch, cache, choose) -> None:
        """``paged_next_token`` for a batch in which every row feeds its one pending token:
        grow each row's blocks, run the model (compiled, or eager), book the tokens, and let
        ``choose``
(as in ``paged_next_token``) pick each row's next token."""
        device = self.model.device
        rows = range(len(batch))
        starts = batch.computed
        tables = [cache.manager.grow(batch.request_ids[row], starts[row] + 1) for row in rows]
        size = self.pool.block_size
        lengths = torch.tensor([start + 1 for start in starts])
        width = max(len(table) for table in tables)
        table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables])
        length = int(lengths.max())
        positions = torch.arange(length)
        read = table[:, positions // size] * size + positions % size
        valid = positions[None, :] < lengths[:, None]
        read = torch.where(valid, read, self.scratch)
        write = read.gather(1, (lengths - 1)[:, None]).squeeze(1)
        ids = torch.tensor([[batch.sequence(row)[starts[row]]] for row in rows])
        logits = self._call(ids.to(device), (lengths - 1)[:, None].to(device),
                            write.to(device), read.to(device), valid[:, None, None].to(device))
        for row in rows:
            _book(cache, batch, row, 1)
        for row, token in zip(rows, choose(logits, list(rows))):
            take_token(batch, row, token, False, None)

    def _call(self, ids, positions, write, read, mask):
        """The model on one step's tensors (each contiguous: a compiled graph guards strides
        too), with the dimensions that vary marked dynamic for the compiler."""
        if ids.shape[0] > 1:                       # one graph for every batch of 2 rows or more
            for tensor in (ids, positions, write, read, mask):
                torch._dynamo.mark_dynamic(tensor, 0)
        for tensor, dim in ((read, 1), (mask, 3)):
            torch._dynamo.mark_dynamic(tensor, dim)
        config = self.model.config        # the attention function the model's layers call
        previous, config._attn_implementation = config._attn_implementation, COMPILED_ATTENTION
        try:
            return self._forward(ids, positions, DecodeInputs(self.pool, write, read, mask))
        finally:
            config._attn_implementation = previous

    def _run_model(self, ids, positions, paged: DecodeInputs):
        return self.model(input_ids=ids, position_ids=positions, use_cache=False,
                          logits_to_keep=1, paged=paged).logits
