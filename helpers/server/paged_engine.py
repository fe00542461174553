"""The engine on lesson 08's paged KV cache, with prefix caching and chunked prefill.
(Lessons 07 and 08.)

``PagedEngine`` is ``Engine`` with lesson 08's batching functions in place of lesson 03's:
``paged_batch_from_token_ids`` (the tokenized form of ``init_paged_batch``),
``paged_next_token``, ``merge_paged_batches`` and ``filter_paged_batch``. Everything else,
from checking a request to choosing each row's token and handing it out, is ``Engine``'s.
A step runs ``paged_next_token``'s work without its padding, and compiled where it can
(``compiled.PackedStep``, lesson 10); batches with a LoRA row run ``paged_next_token`` itself.

    python -m helpers.server --kv-cache paged

What changes for the requests:

* the KV cache is a pool of blocks, sized so that ``max_batch_size`` requests of
  ``max_total_tokens`` always fit, up to ``POOL_BYTES`` (the bundled model's pool for 64
  requests is a few MB; GPT-2's would be 4.8 GB): below that cap, a request admitted into a
  free slot never waits for blocks; above it, the pool is cut to the cap, and a request that
  the pool cannot hold yet waits at the head of the queue;
* prompts that share a prefix (a system prompt, a few-shot preamble) share its blocks, and
  only the rest is computed (``/metrics`` counts the prompt tokens looked up in the prefix
  cache and those found there, and shows the blocks in use);
* a step is one forward pass over every row: the running rows' next tokens and the newcomers'
  prompts together, as in vLLM, where lesson 03's engine runs a prefill pass and then a
  decode pass;
* a long prompt is read ``max_prefill_tokens`` tokens at a time, each chunk in the same pass
  as the running rows' next tokens, so their streams do not freeze while it is read.

Prompt log probabilities (``prompt_logprobs``) need the logits at every prompt position, which
a prefill split into chunks, or skipped for a cached prefix, does not give: for the requests
that ask, the prompt is scored by a forward pass of its own when the request is admitted.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..paged import (PagedBatch, PagedKVCache, PoolExhausted, filter_paged_batch, kv_shape,
                     merge_paged_batches, paged_next_token)
from ..paged.batching import check_prefill_budget, paged_batch_from_token_ids
from .choosing import guarded
from ..compilation import CAPTURE_SIZES
from .compiled import PackedStep
from .engine import Engine, Request
from .graphs import GraphedDecode, check_sizes

log = logging.getLogger("helpers.server")


#: The most memory the default pool takes (vLLM's CPU build asks for its KV space in GiB too).
POOL_BYTES = 2**30


def _switch(name: str, value) -> str:
    """"auto", "on" or "off" (True and False stand for the last two); ValueError otherwise."""
    value = {True: "on", False: "off"}.get(value, value)
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{name} must be 'auto', 'on' or 'off', got {value!r}")
    return value


def default_pool_blocks(model, block_size: int, max_batch_size: int,
                        max_total_tokens: int) -> int:
    """Blocks for ``max_batch_size`` requests of ``max_total_tokens`` tokens, cut to what
    ``POOL_BYTES`` holds, but never below one request's worth."""
    layers, kv_heads, head_dim = kv_shape(model.config)
    block_bytes = 2 * layers * kv_heads * head_dim * block_size * model.dtype.itemsize
    per_request = math.ceil(max_total_tokens / block_size)
    return max(per_request, min(max_batch_size * per_request, POOL_BYTES // block_bytes))


class PagedEngine(Engine):
    """``Engine`` on a paged KV cache. (Lesson 08.)

    block_size:         token positions per block of the pool
    prefix_caching:     new requests reuse the cached blocks of their prompt's prefix
    max_prefill_tokens: prompt tokens read per step at most (chunked prefill; None: no cap).
                        512, as vLLM reads many prompts in one step: a burst of new
                        requests is read in one pass, not in many small ones
    num_blocks:         blocks in the pool (default: room for ``max_batch_size`` requests of
                        ``max_total_tokens`` tokens, at most ``POOL_BYTES``); fewer than one
                        request of ``max_total_tokens`` needs is a ValueError
    compile:            run the steps compiled (``compiled.py``, lesson 10): "on" (or
                        True), "off" (or False), or "auto": on, but eager (with a warning in
                        the log) where compiling fails. Compiling happens here, before the
                        engine answers anything.
    cuda_graphs:        replay decode steps as CUDA graphs (``graphs.py``, lesson 10): "auto"
                        (on with a CUDA device, off elsewhere; off with a warning where
                        capturing fails), "on" (fail instead) or "off"
    graph_sizes:        the capture sizes (those above ``max_batch_size`` are left out)
    capture:            how a step is recorded (default: a CUDA graph); the tests pass
                        ``graphs.rerun_each_replay`` to run everything around the graphs on a
                        CPU
    Every other argument is ``Engine``'s. Nothing is compiled or captured after start-up.
    """

    kv_cache = "paged"

    def __init__(self, model, tokenizer, *, block_size: int = 16, prefix_caching: bool = True,
                 max_prefill_tokens: int | None = 512, num_blocks: int | None = None,
                 compile: bool | str = False, cuda_graphs: bool | str = "off",
                 graph_sizes=CAPTURE_SIZES, capture=None, **options):
        super().__init__(model, tokenizer, **options)
        if num_blocks is None:
            num_blocks = default_pool_blocks(model, block_size, self.max_batch_size,
                                             self.max_total_tokens)
        one_request = math.ceil(self.max_total_tokens / block_size)
        if num_blocks < one_request:         # such a request would wait for blocks forever
            raise ValueError(
                f"num_blocks={num_blocks} blocks of {block_size} tokens cannot hold one request "
                f"of max_total_tokens={self.max_total_tokens}: give at least {one_request} "
                f"blocks, or a smaller max_total_tokens")
        check_prefill_budget(max_prefill_tokens)
        # One spare block, which no request owns: the packed step's padding reads it.
        self.cache = PagedKVCache(model, num_blocks, block_size, prefix_caching, spare_blocks=1)
        compile, cuda_graphs = _switch("compile", compile), _switch("cuda_graphs", cuda_graphs)
        graphs_wanted = cuda_graphs == "on" or (cuda_graphs == "auto"
                                                and model.device.type == "cuda")
        if cuda_graphs == "on" and model.device.type != "cuda" and capture is None:
            raise ValueError(f"cuda_graphs='on' needs a CUDA device; the model is on "
                             f"{model.device}")
        sizes = check_sizes(graph_sizes, self.max_batch_size) if graphs_wanted else ()
        self.packed = PackedStep(model, self.cache.pool, num_blocks, self.pad_id,
                                 compile != "off")
        if compile != "off" or graphs_wanted:
            # Every layer an adapter could touch is wrapped first, so that loading an adapter
            # later never changes the model the graphs were traced or captured from.
            self.adapters.lora.wrap_all()
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
            self.graphs = GraphedDecode(self.packed, self.max_total_tokens, sizes, capture)
            try:
                self.graphs.capture_all()
            except Exception as err:
                if cuda_graphs == "on":
                    raise
                log.warning("capturing CUDA graphs failed (%s: %s): decode steps run without "
                            "them", type(err).__name__, err)
                self.graphs = None
        self.packed.seal()                   # nothing is compiled or captured from now on
        self.stats["steps_compiled"] = 0
        self.max_prefill_tokens = max_prefill_tokens
        self._batch = PagedBatch.empty()    # every admitted row, reading its prompt or not

    def step(self) -> None:
        """One turn: lesson 08's ``generate_paged`` loop for requests that come and go. Every
        row is in one batch, and a step is one forward pass over it: the running rows' next
        tokens and the newcomers' prompt tokens (a chunk of them, at most
        ``max_prefill_tokens``) together, as vLLM schedules them."""
        # 1. Rows whose client went away leave (their blocks go back to the pool).
        self._drop_cancelled()
        # 2. Once the last newcomers have read their prompts, free slots take waiting
        #    requests, each with the blocks the pool promises it.
        if self._batch.prefilled:
            with self._cond:
                new = self._admit()
            self._score_prompts(new)
            self._batch = merge_paged_batches(self._batch, new)
        # 3. One forward pass: each row feeds its pending tokens; rows that have read all of
        #    theirs get a token, and the finished ones leave.
        if len(self._batch):
            self._generate(self._batch)
            self._batch = filter_paged_batch(self.cache, self._batch)

    def _admit(self) -> PagedBatch:
        """Waiting requests, first come first served, while a slot is free and the pool can
        hold them (a request it cannot hold yet waits at the head of the queue)."""
        new = PagedBatch.empty()
        while self._waiting and len(self._rows) < self.max_batch_size:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                self.stats["cancelled"] += 1
                continue
            try:
                row = paged_batch_from_token_ids(
                    self.cache, [request.prompt_ids], [max(1, request.max_new_tokens)],
                    [request.id], [request.adapter])
            except PoolExhausted:
                break
            self._waiting.popleft()
            self._rows[request.id] = request
            if self.cache.prefix_caching:   # vLLM's prefix_cache_queries and _hits, in tokens
                self.stats["prefix_cache_queries"] += len(request.prompt_ids)
                self.stats["prefix_cache_hits"] += row.computed[0]
            new = merge_paged_batches(new, row)
        return new

    def _score_prompts(self, batch: PagedBatch) -> None:
        """The PromptEvent of every new row that asked for it, from a forward pass of its
        prompt alone (with its adapter)."""
        outgoing = []
        for rid, adapter in zip(batch.request_ids, batch.adapters):
            row = self._rows[rid]
            if row.params.prompt_logprobs:
                guarded(row, self._score_alone, row, adapter, outgoing)
        self.deliver(outgoing)

    def _score_alone(self, row: Request, adapter: str | None, outgoing: list) -> None:
        lora = self.adapters.lora
        ids = torch.tensor([row.prompt_ids], device=self.device)
        with lora.rows([adapter] if lora.names else None):     # then the rows as they were
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
        self.choose.score_prompt(row, logits, outgoing)

    def _generate(self, batch: PagedBatch) -> None:
        """One forward pass over ``batch`` (the packed step, or lesson 08's ``paged_next_token``
        where a row uses an adapter) with ``Engine``'s chooser; then the rows that got a token
        hand it out. A pass that reads prompt tokens counts as a prefill step."""
        start = time.perf_counter()
        kind = "decode" if batch.prefilled else "prefill"
        max_prefill_tokens = self.max_prefill_tokens
        self.stats["rows_max"] = max(self.stats["rows_max"], len(self._rows))
        outgoing, chosen = [], []

        def choose(logits, rows):
            picked = [self._rows[batch.request_ids[i]] for i in rows]
            chosen.extend(zip(rows, picked))
            return self.choose(picked, logits, outgoing)

        lora = self.adapters.lora if self.adapters.lora.names else None
        graph = None
        if self.graphs is not None:         # a decode step replays a graph where it can
            why = self.graphs.why_not(batch)
            if why is None:
                graph = self.graphs
            else:
                self.graphs.fallbacks[why] += 1
        if self.packed.usable(batch):
            if lora is not None:             # no row uses an adapter: none may be left set
                lora.set_rows(None)
            self.packed.step(batch, self.cache, choose, max_prefill_tokens, graph)
            self.stats["steps_compiled"] += self.packed.compiled and graph is None
        else:
            # EOS is handled by Request.accept (per row: ignore_eos, grammars), not the helper.
            paged_next_token(self.model, self.tokenizer, self.cache, batch, False,
                             max_prefill_tokens, lora, choose=choose)
        self._hand_out(batch, chosen, outgoing)
        self.stats[f"steps_{kind}"] += 1
        self.stats["tokens"] += len(chosen)
        self.stats["busy_seconds"] += time.perf_counter() - start

    def _drop_cancelled(self) -> None:
        batch = self._batch
        cancelled = [i for i, rid in enumerate(batch.request_ids) if self._rows[rid].cancelled]
        for i in cancelled:
            batch.done[i] = True
            del self._rows[batch.request_ids[i]]
            self.stats["cancelled"] += 1
        if cancelled:
            self._batch = filter_paged_batch(self.cache, batch)

    def _fail_rows(self, message: str) -> None:
        super()._fail_rows(message)
        for rid in list(self.cache.manager.tables):     # every block back to the pool
            self.cache.manager.free_request(rid)
        self._batch = PagedBatch.empty()

    def snapshot(self) -> dict:
        """``Engine``'s counters and gauges, and the pool's: blocks held by requests and
        blocks in all (the prefix-cache counters are in ``stats``, counted at admission)."""
        manager = self.cache.manager
        compiled = {"compiles": self.packed.compiles,
                    "compile_seconds": self.packed.compile_seconds,
                    "steps_eager_instead": self.packed.eager_instead}
        graphs = self.graphs.snapshot() if self.graphs is not None else {}
        return {**super().snapshot(), "kv_blocks_used": manager.used,
                "kv_blocks_total": manager.num_blocks, **compiled, **graphs}

    def info(self) -> dict:
        return {**super().info(), "kv_block_size": self.cache.block_size,
                "kv_blocks": self.cache.manager.num_blocks,
                "prefix_caching": self.cache.prefix_caching,
                "max_prefill_tokens": self.max_prefill_tokens,
                "compiled": self.packed.compiled,
                "cuda_graph_sizes": list(self.graphs.sizes) if self.graphs is not None else []}
