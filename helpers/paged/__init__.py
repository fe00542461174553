"""A paged KV cache, prefix caching and chunked prefill. (Lesson 08.)

One idea a module:

    blocks     the block manager: block tables, reference counts, chained block hashes and
               the LRU of freed cached blocks (plain Python, no tensors)
    attention  the pool's tensors and the attention function that reads them, registered with
               transformers' ``AttentionInterface``
    batching   lesson 03's continuous batching on the paged cache: ``init_paged_batch``,
               ``paged_next_token``, ``merge_paged_batches``, ``filter_paged_batch`` and the
               driver ``generate_paged``
    measure    what lesson 08 measures, one call each: ``padded_cache_widths``,
               ``ttft_one_after_another``, ``fastest_step_times``, ``worst_inter_token_gap``,
               ``time_to_first_token``

It builds on ``helpers.batching`` (lesson 03) and takes a ``helpers.lora.MultiLora``
(lesson 06) for per-row adapters.

Two words kept apart: a *slot* is, as in lesson 03, a place in the running batch (a request
takes one while it runs); a token's place in the KV pool is its *pool index*,
``block * block_size + offset`` (see ``KVPool``).
"""

from .attention import (PAGED_ATTENTION, KVPool, PagedForward, kv_shape,
                        model_uses_paged_attention, paged_attention, pool_indices,
                        register_paged_attention)
from .batching import (PagedBatch, PagedKVCache, default_num_blocks, filter_paged_batch,
                       generate_paged, init_paged_batch, merge_paged_batches, paged_next_token)
from .blocks import BlockManager, PoolExhausted, block_hash
from .measure import (fastest_step_times, padded_cache_widths, time_to_first_token,
                      ttft_one_after_another, worst_inter_token_gap)

__all__ = [
    "BlockManager", "KVPool", "PAGED_ATTENTION", "PagedBatch", "PagedForward", "PagedKVCache",
    "PoolExhausted", "block_hash", "default_num_blocks", "filter_paged_batch", "generate_paged",
    "init_paged_batch", "kv_shape", "merge_paged_batches", "model_uses_paged_attention",
    "paged_attention", "paged_next_token", "pool_indices", "register_paged_attention",
    # what lesson 08 measures
    "fastest_step_times", "padded_cache_widths", "time_to_first_token",
    "ttft_one_after_another", "worst_inter_token_gap",
]
