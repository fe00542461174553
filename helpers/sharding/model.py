"""One rank's share of a GPT-2 model, and the forward pass a rank runs. (Lesson 11.)

A rank's model, ``ShardedGPT2``, is GPT-2 written out in plain PyTorch (the classes below, a
page or two), so that every all-reduce is in sight. It holds what the plan gives the rank
(``helpers.sharding.plan``): the embeddings, layer norms and output layer whole, and in each
block

- ``ShardedAttention``: the queries, keys and values of this rank's heads (its share of the
  fused ``c_attn``), attention over those heads only, each with its own KV cache, and its rows
  of the output projection (``RowParallelConv1D``: a partial product, an all-reduce, the bias
  once);
- ``ShardedMLP``: its columns of ``c_fc``, the activation, its rows of ``c_proj``, one
  all-reduce, the bias once.

So a forward pass makes two all-reduces a block, and everything after the last one (the last
layer norm, the output layer) is computed whole on every rank: every rank gets the same
logits and picks the same token. With one rank (no communication) it is the whole model.

The model answers like transformers' (``model(input_ids=..., past_key_values=...,
use_cache=True)`` returns ``.logits`` and ``.past_key_values``), so lesson 01's loop runs on
it. Two ways to make one:

- ``shard_model(model, rank, world_size, comm)`` cuts a rank's share out of a loaded model
  (every rank first holds the whole model);
- ``load_shard(path, rank, world_size, comm)`` reads only the rank's slices from the
  safetensors file, as engines load a model too large for one device: no rank ever holds the
  whole model, and a rank process needs neither transformers nor the whole checkpoint in
  memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .comm import Communicator
from .plan import check_world_size, mlp_width, split_columns, split_qkv, split_rows, vocab_range

__all__ = ["KVCache", "RowParallelConv1D", "ShardedAttention", "ShardedGPT2", "ShardedMLP",
           "embed_vocab_shard", "load_shard", "shard_model", "vocab_shard", "weight_bytes"]


def _weight(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's activation ("gelu_new"): GELU's tanh approximation, written as GPT-2 has it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


_ACTIVATIONS = {"gelu_new": gelu_new, "gelu_pytorch_tanh": gelu_new, "gelu_fast": gelu_new,
                "gelu": F.gelu, "relu": F.relu}


class RowParallelConv1D(nn.Module):
    """The second layer of a Megatron pair: this rank's rows of a ``Conv1D`` weight ``(in /
    world_size, out)``, applied to this rank's share of the inputs; the partial products are
    summed over the ranks by an all-reduce, and the bias is added once, to the sum.
    (Lesson 11.)"""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, comm: Communicator):
        super().__init__()
        self.weight, self.bias, self.comm = _weight(weight), _weight(bias), comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = x @ self.weight              # every output, from this rank's inputs only
        self.comm.all_reduce(partial)          # now the sum over every rank's inputs
        return partial + self.bias

    def extra_repr(self) -> str:
        return f"rows {self.weight.shape[0]} of {self.weight.shape[1]} outputs, all-reduce"


class ShardedMLP(nn.Module):
    """One rank's MLP: its columns of ``c_fc`` (``(hidden, width / world_size)`` and their
    bias), the activation, its rows of ``c_proj`` (``(width / world_size, hidden)``), one
    all-reduce, and ``c_proj``'s whole bias once. (Lesson 11.)"""

    def __init__(self, fc_weight, fc_bias, proj_weight, proj_bias, act, comm: Communicator):
        super().__init__()
        self.fc_weight, self.fc_bias = _weight(fc_weight), _weight(fc_bias)
        self.proj_weight, self.proj_bias = _weight(proj_weight), _weight(proj_bias)
        self.act, self.comm = act, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(x @ self.fc_weight + self.fc_bias)   # this rank's columns: no talking
        partial = h @ self.proj_weight                    # this rank's share of every output
        self.comm.all_reduce(partial)                     # the sum of every rank's share
        return partial + self.proj_bias                   # the bias once, after the sum

    def extra_repr(self) -> str:
        return (f"columns {self.fc_weight.shape[1]} of c_fc, rows {self.proj_weight.shape[0]} "
                f"of c_proj, all-reduce")


class KVCache:
    """The keys and values a rank keeps: per layer, ``(batch, its heads, tokens, head size)``.
    ``.layers[i]`` is ``(keys, values)`` of layer i; ``length`` the tokens held. (Lesson 11.)"""

    def __init__(self):
        self.layers: list = []

    @property
    def length(self) -> int:
        return self.held(0)

    def held(self, index: int) -> int:
        """Tokens layer ``index`` holds."""
        return self.layers[index][0].shape[2] if index < len(self.layers) else 0

    def update(self, index: int, keys: torch.Tensor, values: torch.Tensor):
        """Append a layer's new keys and values; return everything the layer holds now."""
        if index == len(self.layers):
            self.layers.append((keys, values))
        else:
            old_keys, old_values = self.layers[index]
            self.layers[index] = (torch.cat([old_keys, keys], dim=2),
                                  torch.cat([old_values, values], dim=2))
        return self.layers[index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


class ShardedAttention(nn.Module):
    """Causal self-attention over this rank's heads: its share of ``c_attn`` (the queries,
    keys and values of ``heads`` heads, side by side), and its rows of ``c_proj``.
    (Lesson 11.)"""

    def __init__(self, qkv_weight, qkv_bias, proj_weight, proj_bias, heads: int,
                 comm: Communicator):
        super().__init__()
        if qkv_weight.shape[1] % (3 * heads):
            raise ValueError(f"c_attn's share has {qkv_weight.shape[1]} columns, not three "
                             f"parts of {heads} heads each")
        self.heads, self.head_size = heads, qkv_weight.shape[1] // (3 * heads)
        self.qkv_weight, self.qkv_bias = _weight(qkv_weight), _weight(qkv_bias)
        self.c_proj = RowParallelConv1D(proj_weight, proj_bias, comm)

    def forward(self, x: torch.Tensor, cache: KVCache | None, index: int) -> torch.Tensor:
        batch, length, _ = x.shape
        width = self.heads * self.head_size
        q, k, v = (x @ self.qkv_weight + self.qkv_bias).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, self.head_size).transpose(1, 2)
                   for t in (q, k, v))
        past = cache.held(index) if cache is not None else 0
        if cache is not None:
            k, v = cache.update(index, k, v)
        if length == 1:                        # one new token sees everything before it
            mask, causal = None, False
        elif past == 0:                        # a prompt alone: the usual causal mask
            mask, causal = None, True
        else:                                  # new tokens after cached ones
            mask = torch.ones(length, past + length, dtype=torch.bool, device=x.device)
            mask, causal = mask.tril(diagonal=past), False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.c_proj(out.transpose(1, 2).reshape(batch, length, width))


class ShardedBlock(nn.Module):
    """A GPT-2 block on one rank: whole layer norms around its share of attention and MLP."""

    def __init__(self, ln_1: nn.LayerNorm, attn: ShardedAttention, ln_2: nn.LayerNorm,
                 mlp: nn.Module):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp

    def forward(self, x, cache, index):
        x = x + self.attn(self.ln_1(x), cache, index)
        return x + self.mlp(self.ln_2(x))


@dataclass
class Output:
    """What a forward pass returns, named as transformers names it."""

    logits: torch.Tensor
    past_key_values: KVCache | None


class ShardedGPT2(nn.Module):
    """One rank's GPT-2 (see the module's docstring). ``forward(input_ids, past_key_values=None,
    use_cache=True)`` returns ``.logits`` (whole, the same on every rank) and
    ``.past_key_values`` (this rank's ``KVCache``). (Lesson 11.)"""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, blocks: list, ln_f: nn.LayerNorm,
                 rank: int, world_size: int):
        super().__init__()
        self.wte, self.wpe, self.ln_f = wte, wpe, ln_f
        self.h = nn.ModuleList(blocks)
        self.rank, self.world_size = rank, world_size

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def forward(self, input_ids: torch.Tensor, past_key_values: KVCache | None = None,
                use_cache: bool = True) -> Output:
        cache = past_key_values if past_key_values is not None else (
            KVCache() if use_cache else None)
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for index, block in enumerate(self.h):
            x = block(x, cache, index)
        logits = self.ln_f(x) @ self.wte.weight.T   # the output layer shares wte's matrix
        return Output(logits, cache)

    def extra_repr(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def _layer_norm(weight: torch.Tensor, bias: torch.Tensor, eps: float) -> nn.LayerNorm:
    with torch.device("meta"):
        norm = nn.LayerNorm(weight.shape[0], eps=eps)
    norm.weight, norm.bias = _weight(weight), _weight(bias)
    return norm


def _embedding(weight: torch.Tensor) -> nn.Embedding:
    return nn.Embedding.from_pretrained(weight, freeze=True)


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one this sketch of GPT-2 knows: "
                         f"{', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


@torch.no_grad()
def shard_model(model, rank: int, world_size: int, comm: Communicator, *, split_qkv=split_qkv,
                mlp_class=ShardedMLP) -> ShardedGPT2:
    """Rank ``rank``'s share of a loaded GPT-2 ``model`` (transformers') among ``world_size``
    ranks, on the model's device and in its dtype; ``comm`` is the rank's communicator. The
    model itself is not changed. (Lesson 11.)

    ``split_qkv`` (``(weight, bias, num_heads, rank, world_size) -> (weight, bias)``) and
    ``mlp_class`` (built as ``mlp_class(fc_weight, fc_bias, proj_weight, proj_bias, act,
    comm)``) may be replaced by a lesson's own versions. ``ValueError`` when the model is not
    a GPT-2 or when the world size does not divide its heads or its MLP's width.
    """
    config = model.config
    if getattr(config, "model_type", None) != "gpt2":
        raise ValueError(f"the split plan is written for GPT-2 models; this one is "
                         f"{getattr(config, 'model_type', type(model).__name__)!r}")
    check_world_size(config, world_size)
    heads, eps = config.num_attention_heads, config.layer_norm_epsilon
    act = _activation(config.activation_function)
    whole = model.transformer
    blocks = []
    for block in whole.h:
        attn, mlp = block.attn, block.mlp
        qkv_weight, qkv_bias = split_qkv(attn.c_attn.weight, attn.c_attn.bias, heads, rank,
                                         world_size)
        attention = ShardedAttention(qkv_weight, qkv_bias,
                                     split_rows(attn.c_proj.weight, rank, world_size),
                                     attn.c_proj.bias.clone(), heads // world_size, comm)
        fc_weight, fc_bias = split_columns(mlp.c_fc.weight, mlp.c_fc.bias, rank, world_size)
        sharded_mlp = mlp_class(fc_weight, fc_bias, split_rows(mlp.c_proj.weight, rank, world_size),
                                mlp.c_proj.bias.clone(), act, comm)
        blocks.append(ShardedBlock(
            _layer_norm(block.ln_1.weight.clone(), block.ln_1.bias.clone(), eps), attention,
            _layer_norm(block.ln_2.weight.clone(), block.ln_2.bias.clone(), eps), sharded_mlp))
    return ShardedGPT2(_embedding(whole.wte.weight.clone()), _embedding(whole.wpe.weight.clone()),
                       blocks, _layer_norm(whole.ln_f.weight.clone(), whole.ln_f.bias.clone(), eps),
                       rank, world_size).eval()


def weight_bytes(model) -> int:
    """Bytes of the weights a model holds (parameters and buffers, each tensor counted once,
    tied ones too). (Lesson 11.)"""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        key = (tensor.device, tensor.data_ptr())
        if tensor.device.type != "meta" and key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


# --- loading only a rank's slices ------------------------------------------------------------

class _Slices:
    """Reads pieces of the tensors of a safetensors file (its names with or without the
    ``transformer.`` prefix that GPT-2 checkpoints differ on), counting the bytes read."""

    def __init__(self, path: Path, device: str):
        from safetensors import safe_open

        self.file = safe_open(str(path), framework="pt", device=device)
        self.names = set(self.file.keys())
        self.bytes_read = 0

    def __call__(self, name: str, *index) -> torch.Tensor:
        key = name if name in self.names else name.removeprefix("transformer.")
        if key not in self.names:
            raise ValueError(f"the checkpoint has no tensor named {name!r}")
        piece = self.file.get_slice(key)
        tensor = piece[index] if index else piece[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def model_folder(name) -> Path:
    """The local folder of a model: ``name`` itself when it is a folder, else the hub id's
    files already in the local cache (config and safetensors; nothing is downloaded).
    (Lesson 11.)"""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name), allow_patterns=["*.json", "*.safetensors"],
                                      local_files_only=True))
    except Exception as error:
        raise ValueError(f"{name!r} is neither a folder nor a model in the local cache: "
                         f"{error}") from None


def _checkpoint_file(folder: Path) -> Path:
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one .safetensors file in {folder}, found {len(files)}: "
                         f"load_shard reads single-file checkpoints (use shard_model for others)")
    return files[0]


@dataclass(frozen=True)
class _Config:
    """The sizes of a GPT-2 config.json that a rank needs (read without transformers)."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    n_inner: int | None
    layer_norm_epsilon: float
    activation_function: str
    tie_word_embeddings: bool
    vocab_size: int
    n_positions: int


def _read_config(folder: Path) -> _Config:
    data = json.loads((folder / "config.json").read_text())
    return _Config(data.get("model_type", "?"), data.get("n_embd"), data.get("n_head"),
                   data.get("n_layer"), data.get("n_inner"), data.get("layer_norm_epsilon", 1e-5),
                   data.get("activation_function", "gelu_new"),
                   data.get("tie_word_embeddings", True), data.get("vocab_size", 50257),
                   data.get("n_positions", 1024))


@torch.no_grad()
def load_shard(path, rank: int, world_size: int, comm: Communicator, device="cpu",
               dtype: torch.dtype | None = None) -> tuple[ShardedGPT2, int]:
    """Rank ``rank``'s share of the GPT-2 model saved in the folder ``path`` (its
    ``config.json`` and one ``.safetensors`` file; or a hub id already in the local cache),
    read slice by slice: only this rank's
    columns and rows of the split layers, and the layers every rank keeps whole. Returns
    ``(model, bytes_read)``; the model equals ``shard_model`` of the whole model.
    (Lesson 11.)"""
    folder = model_folder(path)
    config = _read_config(folder)
    if config.model_type != "gpt2":
        raise ValueError(f"the split plan is written for GPT-2 models; {folder} holds a "
                         f"{config.model_type!r} model")
    if not config.tie_word_embeddings:
        raise ValueError("this sketch of GPT-2 expects the output layer tied to the embeddings")
    check_world_size(config, world_size)
    read = _Slices(_checkpoint_file(folder), device=str(device))
    eps, act = config.layer_norm_epsilon, _activation(config.activation_function)
    hidden, width = config.hidden_size, mlp_width(config)
    part, share = hidden // world_size, width // world_size
    mine = slice(rank * part, (rank + 1) * part)             # of each of q, k, v; of c_proj's rows
    mine_mlp = slice(rank * share, (rank + 1) * share)       # of c_fc's columns, c_proj's rows
    everything = slice(None)

    def norm(name):
        return _layer_norm(read(name + ".weight"), read(name + ".bias"), eps)

    blocks = []
    for i in range(config.num_hidden_layers):
        p = f"transformer.h.{i}."
        qkv = [slice(start + mine.start, start + mine.stop) for start in (0, hidden, 2 * hidden)]
        attention = ShardedAttention(
            torch.cat([read(p + "attn.c_attn.weight", everything, c) for c in qkv], dim=1),
            torch.cat([read(p + "attn.c_attn.bias", c) for c in qkv]),
            read(p + "attn.c_proj.weight", mine), read(p + "attn.c_proj.bias"),
            config.num_attention_heads // world_size, comm)
        mlp = ShardedMLP(read(p + "mlp.c_fc.weight", everything, mine_mlp),
                         read(p + "mlp.c_fc.bias", mine_mlp),
                         read(p + "mlp.c_proj.weight", mine_mlp), read(p + "mlp.c_proj.bias"),
                         act, comm)
        blocks.append(ShardedBlock(norm(p + "ln_1"), attention, norm(p + "ln_2"), mlp))
    model = ShardedGPT2(_embedding(read("transformer.wte.weight")),
                        _embedding(read("transformer.wpe.weight")), blocks,
                        norm("transformer.ln_f"), rank, world_size).eval()
    if dtype is not None:
        model.to(dtype)
    return model, read.bytes_read


# --- a vocabulary split (lesson 11's third exercise) ------------------------------------------

def vocab_shard(weight: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """Rank ``rank``'s rows of an embedding ``weight`` ``(vocab, hidden)``, a copy, and the
    first token id they hold (``plan.vocab_range``). (Lesson 11.)"""
    start, stop = vocab_range(weight.shape[0], rank, world_size)
    return weight[start:stop].clone(), start


def embed_vocab_shard(ids: torch.Tensor, weight_shard: torch.Tensor, start: int,
                      comm: Communicator) -> torch.Tensor:
    """The embeddings of ``ids`` when the vocabulary is split: this rank holds the rows of the
    token ids ``start`` to ``start + len(weight_shard) - 1``. Each rank looks up the ids it
    holds and writes zeros for the others, and an all-reduce adds the ranks' pieces: every id
    gets its row from exactly one rank. (Lesson 11.)"""
    mine = (ids >= start) & (ids < start + weight_shard.shape[0])
    local = torch.where(mine, ids - start, torch.zeros_like(ids))   # a valid row; zeroed below
    rows = weight_shard[local] * mine.unsqueeze(-1).to(weight_shard.dtype)
    comm.all_reduce(rows)
    return rows
