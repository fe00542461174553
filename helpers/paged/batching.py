"""Continuous batching on the paged KV cache, with prefix caching and chunked prefill.
(Lesson 08.)

The shape is lesson 03's: ``init_paged_batch``, ``paged_next_token``, ``merge_paged_batches``,
``filter_paged_batch`` and a driver, ``generate_paged``, that returns exactly what
``generate_sequential`` returns. What changes is where the keys and values live. Lesson 03
kept them in one padded tensor per layer, so merging meant padding the shorter history on the
left and filtering meant cutting columns out of every layer. Here they live in the blocks of a
shared pool (``PagedKVCache``) and each row only holds its block table: merging two batches is
joining two lists of rows, filtering is dropping rows and handing their blocks back. Nothing
is ever padded in the cache.

One function does prefill, chunked prefill and decode. A row's *pending* tokens are those of
its prompt and answer whose keys and values are not in the pool yet: the whole prompt after
its cached prefix at first, then the one token generated last. ``paged_next_token`` feeds each
row its pending tokens (at most ``max_prefill_tokens`` prompt tokens in all per call); a row
that has caught up gets its next token.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field, fields

import torch

from ..batching import (Request, Step, Trace, _check_batch_size, _check_requests, _finish,
                        _pad_id, _progress, _start_trace, _synchronize, left_pad, take_token)
from .attention import KVPool, PagedForward, model_uses_paged_attention
from .blocks import BlockManager, PoolExhausted


class PagedKVCache:
    """A pool of KV blocks and its block manager, shared by every batch of a run. (Lesson 08.)

    num_blocks, block_size: the pool (block_size token positions per block, every layer)
    prefix_caching:         new requests reuse cached blocks of their prompt's prefix
    spare_blocks:           blocks of the pool beyond ``num_blocks`` that the block manager
                            never hands out (the compiled step of the server writes padding
                            there: ``helpers.server.kv``)

    Counters (since creation): ``prefill_tokens`` prompt tokens the model computed,
    ``cached_tokens`` prompt tokens found in the cache instead; ``manager.hit_blocks`` and
    ``manager.looked_up_blocks`` count blocks.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16, prefix_caching: bool = True,
                 spare_blocks: int = 0):
        self.manager = BlockManager(num_blocks, block_size)
        self.pool = KVPool(model, num_blocks + spare_blocks, block_size)
        self.prefix_caching = prefix_caching
        self.prefill_tokens = 0
        self.cached_tokens = 0

    @property
    def block_size(self) -> int:
        """Token positions per block."""
        return self.manager.block_size


@dataclass
class PagedBatch:
    """Requests generated together on a paged cache, one row each. (Lesson 08.)

    Every field is a list with one entry per row. As in lesson 03's ``Batch``: ``request_ids``,
    ``max_tokens``, ``token_ids`` (the answer so far) and ``done``. New here: ``prompt_ids``
    (the prompt's tokens), ``computed`` (how many tokens of prompt-then-answer have their keys
    and values in the pool; at first the cached prefix), ``block_tables`` (the blocks holding
    them: the very list the block manager grows) and ``adapters`` (a LoRA adapter name or
    None). No tensor lives here: each forward pass is built from these lists.
    """

    request_ids: list[int]
    max_tokens: list[int]
    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    done: list[bool]
    computed: list[int]
    block_tables: list[list[int]]
    adapters: list[str | None]

    def __len__(self) -> int:
        return len(self.request_ids)

    def sequence(self, row: int) -> list[int]:
        """The row's prompt followed by its answer so far."""
        return self.prompt_ids[row] + self.token_ids[row]

    def prefilling(self, row: int) -> bool:
        """True while part of the row's prompt has not been read by the model."""
        return self.computed[row] < len(self.prompt_ids[row])

    @property
    def prefilled(self) -> bool:
        """True once every row has read its whole prompt."""
        return not any(self.prefilling(row) for row in range(len(self)))

    @classmethod
    def empty(cls) -> "PagedBatch":
        return cls([], [], [], [], [], [], [], [])


def init_paged_batch(tokenizer, cache: PagedKVCache, requests: list[Request],
                     request_ids: list[int] | None = None,
                     adapters: list[str | None] | None = None) -> PagedBatch:
    """Tokenize the prompts and give each request its blocks: the cached blocks of its
    prompt's prefix (with prefix caching) and a reservation for the rest. (Lesson 08.)

    Raises ``PoolExhausted`` when the pool cannot take every request; then no block is taken.
    Nothing runs through the model yet, and nothing is padded.
    """
    _check_requests(requests)
    request_ids = list(range(len(requests))) if request_ids is None else list(request_ids)
    adapters = [None] * len(requests) if adapters is None else list(adapters)
    if not len(request_ids) == len(adapters) == len(requests):
        raise ValueError(f"got {len(requests)} requests, {len(request_ids)} request_ids and "
                         f"{len(adapters)} adapters: give one of each per request")
    prompts = [prompt for prompt, _ in requests]
    token_lists = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    return paged_batch_from_token_ids(cache, token_lists, [m for _, m in requests], request_ids,
                                      adapters)


def paged_batch_from_token_ids(cache: PagedKVCache, token_lists: list[list[int]],
                               max_tokens: list[int], request_ids: list[int],
                               adapters: list[str | None]) -> PagedBatch:
    """``init_paged_batch`` for prompts already tokenized (the lesson-07 server's way in).
    Raises ``PoolExhausted`` when the pool cannot take every request; then no block is taken."""
    computed, taken = [], []
    try:
        for rid, ids, max_tokens_, adapter in zip(request_ids, token_lists, max_tokens, adapters):
            # ValueError for an empty prompt or a request id in use; PoolExhausted if full.
            computed.append(cache.manager.allocate(rid, ids, max_tokens_, adapter,
                                                   prefix_caching=cache.prefix_caching))
            taken.append(rid)
    except (PoolExhausted, ValueError):
        for rid in taken:                 # all or nothing
            cache.manager.free_request(rid)
        raise
    cache.cached_tokens += sum(computed)
    return PagedBatch(
        request_ids=list(request_ids), max_tokens=list(max_tokens),
        prompt_ids=[list(ids) for ids in token_lists], token_ids=[[] for _ in token_lists],
        done=[False] * len(token_lists), computed=computed,
        block_tables=[cache.manager.tables[rid] for rid in request_ids], adapters=adapters)


@torch.no_grad()
def paged_next_token(model, tokenizer, cache: PagedKVCache, batch: PagedBatch,
                     stop_at_eos: bool = True, max_prefill_tokens: int | None = None,
                     lora=None, *, choose=None, forward=None) -> PagedBatch:
    """Feed every running row its pending tokens, once through the model; a row that has read
    all of them gets its next greedy token. (Lesson 08.)

    ``max_prefill_tokens`` caps the prompt tokens read in this call (None: no cap), rows first
    come first served: a longer prompt is read in chunks over several calls (chunked prefill),
    and a row that gets no tokens this time sits the call out. ``lora`` (a ``MultiLora``)
    applies each row's adapter. Same stopping rule as ``helpers.generate_next_token``. Updates
    ``batch`` in place and returns it. ``choose(logits, rows)`` replaces the greedy choice
    (as in ``generate_next_token``): the last-position logits (len(rows), 1, vocab) of the
    batch ``rows`` that caught up, one token id per row back. ``forward(batch, rows, starts,
    new_counts, tables)`` replaces the model pass below (the server's runner: the same pass
    packed without padding, compiled, or replayed as a CUDA graph, lesson 10); it returns
    the logits of each row's last new token, (len(rows), 1, vocab).
    """
    if len(batch) == 0:
        raise ValueError("the batch is empty: there is nothing to generate")
    check_prefill_budget(max_prefill_tokens)
    # 1. Which rows feed how many tokens: their pending tokens, prompt tokens within the budget.
    rows, new_counts = _tokens_to_feed(batch, max_prefill_tokens)
    # 2. Room in the pool for the new tokens, and the pool indices they are written to.
    starts = [batch.computed[row] for row in rows]
    tables = [cache.manager.grow(batch.request_ids[row], start + new)
              for row, start, new in zip(rows, starts, new_counts)]
    # 3. One forward pass over the new tokens of those rows.
    if forward is None:
        paged = PagedForward.build(cache.pool, tables, starts, new_counts, model.device)
        logits = _forward(model, tokenizer, batch, rows, starts, new_counts, paged, lora)
    else:
        logits = forward(batch, rows, starts, new_counts, tables)
    # 4. Book the written tokens; rows that caught up take their token (lesson 03's rule).
    for row, new in zip(rows, new_counts):
        _book(cache, batch, row, new)
    ready = [i for i, row in enumerate(rows)     # not in the middle of a longer prompt
             if batch.computed[row] == len(batch.sequence(row))]
    if not ready:
        return batch
    if choose is None:
        next_tokens = logits[ready, -1, :].argmax(dim=-1).tolist()      # greedy
    else:
        next_tokens = choose(logits[ready], [rows[i] for i in ready])
    for i, token in zip(ready, next_tokens):
        take_token(batch, rows[i], token, stop_at_eos, tokenizer.eos_token_id)
    return batch


def _tokens_to_feed(batch: PagedBatch, max_prefill_tokens: int | None):
    """The rows that feed tokens in this pass, and how many each feeds: all of its pending
    tokens, except that the prompt tokens of all rows together stay within
    ``max_prefill_tokens``, handed out first row first."""
    budget = max_prefill_tokens if max_prefill_tokens is not None else float("inf")
    rows, new_counts = [], []
    for row in range(len(batch)):
        if batch.done[row]:
            continue
        pending = len(batch.sequence(row)) - batch.computed[row]
        if batch.prefilling(row):
            pending = int(min(pending, budget))
            budget -= pending
        if pending > 0:
            rows.append(row)
            new_counts.append(pending)
    if not rows:
        raise ValueError("no row has anything to feed (every row is done)")
    return rows, new_counts


def _forward(model, tokenizer, batch: PagedBatch, rows: list[int], starts: list[int],
             new_counts: list[int], paged: PagedForward, lora) -> list[int]:
    """Run the model on the new tokens of ``rows`` (each row with its adapter); returns the
    logits of each row's last position, (len(rows), 1, vocab).

    The new tokens are padded on the left (the input only, lesson 02's ``left_pad``), and their
    positions count on from each row's history. Padding gets position 0: its keys and values
    are never written to the pool, and no real token looks at it.
    """
    device = model.device
    token_lists = [batch.sequence(row)[start:start + new]
                   for row, start, new in zip(rows, starts, new_counts)]
    input_ids, _ = left_pad(token_lists, _pad_id(tokenizer))
    position_ids, _ = left_pad([list(range(start, start + new))
                                for start, new in zip(starts, new_counts)], 0)
    with _adapters(lora, [batch.adapters[row] for row in rows]), model_uses_paged_attention(model):
        output = model(input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                       use_cache=False, logits_to_keep=1, paged=paged)
    return output.logits


def _book(cache: PagedKVCache, batch: PagedBatch, row: int, new: int) -> None:
    """The keys and values of the row's next ``new`` tokens are now in the pool: count them,
    and let the block manager hash the blocks they filled (for prefix caching)."""
    if batch.prefilling(row):
        cache.prefill_tokens += new
    batch.computed[row] += new
    cache.manager.commit(batch.request_ids[row], batch.sequence(row)[:batch.computed[row]])


def merge_paged_batches(batch1: PagedBatch, batch2: PagedBatch) -> PagedBatch:
    """The rows of ``batch1`` then those of ``batch2``. (Lesson 08.)

    Lesson 03 padded the shorter history; here every row keeps its own block table, so this
    is joining lists, and any two batches can be merged, even halfway through a prefill.
    """
    # Every field holds one entry per row: join them field by field.
    return PagedBatch(**{f.name: getattr(batch1, f.name) + getattr(batch2, f.name)
                         for f in fields(PagedBatch)})


def filter_paged_batch(cache: PagedKVCache, batch: PagedBatch) -> PagedBatch:
    """The batch without its finished rows, whose blocks go back to the pool. (Lesson 08.)

    Collect the finished answers first. Blocks with a hash stay in the prefix cache. Nothing
    is cut out of any tensor: the other rows' blocks do not move.
    """
    for rid, done in zip(batch.request_ids, batch.done):
        if done:
            cache.manager.free_request(rid)
    keep = [row for row, done in enumerate(batch.done) if not done]
    return PagedBatch(**{f.name: [getattr(batch, f.name)[row] for row in keep]
                         for f in fields(PagedBatch)})


def default_num_blocks(tokenizer, requests: list[Request], batch_size: int,
                       block_size: int) -> int:
    """Blocks for ``batch_size`` requests of the queue's longest kind (prompt plus answer)."""
    token_lists = tokenizer([prompt for prompt, _ in requests])["input_ids"]
    longest = max(len(ids) + max_tokens for ids, (_, max_tokens) in zip(token_lists, requests))
    return batch_size * math.ceil(longest / block_size)


def generate_paged(model, tokenizer, requests: list[Request], batch_size: int = 8,
                   progress: bool = True, *, stop_at_eos: bool = True,
                   trace: Trace | None = None, cache: PagedKVCache | None = None,
                   num_blocks: int | None = None, block_size: int = 16,
                   prefix_caching: bool = True, max_prefill_tokens: int | None = None,
                   adapters: list[str | None] | None = None, lora=None) -> list[str]:
    """Continuous batching on a paged KV cache. (Lesson 08.)

    Same arguments, result and stopping rule as ``helpers.generate_continuous``, plus:

    cache:              a ``PagedKVCache`` to use (and keep: its prefix cache and counters
                        survive the call); default a new one of ``num_blocks`` blocks of
                        ``block_size`` tokens (default: room for ``batch_size`` of the
                        queue's longest requests) with ``prefix_caching``
    max_prefill_tokens: chunked prefill: at most this many prompt tokens per forward pass;
                        a decode step of the running rows follows every chunk
    adapters, lora:     one adapter name (or None) per request, and the ``MultiLora`` that
                        holds them (``helpers.load_adapters``)

    Scheduling: a request is admitted when a slot of the batch is free and the pool can hold
    its worst case (``BlockManager.allocate``); otherwise it waits at the head of the queue
    until running requests finish. A request that could not fit even in an empty pool raises
    ``PoolExhausted``.
    """
    _check_requests(requests, tokenizer, model)
    _check_batch_size(batch_size)
    check_prefill_budget(max_prefill_tokens)
    adapters = _check_adapters(adapters, lora, len(requests))
    cache = _cache_for(model, tokenizer, requests, batch_size, cache, num_blocks, block_size,
                       prefix_caching)
    trace = _start_trace(trace, "paged", batch_size, len(requests))
    run = _PagedRun(model, tokenizer, cache, trace, batch_size, stop_at_eos, lora)
    _synchronize(model.device)
    start = time.perf_counter()
    queue = deque(range(len(requests)))
    batch, new = PagedBatch.empty(), PagedBatch.empty()   # running rows, rows still prefilling
    with _progress(progress, len(requests), "paged continuous batching") as bar:
        while queue or len(batch) or len(new):
            # 1. Admit from the queue while slots are free and the pool has room (else wait).
            #    (While new rows are still being prefilled in chunks, nobody else joins.)
            if len(new) == 0:
                new = run.admit(queue, requests, adapters, running=len(batch))
            # 2. Read the new prompts (one chunk of them with chunked prefill).
            if len(new):
                run.step(new, "prefill", max_prefill_tokens)
                if new.prefilled:
                    batch = merge_paged_batches(batch, run.collect(new, bar))
                    new = PagedBatch.empty()
            # 3. One decode step for the running rows; the finished ones leave.
            if len(batch):
                run.step(batch, "decode", None)
                batch = run.collect(batch, bar)
    return _finish(trace, start, tokenizer, model.device)


def _cache_for(model, tokenizer, requests, batch_size, cache, num_blocks, block_size,
               prefix_caching) -> PagedKVCache:
    """The cache ``generate_paged`` was given, or a new one sized for the queue."""
    if cache is not None:
        if num_blocks is not None:
            raise ValueError("give either cache or num_blocks, not both (the cache has its "
                             "blocks)")
        return cache
    if num_blocks is None:
        num_blocks = default_num_blocks(tokenizer, requests, batch_size, block_size)
    return PagedKVCache(model, num_blocks, block_size, prefix_caching)


@dataclass
class _PagedRun:
    """What ``generate_paged`` keeps between steps: who sits in which slot of the batch (for
    the trace, as in lesson 03: rows move when others leave, slots do not), and the trace."""

    model: object
    tokenizer: object
    cache: PagedKVCache
    trace: Trace
    batch_size: int
    stop_at_eos: bool
    lora: object
    slot_of: dict[int, int] = field(default_factory=dict)   # request id -> slot of the batch

    def admit(self, queue: deque, requests: list[Request], adapters: list,
              running: int) -> PagedBatch:
        """New rows from the head of the queue while ``running`` plus the new ones leave a
        slot free, each with the blocks the pool promises it (nothing read yet). A request
        the pool cannot take yet stays at the head of the queue."""
        new = PagedBatch.empty()
        while queue and running + len(new) < self.batch_size:
            rid = queue[0]
            try:
                row = init_paged_batch(self.tokenizer, self.cache, [requests[rid]], [rid],
                                       [adapters[rid]])
            except PoolExhausted:
                if running + len(new) == 0:
                    raise      # nothing running will ever free a block for it
                break          # wait: running requests will free blocks
            queue.popleft()
            self.slot_of[rid] = min(set(range(self.batch_size)) - set(self.slot_of.values()))
            new = merge_paged_batches(new, row)
        return new

    def step(self, batch: PagedBatch, kind: str, max_prefill_tokens: int | None) -> None:
        """``paged_next_token`` with a stopwatch; appends a ``Step`` to the trace."""
        running = [rid for rid, done in zip(batch.request_ids, batch.done) if not done]
        tokens_before = sum(len(tokens) for tokens in batch.token_ids)
        _synchronize(self.model.device)   # charge each step its own GPU work (lesson 03)
        began = time.perf_counter()
        paged_next_token(self.model, self.tokenizer, self.cache, batch, self.stop_at_eos,
                         max_prefill_tokens, self.lora)
        _synchronize(self.model.device)
        new_tokens = sum(len(tokens) for tokens in batch.token_ids) - tokens_before
        self.trace.steps.append(Step(kind, running, self.slots_now(),
                                     time.perf_counter() - began, new_tokens))

    def slots_now(self) -> list[int | None]:
        """The request id in each slot of the batch, None for a free slot."""
        slots = [None] * self.batch_size
        for rid, slot in self.slot_of.items():
            slots[slot] = rid
        return slots

    def collect(self, batch: PagedBatch, bar) -> PagedBatch:
        """Store the answers of finished rows, free their slots, drop their rows (and hand
        their blocks back to the pool)."""
        for rid, tokens, done in zip(batch.request_ids, batch.token_ids, batch.done):
            if done:
                self.trace.token_ids[rid] = tokens
                del self.slot_of[rid]
                bar.update(1)
        return filter_paged_batch(self.cache, batch)


def _adapters(lora, rows):
    """``lora.rows(rows)`` (each row's adapter for one forward pass), or nothing without lora."""
    return lora.rows(rows) if lora is not None else contextlib.nullcontext()


def check_prefill_budget(max_prefill_tokens) -> None:
    """``max_prefill_tokens`` is a positive integer or None (no cap): ValueError otherwise."""
    if max_prefill_tokens is not None and (isinstance(max_prefill_tokens, bool) or
                                           not isinstance(max_prefill_tokens, int) or
                                           max_prefill_tokens < 1):
        raise ValueError(f"max_prefill_tokens must be a positive integer or None, "
                         f"got {max_prefill_tokens!r}")


def _check_adapters(adapters, lora, n_requests: int) -> list:
    """One adapter name (or None) per request, every name known to ``lora``."""
    if adapters is None:
        return [None] * n_requests
    if len(adapters) != n_requests:
        raise ValueError(f"got {len(adapters)} adapters for {n_requests} requests: give one "
                         f"per request (None for the base model)")
    if lora is None and any(a is not None for a in adapters):
        raise ValueError("adapters name LoRA adapters but lora is None: pass the MultiLora "
                         "that holds them (helpers.load_adapters)")
    if lora is not None:
        lora.stack_indices_for(adapters)     # a ValueError for an unknown name
    return list(adapters)
