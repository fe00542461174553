"""The KV layouts the engine is given: where the running rows' keys and values live, and which
forward passes one turn of the scheduler makes. (Lessons 03, 07 and 08.)

``Engine.step`` (engine.py) is the same for both; a layout answers its four questions:

* ``admits()``: may waiting requests join this turn?
* ``admit(sequence)``: is there room for this one? (It is then reserved.)
* ``passes()``: the forward passes of this turn, one batch each; after each pass the rows
  that finished leave, and their room goes back.
* ``forward(batch, adapters, choose)``: one pass: the model on the batch, then
  ``choose(logits, rows)`` picks the next token of each row in ``rows`` (the rows that have
  read all their tokens), as lessons 03 and 08 let their loops choose.

``ContiguousKV`` is lesson 03's padded batch (``--kv-cache contiguous``): the new prompts are
read in a prefill pass of their own, then merged into the running batch, and one decode pass
follows for every row. ``PagedKV`` is lesson 08's pool of blocks (the default): new rows join
the running batch at once, and one pass feeds every row what it has pending, a decode row its
last token and a new row its prompt (or a chunk of it: chunked prefill), through the runner
(``runner.py``: lesson 08's step, compiled by lesson 10 and replayed as CUDA graphs on a GPU).
"""

from __future__ import annotations

import math

from ..batching import (Batch, batch_from_token_ids, filter_batch, generate_next_token,
                        merge_batches)
from ..compilation import CAPTURE_SIZES
from ..paged import (PagedBatch, PagedKVCache, PoolExhausted, filter_paged_batch, kv_shape,
                     merge_paged_batches, paged_next_token)
from ..paged.batching import check_prefill_budget, paged_batch_from_token_ids

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
        """Lesson 03's ``generate_next_token``, each row with its adapter (``adapters``: a
        ``MultiLora`` and one name or None per row, or None)."""
        if adapters is not None:
            lora, names = adapters
            lora.set_rows(names)
        rows = list(range(len(batch)))
        # EOS is the engine's to handle (per row: ignore_eos, grammars), not the helper's.
        generate_next_token(self.model, self.tokenizer, batch, stop_at_eos=False,
                            choose=lambda logits: choose(logits, rows))

    def drop(self, request_ids) -> None:
        """These rows leave the running batch (their clients went away)."""
        for row, rid in enumerate(self.batch.request_ids):
            if rid in request_ids:
                self.batch.done[row] = True
        self.batch = filter_batch(self.batch)

    def clear(self) -> None:
        self.batch, self._new = Batch.empty(), []

    def snapshot(self) -> dict:
        return {}

    def info(self) -> dict:
        return {"kv_cache": self.name}


def default_pool_blocks(model, block_size: int, max_batch_size: int,
                        max_total_tokens: int) -> int:
    """Blocks for ``max_batch_size`` requests of ``max_total_tokens`` tokens, cut to what
    ``POOL_BYTES`` holds, but never below one request's worth."""
    layers, kv_heads, head_dim = kv_shape(model.config)
    block_bytes = 2 * layers * kv_heads * head_dim * block_size * model.dtype.itemsize
    per_request = math.ceil(max_total_tokens / block_size)
    return max(per_request, min(max_batch_size * per_request, POOL_BYTES // block_bytes))


class PagedKV:
    """Lesson 08's KV cache: a pool of blocks, a block table per row (``PagedBatch``), prefix
    caching and chunked prefill.

    A request is admitted when the pool can hold its worst case (prompt plus every new token
    it may get); a request the pool cannot hold yet waits at the head of the queue. While the
    last newcomers are still reading their prompts (in chunks of ``max_prefill_tokens``), no
    one else joins. ``runner``: how the model runs a pass (``runner.Runner``)."""

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
        """Lesson 08's ``paged_next_token``, its model pass run by the runner (lesson 10's
        compiled step or a CUDA graph) where no row uses an adapter; lesson 08's own pass,
        each row with its adapter, where one does."""
        lora = adapters[0] if adapters is not None else None
        forward = self.runner.pick(batch, lora)
        # EOS is the engine's to handle (per row: ignore_eos, grammars), not the helper's.
        paged_next_token(self.model, self.tokenizer, self.cache, batch, False,
                         self.max_prefill_tokens, lora, choose=choose, forward=forward)

    def drop(self, request_ids) -> None:
        for row, rid in enumerate(self.batch.request_ids):
            if rid in request_ids:
                self.batch.done[row] = True
        self.batch = filter_paged_batch(self.cache, self.batch)

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
            max_total_tokens: int, lora=None, block_size: int = 16, prefix_caching: bool = True,
            max_prefill_tokens: int | None = 512, num_blocks: int | None = None,
            compile="off", cuda_graphs="off", graph_sizes=CAPTURE_SIZES, capture=None):
    """The layout ``kind`` names ("paged" or "contiguous"), with its runner (compiled and
    captured here, at start-up: see ``runner.Runner``)."""
    if kind == "contiguous":
        return ContiguousKV(model, tokenizer, pad_id)
    from .runner import Runner

    if num_blocks is None:
        num_blocks = default_pool_blocks(model, block_size, max_batch_size, max_total_tokens)
    one_request = math.ceil(max_total_tokens / block_size)
    if num_blocks < one_request:         # such a request would wait for blocks forever
        raise ValueError(
            f"num_blocks={num_blocks} blocks of {block_size} tokens cannot hold one request "
            f"of max_total_tokens={max_total_tokens}: give at least {one_request} "
            f"blocks, or a smaller max_total_tokens")
    check_prefill_budget(max_prefill_tokens)
    # One spare block, which no request owns: the runner's padding reads and writes it.
    cache = PagedKVCache(model, num_blocks, block_size, prefix_caching, spare_blocks=1)
    runner = Runner(model, cache, num_blocks, pad_id, lora, compile=compile,
                    cuda_graphs=cuda_graphs, graph_sizes=graph_sizes, capture=capture,
                    max_batch_size=max_batch_size, max_total_tokens=max_total_tokens)
    return PagedKV(model, tokenizer, runner, cache=cache, max_prefill_tokens=max_prefill_tokens)
