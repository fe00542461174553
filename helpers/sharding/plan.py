"""The split plan for GPT-2: which weight is cut how, and the cuts themselves. (Lesson 11.)

GPT-2's linear layers are transformers' ``Conv1D``: ``y = x @ W + b`` with ``W`` stored as
``(in, out)``, the transpose of ``nn.Linear``'s ``(out, in)``. So:

- a **column** split (each rank makes some of the outputs) cuts ``W`` along dimension 1, and
  the bias with it; the ranks' outputs side by side are the whole output;
- a **row** split (each rank reads some of the inputs) cuts ``W`` along dimension 0; each rank
  makes a partial sum of every output, and the partial sums added up (an *all-reduce*) are the
  whole output. The bias is not cut: it is added once, to the sum.

Megatron-LM pairs the two, a column split and then a row split, so that what the first layer
makes never leaves its rank and one all-reduce ends the pair. In each GPT-2 block:

    attn.c_attn   column split, per part: its outputs are [queries | keys | values], and each
                  part is cut by heads, so that a rank holds the queries, keys and values of
                  the same heads
    attn.c_proj   row split (the heads a rank holds), then an all-reduce
    mlp.c_fc      column split
    mlp.c_proj    row split, then an all-reduce

Everything else (the embeddings, the layer norms, the output layer) stays whole on every rank.
A rank therefore needs whole heads and an equal share of the MLP's width: a world size that
does not divide both is refused (``check_world_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The four split layers of a GPT-2 block: (module path inside the block, how it is cut).
GPT2_PLAN = (("attn.c_attn", "qkv"), ("attn.c_proj", "row"),
             ("mlp.c_fc", "column"), ("mlp.c_proj", "row"))


def _check_rank(rank: int, world_size: int) -> None:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be between 0 and {world_size - 1} for a world of "
                         f"{world_size}, got {rank}")


def mlp_width(config) -> int:
    """The width of a GPT-2 MLP: ``n_inner``, or 4 × hidden when it is not set. (Lesson 11.)"""
    return getattr(config, "n_inner", None) or 4 * config.hidden_size


def check_world_size(config, world_size: int) -> None:
    """Raise ``ValueError`` unless ``world_size`` ranks can share the model: each rank needs
    whole attention heads and an equal share of the MLP's width. (Lesson 11.)"""
    _check_rank(0, world_size)
    heads, width = config.num_attention_heads, mlp_width(config)
    fitting = [w for w in range(1, heads + 1) if heads % w == 0 and width % w == 0]
    if heads % world_size:
        raise ValueError(
            f"world size {world_size} does not divide the {heads} attention heads: each rank "
            f"must hold whole heads (world sizes that fit this model: "
            f"{', '.join(map(str, fitting))})")
    if width % world_size:
        raise ValueError(
            f"world size {world_size} does not divide the MLP's width of {width}: each rank "
            f"must hold an equal share of it (world sizes that fit this model: "
            f"{', '.join(map(str, fitting))})")


# --- the cuts -----------------------------------------------------------------------------

def split_columns(weight: torch.Tensor, bias: torch.Tensor | None, rank: int, world_size: int):
    """This rank's columns of a ``Conv1D`` weight ``(in, out)`` (dimension 1) and the matching
    entries of its bias: ``(weight (in, out / world_size), bias or None)``. The pieces are
    copies, so that a rank keeps only its own bytes. (Lesson 11.)"""
    _check_rank(rank, world_size)
    if weight.shape[1] % world_size:
        raise ValueError(f"{world_size} ranks cannot share {weight.shape[1]} columns equally")
    part = weight.shape[1] // world_size
    columns = slice(rank * part, (rank + 1) * part)
    return (weight[:, columns].clone(),
            None if bias is None else bias[columns].clone())


def split_rows(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a ``Conv1D`` weight ``(in, out)`` (dimension 0): ``(in / world_size,
    out)``, a copy. The bias of a row split is not cut. (Lesson 11.)"""
    _check_rank(rank, world_size)
    if weight.shape[0] % world_size:
        raise ValueError(f"{world_size} ranks cannot share {weight.shape[0]} rows equally")
    part = weight.shape[0] // world_size
    return weight[rank * part:(rank + 1) * part].clone()


def split_qkv(weight: torch.Tensor, bias: torch.Tensor, num_heads: int, rank: int,
              world_size: int):
    """This rank's share of GPT-2's fused ``c_attn``: ``weight`` ``(hidden, 3 × hidden)`` holds
    the queries', keys' and values' columns one after another, and each of the three parts is
    cut by heads, so that the rank gets the queries, keys and values of the same
    ``num_heads / world_size`` heads. Returns ``(weight (hidden, 3 × hidden / world_size),
    bias (3 × hidden / world_size,))``, copies. ``ValueError`` when the world size does not
    divide the heads. (Lesson 11.)"""
    _check_rank(rank, world_size)
    if num_heads % world_size:
        raise ValueError(f"world size {world_size} does not divide the {num_heads} attention "
                         f"heads: each rank must hold whole heads")
    hidden = weight.shape[1] // 3
    part = hidden // world_size                    # the columns of num_heads / world_size heads
    columns = [slice(start + rank * part, start + (rank + 1) * part)
               for start in (0, hidden, 2 * hidden)]          # in the queries, keys, values
    return (torch.cat([weight[:, c] for c in columns], dim=1),
            torch.cat([bias[c] for c in columns]))


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The token ids ``[start, stop)`` whose embedding rows rank ``rank`` holds when the
    vocabulary is split: ``ceil(vocab / world_size)`` rows each, the last rank fewer when the
    world size does not divide the vocabulary. (Lesson 11.)"""
    _check_rank(rank, world_size)
    rows = -(-vocab_size // world_size)
    return min(rank * rows, vocab_size), min((rank + 1) * rows, vocab_size)


# --- the plan, as a table ------------------------------------------------------------------

@dataclass(frozen=True)
class SplitWeight:
    """One weight of the plan: its name, how it is cut, its whole shape and one rank's."""

    name: str
    kind: str                 # "qkv", "column", "row", "whole"
    whole: tuple
    shard: tuple


def gpt2_plan(config, world_size: int) -> list[SplitWeight]:
    """The plan for one block of a GPT-2 ``config`` shared by ``world_size`` ranks, weights and
    biases, followed by the weights every rank keeps whole. (Lesson 11.)"""
    check_world_size(config, world_size)
    hidden, width, w = config.hidden_size, mlp_width(config), world_size
    return [
        SplitWeight("attn.c_attn.weight", "qkv", (hidden, 3 * hidden), (hidden, 3 * hidden // w)),
        SplitWeight("attn.c_attn.bias", "qkv", (3 * hidden,), (3 * hidden // w,)),
        SplitWeight("attn.c_proj.weight", "row", (hidden, hidden), (hidden // w, hidden)),
        SplitWeight("attn.c_proj.bias", "whole", (hidden,), (hidden,)),
        SplitWeight("mlp.c_fc.weight", "column", (hidden, width), (hidden, width // w)),
        SplitWeight("mlp.c_fc.bias", "column", (width,), (width // w,)),
        SplitWeight("mlp.c_proj.weight", "row", (width, hidden), (width // w, hidden)),
        SplitWeight("mlp.c_proj.bias", "whole", (hidden,), (hidden,)),
        # four vectors as wide as the hidden size, not one norm four times as wide
        SplitWeight("ln_1, ln_2 (weight, bias each)", "whole", (4, hidden), (4, hidden)),
    ]


def _numel(shape: tuple) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def weight_bytes_per_rank(config, world_size: int, bytes_per_value: int = 4) -> int:
    """The bytes of weights one rank holds, from the plan: its share of every block, and the
    embeddings (tied with the output layer) and the last layer norm whole. (Lesson 11.)"""
    per_block = sum(_numel(w.shard) for w in gpt2_plan(config, world_size))
    whole = (config.vocab_size * config.hidden_size + config.n_positions * config.hidden_size
             + 2 * config.hidden_size)
    if not getattr(config, "tie_word_embeddings", True):
        whole += config.vocab_size * config.hidden_size
    return (config.num_hidden_layers * per_block + whole) * bytes_per_value


def allreduce_bytes_per_step(config, batch: int, new_tokens: int = 1,
                             bytes_per_value: int = 4) -> int:
    """The bytes each rank hands to all-reduces in one forward pass over ``new_tokens`` tokens
    of ``batch`` rows: two per block (after the attention's and the MLP's row split), each of
    one hidden vector per token. (Lesson 11.)"""
    return (2 * config.num_hidden_layers * batch * new_tokens * config.hidden_size
            * bytes_per_value)
