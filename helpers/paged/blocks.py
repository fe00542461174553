"""The block manager: which blocks of the KV pool belong to which request. (Lesson 08.)

The pool holds ``num_blocks`` blocks of ``block_size`` token positions each. A request owns a
*block table*, the list of its blocks in order: token ``i`` of the request lives in block
``table[i // block_size]`` at offset ``i % block_size``. Blocks are taken one at a time as the
request grows, so no request holds room for tokens it has not produced.

Prefix caching. A full block is named by a hash of its token ids, chained from the hash of
the block before it (and of the adapter, so that two adapters never share KV: the same tokens
give different keys and values under a different adapter). Equal hashes therefore mean equal
tokens all the way from the start of the request. A new request walks its prompt block by
block and reuses every block whose hash is already known; only the rest is computed.

Reference counts. A block shared by several requests is counted once per request. When a
request ends, its blocks' counts drop; a block whose count reaches zero is free. A free block
that has a hash keeps its keys and values and stays findable by that hash until the pool needs
the block for something else: free blocks are handed out oldest-freed first (least recently
used), blocks without a hash before any block with one.

This module only does the bookkeeping (plain Python lists and dicts); the tensors live in
``helpers.paged.attention.KVPool``.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict


class PoolExhausted(RuntimeError):
    """The KV pool has too few free blocks for what was asked. The scheduler catches it and
    waits for running requests to finish (see ``BlockManager.allocate``)."""


def block_hash(parent: str | None, token_ids, adapter: str | None = None) -> str:
    """The name of a full block: a SHA-256 of the parent block's hash, the block's token ids
    and the adapter. (Lesson 08.)

    Chaining from the parent makes the hash stand for the whole prefix, not just this block:
    "sat on the wall" at the start of one prompt and in the middle of another get different
    hashes, as they must (their keys and values differ, because attention saw different text).
    """
    text = f"{parent}|{adapter}|{','.join(str(int(t)) for t in token_ids)}"
    return hashlib.sha256(text.encode()).hexdigest()


class BlockManager:
    """Block tables, reference counts and the prefix cache of a pool of KV blocks. (Lesson 08.)

    Per request (any hashable id): ``allocate`` when it is admitted, ``grow`` before a forward
    pass writes new tokens, ``commit`` after it (full blocks get their hash),
    ``free_request`` when it ends.

    Wait, do not preempt. ``allocate`` refuses (``PoolExhausted``) unless the free blocks cover
    the request's worst case: its prompt plus every token it may generate. The blocks are not
    taken yet, only *reserved*: they are taken one by one as the request grows, and a request
    that stops early at EOS gives the rest back. The scheduler keeps a refused request in the
    queue until running requests finish. With this rule a running request can always grow,
    so nothing ever has to be evicted from a running request: no work is thrown away and
    requests finish in the order the simple schedule predicts. The alternative, vLLM's, admits
    more eagerly and preempts (frees and later recomputes) a request when a decode step finds
    no free block; it fits more requests when many stop early, at the price of recomputation
    and a harder scheduler.
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.hashes: list[str | None] = [None] * num_blocks   # a full block's hash, else None
        self.cached: dict[str, int] = {}                       # hash -> block holding it
        # Free blocks in the order they are handed out: front = first out (dict keeps order).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict = {}         # request id -> its block table (list of block ids)
        self.adapters: dict = {}       # request id -> its adapter (part of every hash)
        self.reserved: dict = {}       # request id -> blocks promised but not taken yet
        self.looked_up_blocks = 0      # prompt blocks looked up in the cache, since creation
        self.hit_blocks = 0            # ... and found there

    # --- what is free ---------------------------------------------------------------------

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks needed to hold ``n_tokens`` tokens."""
        return math.ceil(n_tokens / self.block_size)

    @property
    def available(self) -> int:
        """Free blocks not promised to a running request."""
        return len(self.free) - sum(self.reserved.values())

    @property
    def used(self) -> int:
        """Blocks held by requests (each counted once, however many requests share it)."""
        return self.num_blocks - len(self.free)

    # --- a request's life -----------------------------------------------------------------

    def allocate(self, request_id, prompt_ids: list[int], max_new_tokens: int,
                 adapter: str | None = None, prefix_caching: bool = True) -> int:
        """Admit a request: take the blocks of its prompt that are already cached, reserve
        the rest of its worst case. Returns how many prompt tokens are cached (a multiple of
        ``block_size``): the model computes only the prompt tokens after them.

        Raises ``PoolExhausted`` (and changes nothing) when the free blocks do not cover the
        prompt plus ``max_new_tokens`` tokens; ValueError when the request is already here.
        """
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} already has blocks: free it first")
        if len(prompt_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be a positive "
                             f"integer, got {max_new_tokens!r}")
        hits = self.cached_prefix(prompt_ids, adapter) if prefix_caching else []
        # A hit block that is free right now leaves the free list: it counts as needed too.
        needed = self.blocks_for(len(prompt_ids) + max_new_tokens) - len(hits)
        needed_now = needed + sum(self.ref_counts[b] == 0 for b in hits)
        if needed_now > self.available:
            raise PoolExhausted(
                f"request {request_id!r} needs {needed_now} free blocks of {self.block_size} "
                f"tokens ({len(prompt_ids)} prompt tokens + up to {max_new_tokens} new, "
                f"{len(hits)} blocks cached), but only {self.available} of {self.num_blocks} "
                f"are free")
        for block in hits:
            self._take(block)
        if prefix_caching:
            self.hit_blocks += len(hits)
            self.looked_up_blocks += (len(prompt_ids) - 1) // self.block_size
        self.tables[request_id] = list(hits)
        self.adapters[request_id] = adapter
        self.reserved[request_id] = needed
        return len(hits) * self.block_size

    def grow(self, request_id, n_tokens: int) -> list[int]:
        """Make the request's table cover ``n_tokens`` tokens, taking reserved blocks; returns
        the table. Called before a forward pass writes the keys and values of new tokens."""
        table = self._table(request_id)
        while len(table) * self.block_size < n_tokens:
            if self.reserved[request_id] == 0:
                raise PoolExhausted(f"request {request_id!r} grew past the tokens it reserved "
                                    f"room for ({len(table) * self.block_size})")
            self.reserved[request_id] -= 1
            block = next(iter(self.free))     # the least recently used free block
            self._evict(block)
            table.append(self._take(block))
        return table

    def commit(self, request_id, token_ids: list[int]) -> None:
        """The keys and values of ``token_ids`` (the request's tokens from the start) are now
        in its blocks: give every full block its chained hash and make it findable."""
        table = self._table(request_id)
        parent = None
        for i in range(len(token_ids) // self.block_size):
            block = table[i]
            if self.hashes[block] is None:
                tokens = token_ids[i * self.block_size:(i + 1) * self.block_size]
                self.hashes[block] = block_hash(parent, tokens, self.adapters[request_id])
                # Two requests may compute the same block at once: the first one stays cached.
                self.cached.setdefault(self.hashes[block], block)
            parent = self.hashes[block]

    def free_request(self, request_id) -> None:
        """The request is over: drop its references and its reservation. Its blocks that no
        other request uses become free; those with a hash stay cached until reused."""
        for block in self._table(request_id):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None                         # last out: evicted last
                if self.hashes[block] is None or self.cached.get(self.hashes[block]) != block:
                    self.free.move_to_end(block, last=False)    # nothing to keep: hand out first
        del self.tables[request_id], self.adapters[request_id], self.reserved[request_id]

    def cached_prefix(self, prompt_ids: list[int], adapter: str | None = None) -> list[int]:
        """The cached blocks that hold the prompt's first full blocks, in order, up to the
        first miss. The prompt's last token is never taken from the cache: the model must
        read it to give the first new token's logits."""
        hits, parent = [], None
        for i in range((len(prompt_ids) - 1) // self.block_size):
            tokens = prompt_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = block_hash(parent, tokens, adapter)
            block = self.cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    # --- inside ---------------------------------------------------------------------------

    def _take(self, block: int) -> int:
        """One more reference to ``block`` (a free block leaves the free list)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1
        return block

    def _evict(self, block: int) -> None:
        """Forget the hash of a free block about to hold new tokens."""
        old = self.hashes[block]
        if old is not None and self.cached.get(old) == block:
            del self.cached[old]
        self.hashes[block] = None

    def _table(self, request_id) -> list[int]:
        if request_id not in self.tables:
            raise ValueError(f"request {request_id!r} has no blocks (allocate it first)")
        return self.tables[request_id]
