"""Attention over a pool of KV blocks, plugged into transformers models. (Lesson 08.)

``KVPool`` holds, for every layer, one keys tensor and one values tensor for the whole pool,
of shape (num_blocks * block_size, kv_heads, head_dim): one entry per token the pool can hold.
A token's entry is found by its *pool index*, ``block * block_size + offset``: the token at
``offset`` in block ``block``. The pool index is not the token's position in its sequence:
position ``i`` of a request is at offset ``i % block_size`` of block ``table[i // block_size]``
of its block table, wherever the pool put that block (``pool_indices`` does the sum).
kv_heads comes from the model's config, so models whose attention heads share kv heads (GQA)
store only their kv heads.

How it reaches the model. transformers looks every attention layer's function up by the name
in ``model.config._attn_implementation``, in the registry ``AttentionInterface``; anything we
register there can be chosen with ``model.set_attn_implementation(name)``. Extra keyword
arguments given to the model's forward reach that function untouched. So we run the model
with no transformers cache at all (``use_cache=False``) and give it a ``PagedForward``
(``paged=...``): the pool indices the new tokens' keys and values are written to, and the
pool indices each row reads. The function ``paged_attention`` then

1. writes the new keys and values at their pool indices, and
2. gathers each row's entries (its whole history, the new tokens included) and attends over
   them with a mask that lets a token see the positions up to its own and nothing past the
   row's end.

This is the readable version: the gather copies each row's history into a padded tensor for
every layer of every step. Real engines read the blocks in place inside the attention kernel
(vLLM's PagedAttention); the bookkeeping is the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: The name our attention function is registered under in transformers' AttentionInterface.
PAGED_ATTENTION = "course_paged"


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers model config: GPT-2 and Llama-style
    configs alike (transformers answers GPT-2's n_layer / n_head to the generic names)."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


class KVPool:
    """The keys and values of every block of the pool, per layer. (Lesson 08.)

    ``keys[layer]`` and ``values[layer]`` have one entry per pool index
    (``block * block_size + offset``): (num_blocks * block_size, kv_heads, head_dim).
    """

    def __init__(self, model, num_blocks: int, block_size: int, dtype=None):
        layers, kv_heads, head_dim = kv_shape(model.config)
        self.num_blocks, self.block_size = num_blocks, block_size
        like = dict(dtype=dtype or model.dtype, device=model.device)
        entries = num_blocks * block_size
        self.keys = [torch.zeros(entries, kv_heads, head_dim, **like) for _ in range(layers)]
        self.values = [torch.zeros(entries, kv_heads, head_dim, **like) for _ in range(layers)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool's tensors."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
              indices: torch.Tensor) -> None:
        """Store new keys/values (rows, kv_heads, tokens, head_dim) at the pool ``indices``
        (rows, tokens); an index of -1 marks input padding, which is not stored."""
        real = indices >= 0
        at = indices[real]
        self.keys[layer][at] = keys.transpose(1, 2)[real].to(self.keys[layer].dtype)
        self.values[layer][at] = values.transpose(1, 2)[real].to(self.values[layer].dtype)

    def gather(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values read at the pool ``indices`` (rows, length): two tensors
        of shape (rows, kv_heads, length, head_dim), the layout attention expects.
        (``index_select`` on the flattened indices copies the entries faster than indexing
        with the 2-D ``indices`` does, for the same result.)"""
        flat = indices.reshape(-1)
        return tuple(pool.index_select(0, flat).view(*indices.shape, *pool.shape[1:])
                     .transpose(1, 2) for pool in (self.keys[layer], self.values[layer]))


def pool_indices(block_table: list[int], positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """The pool indices of a request's tokens at ``positions`` (0 = the first prompt token):
    the block that holds the position, times ``block_size``, plus the offset in the block."""
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


@dataclass
class PagedForward:
    """What ``paged_attention`` needs for one forward pass. (Lesson 08.)

    The inputs are the rows' new tokens, padded on the LEFT to the longest (so every row's last
    token is in the last column, as in lesson 02). Only the input is padded: the pool is not.

    write_indices: (rows, new) the pool index of every new token, -1 for input padding
    read_indices:  (rows, length) the pool indices of each row's tokens from position 0 to its
                   last new token, then index 0 as filler up to the longest row (masked out)
    mask:          (rows, 1, new, length) True where a new token may attend to the token
                   that column ``j`` of ``read_indices`` points at (position ``j``)
    """

    pool: KVPool
    write_indices: torch.Tensor
    read_indices: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(cls, pool: KVPool, tables: list[list[int]], starts: list[int],
              new_counts: list[int], device) -> "PagedForward":
        """Row r already has ``starts[r]`` tokens in its blocks ``tables[r]`` and now feeds
        ``new_counts[r]`` new ones, at positions ``starts[r] .. starts[r] + new_counts[r] - 1``
        (its table must already cover them: ``BlockManager.grow``)."""
        width, length = max(new_counts), max(s + n for s, n in zip(starts, new_counts))
        size = pool.block_size
        write = torch.full((len(tables), width), -1, dtype=torch.long)
        read = torch.zeros((len(tables), length), dtype=torch.long)
        mask = torch.zeros((len(tables), 1, width, length), dtype=torch.bool)
        for r, (table, start, new) in enumerate(zip(tables, starts, new_counts)):
            end = start + new
            read[r, :end] = pool_indices(table, torch.arange(end), size)
            write[r, width - new:] = read[r, start:end]
            # New token j (column width - new + j) sits at position start + j: it sees 0..start+j.
            causal = torch.ones(new, end, dtype=torch.bool).tril(diagonal=start)
            mask[r, 0, width - new:, :end] = causal
            # Padding queries see column 0 only: a row of the mask with nothing allowed would
            # give NaN in the softmax. Their outputs are thrown away.
            mask[r, 0, :width - new, 0] = True
        return cls(pool, write.to(device), read.to(device), mask.to(device))


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    paged: PagedForward | None = None, **kwargs):
    """An attention function for transformers' ``AttentionInterface``: attention over the pool.
    (Lesson 08.)

    query (rows, heads, new, head_dim); key and value (rows, kv_heads, new, head_dim) are the
    new tokens only (the model runs without a transformers cache). Returns the attention
    output as (rows, new, heads, head_dim) and no weights, as transformers expects. The mask
    transformers would build is not used (it gives None for a function it does not know):
    ``paged.mask`` is the mask. Inference only: ``dropout`` is ignored.
    """
    if paged is None:
        raise ValueError(f"the {PAGED_ATTENTION!r} attention needs paged=PagedForward(...) in "
                         f"the model's forward; use model_uses_paged_attention(model)")
    layer = module.layer_idx
    paged.pool.write(layer, key, value, paged.write_indices)
    keys, values = paged.pool.gather(layer, paged.read_indices)
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    # GQA: each kv head serves heads // kv_heads query heads; enable_gqa repeats them for us.
    output = F.scaled_dot_product_attention(query, keys, values, attn_mask=paged.mask,
                                            scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def register_paged_attention() -> str:
    """Register ``paged_attention`` with transformers (once is enough); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    return PAGED_ATTENTION


@contextlib.contextmanager
def model_uses_paged_attention(model):
    """``with model_uses_paged_attention(model):`` the model's attention layers call
    ``paged_attention``; the previous implementation comes back afterwards."""
    previous = model.config._attn_implementation    # e.g. "sdpa"; no public getter in 5.x
    model.set_attn_implementation(register_paged_attention())
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
