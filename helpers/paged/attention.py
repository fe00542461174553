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


# --- the same attention for a packed pass (the server's step, lessons 08 and 10) -----------

#: The name the packed (and compiled) pass's attention function is registered under.
COMPILED_ATTENTION = "course_paged_compiled"


@dataclass
class PackedInputs:
    """What ``packed_paged_attention`` needs for one step. The step's new tokens, every row's
    one after another with no padding, are T tokens; R rows feed them, Q at most a row; the
    longest row's history (its new tokens included) is L tokens.

    write_indices: (T,) the pool index each new token's keys and values are written to
    read_indices:  (R, L) each row's pool indices from position 0 to its last new token, then
                   the scratch entry as filler up to L (masked out)
    query_indices: (R, Q) where each row's new tokens are among the T: row r's j-th new token
                   (a row with fewer than Q repeats its last one; those copies are dropped)
    output_indices:(T,) where each of the T tokens is among the R * Q outputs
    mask:          (R, 1, Q, L) True where a row's new token may look: the positions up to its own
    positions:     (1, T) each new token's position in its row (the model's ``position_ids``)
    last:          (R,) where each row's last new token is among the T (``logits_to_keep``)
    """

    pool: KVPool
    write_indices: torch.Tensor
    read_indices: torch.Tensor
    query_indices: torch.Tensor
    output_indices: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor

    @classmethod
    def build(cls, pool: KVPool, scratch: int, tables: list[list[int]], starts: list[int],
              counts: list[int], device, length: int | None = None) -> "PackedInputs":
        """Row r already has ``starts[r]`` tokens in its blocks ``tables[r]`` and now feeds
        ``counts[r]`` new ones (as lesson 08's ``PagedForward.build``); ``scratch`` is the pool
        index that padding reads. ``length`` fixes L (a CUDA graph's shapes never change);
        by default L is the longest history."""
        size = pool.block_size
        starts, counts = torch.tensor(starts), torch.tensor(counts)
        ends = starts + counts
        width = max(len(table) for table in tables)
        table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables])
        # L is at least 2: a history of one token would be a graph of its own.
        positions = torch.arange(length or max(2, int(ends.max())))
        read = table[:, (positions // size).clamp(max=width - 1)] * size + positions % size
        read = torch.where(positions[None, :] < ends[:, None], read, scratch)
        # Each new token: its row, its position; where it sits among the T and the R * Q.
        rows = torch.arange(len(counts))
        width_q = int(counts.max())
        if width_q == 1:                        # one token a row: token r is row r's
            row_of, first, j = rows, rows, torch.zeros_like(rows)
        else:
            row_of = torch.repeat_interleave(rows, counts)
            first = torch.cumsum(counts, 0) - counts           # each row's first of the T
            j = torch.arange(len(row_of)) - first[row_of]      # the token's place in its row
        token_positions = starts[row_of] + j
        write = read[row_of, token_positions]
        queries = first[:, None] + torch.minimum(torch.arange(width_q)[None, :],
                                                 (counts - 1)[:, None])
        mask = positions[None, None, :] <= (starts[:, None] + queries - first[:, None])[..., None]
        return cls(pool, *(tensor.to(device) for tensor in (
            write, read, queries, row_of * width_q + j, mask[:, None], token_positions[None],
            first + counts - 1)))


def packed_paged_attention(module, query, key, value, attention_mask, scaling=None,
                           dropout=0.0, paged: PackedInputs | None = None, **kwargs):
    """Lesson 08's ``paged_attention`` for a packed step: the model sees one sequence of T
    tokens (query, key, value: (1, heads, T, head_dim)), the new tokens of every row. Each
    token's keys and values go to the pool (``index_copy_``, which a compiler can trace); then
    the queries are regrouped by row, (R, heads, Q, head_dim), attend over their row's history,
    and go back to the order of the T tokens. Returns (1, T, heads, head_dim), as
    transformers expects.
    """
    keys, values = paged.pool.keys[module.layer_idx], paged.pool.values[module.layer_idx]
    at = paged.write_indices
    keys.index_copy_(0, at, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, at, value[0].transpose(0, 1).to(values.dtype))
    rows, width = paged.query_indices.shape
    heads, head_dim = query.shape[1], query.shape[3]
    tokens = query[0].transpose(0, 1)                              # (T, heads, head_dim)
    if width == 1 and torch.compiler.is_compiling():
        # A compiled decode step: row r's one token is token r. Written as sums over the
        # pool's entries, inductor reads them in place (no copy of each row's history).
        return in_place_decode_attention(tokens, keys, values, paged, scaling).unsqueeze(0), None
    # Each row's history, (R, kv_heads, L, head_dim): lesson 08's gather.
    row_keys, row_values = paged.pool.gather(module.layer_idx, paged.read_indices)
    row_keys, row_values = row_keys.to(query.dtype), row_values.to(query.dtype)
    if width == 1:               # a decode step: row r's one token is token r, nothing to move
        by_row = tokens.unsqueeze(2)
    else:
        by_row = (tokens.index_select(0, paged.query_indices.reshape(-1))
                  .view(rows, width, heads, head_dim).transpose(1, 2))
    output = F.scaled_dot_product_attention(by_row, row_keys, row_values, attn_mask=paged.mask,
                                            scale=scaling, enable_gqa=True)
    output = output.transpose(1, 2).reshape(rows * width, heads, head_dim)
    if width > 1:
        output = output.index_select(0, paged.output_indices)
    return output.unsqueeze(0), None


def in_place_decode_attention(queries, keys, values, paged: PackedInputs, scaling=None):
    """Attention for a decode step, one query a row, written for inductor: the scores are a
    sum over head_dim of the row's query times each key it reads, the output a sum over the
    history of the weights times the values. Eager, ``keys[read]`` would copy every row's
    history; compiled, inductor makes each sum one loop that reads the pool's entries where
    they are (what vLLM's PagedAttention kernel does by hand). queries: (R, heads, head_dim);
    keys, values: a layer's pool. Returns (R, heads, head_dim). GQA: kv_heads may divide heads.
    """
    rows, heads, head_dim = queries.shape
    read = paged.read_indices                                          # (R, L)
    grouped = queries.view(rows, keys.shape[1], -1, head_dim)          # (R, kv_heads, g, D)
    scale = head_dim ** -0.5 if scaling is None else scaling
    scores = (keys[read].to(queries.dtype)[:, :, :, None] * grouped[:, None]).sum(-1) * scale
    visible = paged.mask[:, 0, 0, :, None, None]                       # (R, L, 1, 1)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=1)
    output = (weights[..., None] * values[read].to(queries.dtype)[:, :, :, None]).sum(1)
    return output.reshape(rows, heads, head_dim)
