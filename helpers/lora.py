"""LoRA: low-rank adapters, from one matrix product to a batch where every row has its own.

Lesson 05 builds LoRA from the shapes up on a toy model, then trains real adapters with peft.
Lesson 06 serves many adapters in one batch: first on the toy model (a loop over rows versus
one gathered batched matrix product), then on the bundled model with the shipped adapters.
The server of lesson 07 runs on ``MultiLora``.

The idea in one line: a frozen layer ``W`` (in × out) gets a trainable detour
``x @ A @ B * scale`` with ``A`` (in × r) and ``B`` (r × out) for a small rank r, so an
adapter costs r × (in + out) numbers instead of in × out.

Conventions used throughout this module (they match the maths, not ``nn.Linear``):

* ``A`` has shape (in_features, rank) and ``B`` has shape (rank, out_features), so the
  adapter's output is ``x @ A @ B``. peft stores ``lora_A.weight`` as (rank, in) and
  ``lora_B.weight`` as (out, rank), the ``nn.Linear`` way; loading transposes them.
* A stack of adapters puts them along a first dimension: ``loras_a`` (n, in, rank) and
  ``loras_b`` (n, rank, out).
* A row's adapter index is its position in that stack; -1 means "no adapter" (the base model).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from .models import Needs

#: Where the shipped adapters live: one folder per adapter, as written by peft's save_pretrained.
ADAPTERS_DIR = Path(__file__).resolve().parent / "assets" / "adapters"
#: The name (besides ``None`` and -1) that means "this row uses no adapter", as in peft.
NO_ADAPTER = "__base__"
#: The toy model's whole vocabulary: ten colour words, token id = position in this list.
TOY_COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "pink",
               "brown"]


# --- lesson 05: one adapter on one layer -------------------------------------------------

def _in_out_features(layer: nn.Module, embedding: bool = False) -> tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or of GPT-2's ``Conv1D`` (and, with
    ``embedding=True``, of an ``nn.Embedding``: vocabulary size, embedding size)."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, Conv1D):  # GPT-2 stores its weight as (in, out), not (out, in)
        return layer.weight.shape[0], layer.weight.shape[1]
    if embedding and isinstance(layer, nn.Embedding):
        return layer.num_embeddings, layer.embedding_dim
    kinds = "nn.Linear, transformers' Conv1D" + (" or nn.Embedding" if embedding else "")
    raise ValueError(f"LoRA layers here wrap {kinds}, not {type(layer).__name__}")


class LoraLayer(nn.Module):
    """A frozen layer plus a low-rank detour: ``base(x) + (x @ A @ B) * scale``. (Lesson 05
    writes this class in a cell and checks it against this one.)

    base:   the ``nn.Linear`` (or GPT-2 ``Conv1D``) to adapt; its weights are not changed.
    rank:   r, the inner size of the detour. ``A`` is (in × r), ``B`` is (r × out).
    alpha:  scale = alpha / rank, as in peft's ``lora_alpha``; None means scale 1.
    zero_b: start ``B`` at zero (the LoRA paper and peft do this, so a fresh adapter changes
            nothing until it is trained). ``False`` draws ``B`` at random too, which is handy
            to see an untrained adapter change the output.
    seed:   seeds the random ``A`` (and ``B``); None uses torch's global generator.
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None,
                 zero_b: bool = True, seed: int | None = None):
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        in_features, out_features = _in_out_features(base)
        self.base = base
        self.rank = rank
        self.scale = 1.0 if alpha is None else alpha / rank
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        a = torch.randn(in_features, rank, generator=generator) / in_features ** 0.5
        b = (torch.zeros(rank, out_features) if zero_b
             else torch.randn(rank, out_features, generator=generator) / rank ** 0.5)
        weight = base.weight
        self.A = nn.Parameter(a.to(weight.device, weight.dtype))
        self.B = nn.Parameter(b.to(weight.device, weight.dtype))
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A @ self.B) * self.scale


class ToyModel(nn.Module):
    """The toy language model of lessons 05 and 06: embedding → linear → lm_head. (Lesson 05.)

    Its vocabulary is ``TOY_COLOURS`` (ten colour words), the hidden size 1024. The weights are
    random (seeded): the model is there to show shapes and costs, not to say anything sensible.
    ``forward(input_ids)`` returns logits of shape (batch, seq, 10).
    """

    def __init__(self, hidden: int = 1024, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # seeded, without moving the global generator
            torch.manual_seed(seed)
            self.embedding = nn.Embedding(len(TOY_COLOURS), hidden)
            self.linear = nn.Linear(hidden, hidden)
            self.lm_head = nn.Linear(hidden, len(TOY_COLOURS))
        self.eval()

    def encode(self, words: list[str] | str) -> torch.Tensor:
        """Token ids of colour words, shape (1, len(words)): ``"red blue"`` -> [[0, 1]]."""
        words = words.split() if isinstance(words, str) else list(words)
        unknown = [w for w in words if w not in TOY_COLOURS]
        if unknown:
            raise ValueError(f"the toy vocabulary is {TOY_COLOURS}; unknown words: {unknown}")
        return torch.tensor([[TOY_COLOURS.index(w) for w in words]])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)
        x = self.linear(x)
        return self.lm_head(x)

    def next_colour(self, input_ids: torch.Tensor) -> list[str]:
        """The most likely next colour after each row of ``input_ids`` (greedy)."""
        with torch.no_grad():
            ids = self(input_ids)[:, -1].argmax(dim=-1)
        return [TOY_COLOURS[int(i)] for i in ids]


# --- lesson 05: an adapter trained with peft, as one call -----------------------------------

def train_lora_adapter(model: nn.Module, tokenizer, examples, *, rank: int, lora_alpha: float,
                       target_modules, steps: int, batch: int, lr: float, seed: int = 0):
    """Lesson 05's training run in one call, for tests and scripts (the lesson writes the loop
    out): LoRA by peft on ``model`` (its layers are wrapped in place), trained on ``examples``,
    (prompt, answer) pairs, ``steps`` batches of ``batch`` in their order, with AdamW at ``lr``.
    Each row is prompt + " " + answer + end-of-text, right-padded; the loss counts only the
    answer and its end-of-text (the prompt's labels are -100). Dropout stays off (eval mode).
    ``torch.manual_seed(seed)`` comes first, so peft draws the same ``A`` on every run.
    ``target_modules`` is used on a GPT-2-style model (``Conv1D`` layers); other models get
    ``"all-linear"``, as in the lesson. Returns (peft model, loss of every step). (Lesson 05.)"""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    from .quiet import quiet_stderr

    for name, value in (("rank", rank), ("steps", steps), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    examples = list(examples)
    if len(examples) < steps * batch:
        raise ValueError(f"{steps} steps of {batch} need {steps * batch} examples, "
                         f"got {len(examples)}")
    gpt2_style = any(isinstance(m, Conv1D) for m in model.modules())
    config = LoraConfig(r=rank, lora_alpha=lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=list(target_modules) if gpt2_style else "all-linear",
                        fan_in_fan_out=gpt2_style)
    torch.manual_seed(seed)
    with quiet_stderr():
        peft_model = get_peft_model(model, config)
    device, eos = model.device, tokenizer.eos_token_id
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    peft_model.eval()                       # dropout off; gradients still flow
    losses = []
    for step in range(steps):
        rows = []
        for prompt, answer in examples[step * batch:(step + 1) * batch]:
            prompt_ids = tokenizer(prompt).input_ids
            target = tokenizer(" " + answer).input_ids + [eos]
            rows.append((prompt_ids + target, [-100] * len(prompt_ids) + target))
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), eos, device=device)
        labels = torch.full((len(rows), width), -100, device=device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for i, (ids, labs) in enumerate(rows):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(labs)] = torch.tensor(labs)
            mask[i, :len(ids)] = 1
        logits = peft_model(input_ids=input_ids, attention_mask=mask).logits
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                           ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return peft_model, losses


def count_right_answers(model: nn.Module, tokenizer, examples, max_new_tokens: int = 24) -> int:
    """How many of ``examples``, (prompt, answer) pairs, ``model`` answers exactly: greedy, one
    prompt at a time, the text after the prompt up to end-of-text, stripped. (Lesson 05.)"""
    examples = list(examples)
    if not examples:
        raise ValueError("examples is empty: nothing to score")
    right = 0
    for prompt, expected in examples:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        got = tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
        right += got.strip() == expected
    return right


# --- lesson 06: many adapters, one batch (the toy model) -----------------------------------

def random_adapters(n: int, hidden: int = 1024, rank: int = 2, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random adapters as stacks: ``loras_a`` (n, hidden, rank), ``loras_b``
    (n, rank, hidden). (Lesson 06.)"""
    if n < 1 or rank < 1 or hidden < 1:
        raise ValueError(f"n, hidden and rank must be positive, got n={n}, hidden={hidden}, "
                         f"rank={rank}")
    generator = torch.Generator().manual_seed(seed)
    loras_a = torch.randn(n, hidden, rank, generator=generator, dtype=dtype) / hidden ** 0.5
    loras_b = torch.randn(n, rank, hidden, generator=generator, dtype=dtype) / rank ** 0.5
    return loras_a, loras_b


def _check_linear_lora(x, loras_a, loras_b, lora_indices) -> None:
    """The shape and index checks both ``linear_lora`` versions share."""
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, seq, hidden), got shape {tuple(x.shape)}")
    if loras_a.dim() != 3 or loras_b.dim() != 3:
        raise ValueError(f"loras_a must be (n, in, rank) and loras_b (n, rank, out), got "
                         f"{tuple(loras_a.shape)} and {tuple(loras_b.shape)}")
    n, in_features, rank = loras_a.shape
    if loras_b.shape[0] != n:
        raise ValueError(f"loras_a holds {n} adapters but loras_b holds {loras_b.shape[0]}")
    if loras_b.shape[1] != rank:
        raise ValueError(f"rank mismatch: loras_a has rank {rank}, loras_b has rank "
                         f"{loras_b.shape[1]}")
    if x.shape[-1] != in_features:
        raise ValueError(f"shape mismatch: x has {x.shape[-1]} features, the adapters expect "
                         f"{in_features}")
    if lora_indices.dim() != 1 or len(lora_indices) != x.shape[0]:
        raise ValueError(f"lora_indices must hold one index per row of x ({x.shape[0]}), got "
                         f"shape {tuple(lora_indices.shape)}")
    if len(lora_indices) and (int(lora_indices.min()) < 0 or int(lora_indices.max()) >= n):
        bad = [int(i) for i in lora_indices if not 0 <= int(i) < n]
        raise ValueError(f"adapter index out of range: {bad[0]} (there are {n} adapters, "
                         f"indices 0..{n - 1})")


def linear_lora_loop(x: torch.Tensor, loras_a: torch.Tensor, loras_b: torch.Tensor,
                     lora_indices: torch.Tensor) -> torch.Tensor:
    """Each row's adapter output, one row at a time: ``x[i] @ A[k] @ B[k]`` with
    ``k = lora_indices[i]``. (Lesson 06.)

    x: (batch, seq, in); loras_a: (n, in, rank); loras_b: (n, rank, out);
    lora_indices: (batch,) integers in 0..n-1. Returns (batch, seq, out).
    """
    _check_linear_lora(x, loras_a, loras_b, lora_indices)
    rows = []
    for i, k in enumerate(lora_indices.tolist()):
        rows.append(x[i] @ loras_a[k] @ loras_b[k])
    return torch.stack(rows)


def linear_lora_gathered(x: torch.Tensor, loras_a: torch.Tensor, loras_b: torch.Tensor,
                         lora_indices: torch.Tensor) -> torch.Tensor:
    """The same as ``linear_lora_loop`` for the whole batch at once. (Lesson 06.)

    Gather every row's A and B with ``index_select`` into (batch, in, rank) and
    (batch, rank, out), then two batched matrix products (``torch.bmm``) do all rows together.
    """
    _check_linear_lora(x, loras_a, loras_b, lora_indices)
    a = loras_a.index_select(0, lora_indices)  # (batch, in, rank)
    b = loras_b.index_select(0, lora_indices)  # (batch, rank, out)
    return torch.bmm(torch.bmm(x, a), b)


class ToyMultiLoraModel(ToyModel):
    """The toy model with a stack of adapters on its linear layer and one adapter per row.
    (Lesson 06.)

    ``linear_lora`` is the function that computes the adapters' part: ``linear_lora_loop`` or
    ``linear_lora_gathered`` (or your own with the same arguments).
    ``forward(input_ids, loras_a, loras_b, lora_indices)`` returns logits (batch, seq, 10).
    """

    def __init__(self, linear_lora=linear_lora_gathered, hidden: int = 1024, seed: int = 0):
        super().__init__(hidden=hidden, seed=seed)
        self.linear_lora = linear_lora

    def forward(self, input_ids, loras_a=None, loras_b=None, lora_indices=None):
        x = self.embedding(input_ids)
        y = self.linear(x)
        if loras_a is not None:
            y = y + self.linear_lora(x, loras_a, loras_b, lora_indices)
        return self.lm_head(y)


# --- lesson 06/07: the real model, one adapter per row ------------------------------------

class MultiLoraLayer(nn.Module):
    """A projection layer of a real model with a stack of adapters and one adapter per row.
    (Lesson 06; the server of lesson 07 runs on it.)

    Wraps an ``nn.Linear`` (Llama-style models), GPT-2's ``Conv1D`` (weight stored as
    (in, out)) or an ``nn.Embedding``. An embedding is a linear layer applied to one-hot
    vectors, so its A has one row per token (vocabulary × r) and "x @ A" is just a lookup of
    the token's row. Entry 0 of the stack is all zeros and stands for "no adapter"; adapter
    ``k`` is entry ``k + 1``, so a row's *stack index* is its adapter index plus one. Adapters
    of different ranks share the stack: each is padded with zeros to the largest rank, which
    adds exactly nothing to the output. Each adapter's ``scale`` (lora_alpha / r) is
    multiplied into its B when it is added.

    ``set_stack_indices(indices)`` (called by ``MultiLora.set_rows``) takes a (batch,) tensor
    of stack indices, one per row, and gathers each row's A and B right away with
    ``index_select``: copies of shape (batch, in, rank) and (batch, rank, out). A forward pass
    is then two batched matrix products (``torch.bmm``) on top of the base layer, and the
    copies serve every step until the rows change (gathering on every step would copy the same
    weights again and again: on a CPU that copy costs more than the products). A row's stack
    index applies to every position of that row, so prefill (batch, seq, in) and decode
    (batch, 1, in) both work. With indices None the layer is just its base layer.
    """

    def __init__(self, base: nn.Module, n_adapters: int = 0):
        super().__init__()
        self.in_features, self.out_features = _in_out_features(base, embedding=True)
        self.is_embedding = isinstance(base, nn.Embedding)
        self.base = base
        weight = base.weight
        # Buffers (not parameters): they move with .to(device) but are not trained, and
        # persistent=False keeps them out of the model's state_dict.
        zeros_a = torch.zeros(1 + n_adapters, self.in_features, 0, dtype=weight.dtype,
                              device=weight.device)
        zeros_b = torch.zeros(1 + n_adapters, 0, self.out_features, dtype=weight.dtype,
                              device=weight.device)
        self.register_buffer("lora_a", zeros_a, persistent=False)
        self.register_buffer("lora_b", zeros_b, persistent=False)
        self.stack_indices: torch.Tensor | None = None  # (batch,): each row's entry in the stack
        self.row_a: torch.Tensor | None = None  # (batch, in, rank): each row's A
        self.row_b: torch.Tensor | None = None  # (batch, rank, out): each row's B (× scale)

    @property
    def rank(self) -> int:
        """The stack's rank (the largest rank of its adapters; 0 while it has none)."""
        return self.lora_a.shape[2]

    def add_adapter(self, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> int:
        """Append an adapter: ``a`` (in × r), ``b`` (r × out). Returns its stack index.

        A layer that an adapter does not touch gets ``a`` and ``b`` of rank 0 (a zero entry).
        """
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"rank mismatch: A {tuple(a.shape)} and B {tuple(b.shape)} must "
                             f"be (in × r) and (r × out) with the same r")
        if a.shape[0] != self.in_features or b.shape[1] != self.out_features:
            raise ValueError(f"shape mismatch: this layer maps {self.in_features} -> "
                             f"{self.out_features} features, the adapter "
                             f"{a.shape[0]} -> {b.shape[1]}")
        rank = max(self.rank, a.shape[1])
        like = dict(dtype=self.lora_a.dtype, device=self.lora_a.device)
        new_a = torch.zeros(1, self.in_features, rank, **like)
        new_b = torch.zeros(1, rank, self.out_features, **like)
        new_a[0, :, :a.shape[1]] = a
        new_b[0, :b.shape[0], :] = b * scale
        pad = rank - self.rank  # widen the adapters already here with zeros
        old_a = nn.functional.pad(self.lora_a, (0, pad))
        old_b = nn.functional.pad(self.lora_b, (0, 0, 0, pad))
        self.lora_a = torch.cat([old_a, new_a])
        self.lora_b = torch.cat([old_b, new_b])
        self.set_stack_indices(None)
        return self.lora_a.shape[0] - 1

    def set_stack_indices(self, indices: torch.Tensor | None) -> None:
        """Each row's stack index for the following forward passes (None: no adapters at all)."""
        self.stack_indices = indices
        if indices is None or self.rank == 0:
            self.row_a = self.row_b = None
        else:  # (an embedding looks its rows up in forward instead of copying its whole A)
            self.row_a = None if self.is_embedding else self.lora_a.index_select(0, indices)
            self.row_b = self.lora_b.index_select(0, indices)  # (batch, rank, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.row_b is None:
            return out
        batch = x.shape[0]
        if batch != len(self.stack_indices):
            raise ValueError(f"the batch has {batch} rows but set_rows named "
                             f"{len(self.stack_indices)}")
        if self.row_b.device != self.lora_b.device or self.row_b.dtype != self.lora_b.dtype:
            # the model moved: gather again
            self.set_stack_indices(self.stack_indices.to(self.lora_b.device))
        if self.is_embedding:  # row i, token t: row t of the A of row i's adapter
            rows = self.stack_indices.view(-1, 1)
            h = self.lora_a[rows, x.reshape(batch, -1)]  # (batch, seq, rank)
        else:
            h = torch.bmm(x.reshape(batch, -1, self.in_features), self.row_a)  # (batch, seq, rank)
        # baddbmm_ adds h @ B to the base output in place, viewed as (batch, seq, out).
        out.view(batch, -1, self.out_features).baddbmm_(h, self.row_b)
        return out

    def __getattr__(self, name: str):
        """What the wrapper lacks comes from the base layer (``num_embeddings`` of a wrapped
        embedding, ``weight`` of a wrapped linear layer), so code that reads those still
        works on a wrapped model."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base":
                raise
            return getattr(self.base, name)

    def extra_repr(self) -> str:
        return f"adapters={self.lora_a.shape[0] - 1}, rank={self.rank}"


def _pattern_value(pattern: dict | None, module: str, default):
    """peft's per-module overrides (rank_pattern, alpha_pattern): the value of the first key
    that matches the end of the module's path, else ``default``."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_adapter(folder: Path, name: str) -> dict[str, tuple]:
    """The weights of a peft LoRA adapter folder: module path -> (A, B, scale), with A as
    (in × r) and B as (r × out); its adapter_config.json is checked and gives the scales.
    Reads safetensors only (never pickle)."""
    from safetensors.torch import load_file

    config_file = folder / "adapter_config.json"
    weights_file = folder / "adapter_model.safetensors"
    if not folder.is_dir():
        raise ValueError(f"adapter {name!r}: {folder} is not a folder")
    if not weights_file.is_file():
        hint = (" (only adapter_model.bin is there: re-save it with "
                "save_pretrained(..., safe_serialization=True); pickles are never loaded)"
                if (folder / "adapter_model.bin").exists() else "")
        raise ValueError(f"adapter {name!r}: {folder} has no adapter_model.safetensors{hint}")
    if not config_file.is_file():
        raise ValueError(f"adapter {name!r}: {folder} has no adapter_config.json")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r} is a {config['peft_type']} adapter, not LoRA")
    unsupported = {"use_dora": config.get("use_dora"), "bias": config.get("bias") not in (None, "none"),
                   "modules_to_save": config.get("modules_to_save"),
                   "lora_bias": config.get("lora_bias")}
    used = [key for key, value in unsupported.items() if value]
    if used:
        raise ValueError(f"adapter {name!r} uses {used}, which MultiLora does not support "
                         f"(plain LoRA on Linear, Conv1D and Embedding layers only)")
    tensors = load_file(str(weights_file))
    # peft's names: "<module>.lora_A.weight" (r, in) and "<module>.lora_B.weight" (out, r) for
    # linear layers, "<module>.lora_embedding_A" (r, vocab) and "..._B" (dim, r) for embeddings.
    parts = {"lora_A.weight": "A", "lora_B.weight": "B", "lora_embedding_A": "A",
             "lora_embedding_B": "B"}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, part = key.removeprefix("base_model.model.").partition(".lora_")
        if "lora_" + part not in parts:
            raise ValueError(f"adapter {name!r}: unexpected tensor {key!r} in "
                             f"{weights_file.name} (only LoRA's A and B can be loaded per row; "
                             f"save with save_embedding_layers=False)")
        pairs.setdefault(module, {})[parts["lora_" + part]] = value
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: module {module!r} lacks lora_A or lora_B")
        a, b = pair["A"].T, pair["B"].T  # (in × r) and (r × out)
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"adapter {name!r}: rank mismatch in {module!r}: lora_A has rank "
                             f"{a.shape[1]}, lora_B rank {b.shape[0]}")
        rank = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if a.shape[1] != rank:
            raise ValueError(f"adapter {name!r}: rank mismatch in {module!r}: the weights have "
                             f"rank {a.shape[1]}, adapter_config.json says r={rank}")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
        weights[module] = (a, b, scale)
    return weights


def _mismatch(model: nn.Module, name: str, weights: dict[str, tuple]) -> str | None:
    """Why the adapter ``name`` (its weights as read by ``_read_adapter``) cannot go into
    ``model``, or None when every adapted layer exists with the adapter's shapes."""
    modules = dict(model.named_modules())
    for path, (a, b, _) in weights.items():
        base = modules.get(path)
        if base is None:
            return f"adapter {name!r} adapts {path!r}, which this model lacks"
        if isinstance(base, MultiLoraLayer):
            base = base.base
        in_features, out_features = _in_out_features(base, embedding=True)
        if (a.shape[0], b.shape[1]) != (in_features, out_features):
            return (f"adapter {name!r}: shape mismatch in {path!r}: the layer maps "
                    f"{in_features} -> {out_features}, the adapter {a.shape[0]} -> {b.shape[1]}")
    return None


def adapter_mismatch(model: nn.Module, adapter: str | os.PathLike) -> str | None:
    """Why ``adapter`` (a shipped adapter's name or a peft folder) does not fit ``model``, in one
    sentence, or None when it fits. The shipped adapters were trained for the bundled model;
    lessons 05-07 call this to say what changes when ``$COURSE_MODEL`` names another model.
    (Lesson 05.)"""
    name, folder = _adapter_folder(adapter)
    return _mismatch(model, name, _read_adapter(folder, name))


def _adapter_folder(item: str | os.PathLike) -> tuple[str, Path]:
    """(name, folder) for a shipped adapter's name or for a folder path."""
    path = Path(item)
    if path.is_dir():
        return path.name, path
    if isinstance(item, str) and (ADAPTERS_DIR / item).is_dir():
        return item, ADAPTERS_DIR / item
    raise ValueError(f"unknown adapter {str(item)!r}: neither a folder nor a shipped adapter "
                     f"(shipped: {shipped_adapters()})")


def shipped_adapters() -> list[str]:
    """Names of the adapters that ship with the course (folders in ``ADAPTERS_DIR``).
    (Lesson 05.)"""
    if not ADAPTERS_DIR.is_dir():
        return []
    return sorted(p.name for p in ADAPTERS_DIR.iterdir()
                  if (p / "adapter_model.safetensors").is_file())


def shipped_adapters_fit(model: nn.Module) -> Needs:
    """Whether the shipped adapters fit ``model``: they were trained for the bundled model, and
    another one ($COURSE_MODEL) has other layer sizes or names. ``needs.missing("Section 6")``
    then says so and skips. (Lessons 05-07.)"""
    names = shipped_adapters()
    if not names:
        return Needs("the shipped adapters", f"are not in {ADAPTERS_DIR}")
    problem = next(filter(None, (adapter_mismatch(model, name) for name in names)), None)
    return Needs("the shipped adapters",
                 None if problem is None else f"do not fit this model ({problem.rstrip('.')})")


def save_random_adapters(model: nn.Module, n: int, rank: int = 8, seed: int = 0,
                         folder: str | os.PathLike | None = None) -> dict[str, Path]:
    """``n`` random LoRA adapters on every linear layer of ``model``, saved as peft saves trained
    ones (``adapter_config.json`` and ``adapter_model.safetensors``) in ``folder`` (a new
    temporary folder by default); returns {name: folder}. They stand in for the shipped adapters
    when those do not fit the model: what they write is noise. (Lesson 06.)"""
    import copy
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    from .quiet import quiet_stderr

    if n < 1 or rank < 1:
        raise ValueError(f"n and rank must be positive, got n={n}, rank={rank}")
    conv1d = any(isinstance(m, Conv1D) for m in model.modules())   # GPT-2's weights: (in, out)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                        fan_in_fan_out=conv1d, init_lora_weights=False)
    with quiet_stderr():
        maker = get_peft_model(copy.deepcopy(model), config)   # peft wraps the copy's layers
    root = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="random-adapters-"))
    generator = torch.Generator().manual_seed(seed)
    folders = {}
    for i in range(n):
        with torch.no_grad():        # fresh A (r, in) and B (out, r); B small: a nudge
            for key, weight in maker.named_parameters():
                if "lora_A" in key or "lora_B" in key:
                    std = (1.0 if "lora_A" in key else 0.1) / weight.shape[1] ** 0.5
                    weight.copy_(torch.randn(weight.shape, generator=generator) * std)
        folders[f"random{i}"] = root / f"random{i}"
        maker.save_pretrained(folders[f"random{i}"])
    return folders


def adapter_folders(model: nn.Module) -> tuple[dict[str, Path], Needs]:
    """The adapters to serve on ``model``: {name: folder} of the shipped ones when they fit,
    else as many random ones of the right shapes (``save_random_adapters``), with the ``Needs``
    that says which. (Lesson 06.)"""
    needs = shipped_adapters_fit(model)
    if needs.ok:
        return {name: ADAPTERS_DIR / name for name in shipped_adapters()}, needs
    return save_random_adapters(model, n=max(1, len(shipped_adapters()))), needs


class MultiLora:
    """LoRA adapters installed in a model, and the adapter each row of the batch uses.
    (Lesson 06; the server of lesson 07 runs on it.)

    Usually made by ``load_adapters(model, [...])``. Then, before each forward (or
    ``generate``), name one adapter per row; ``None`` or ``"__base__"`` means no adapter::

        lora = load_adapters(model, ["entities", "rhymes"])
        lora.set_rows(["entities", None, "rhymes"])     # a batch of three rows
        logits = model(input_ids, attention_mask=mask).logits

        with lora.rows(["rhymes", "rhymes"]):           # or for one block of code
            out = model.generate(**inputs, max_new_tokens=30)

    Rows may change from one step to the next (continuous batching): call ``set_rows`` again
    with the new batch's rows. The choice holds for every token of a row, for the prompt
    (prefill) and for each decoding step. ``set_rows(None)`` turns all adapters off.
    Indices work too: 0 is the first loaded adapter, -1 no adapter.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.names: list[str] = []
        self.layers: dict[str, MultiLoraLayer] = {}
        self._stack_indices: torch.Tensor | None = None
        self._rows: list | None = None

    def add(self, name: str, folder: str | os.PathLike) -> None:
        """Load the peft adapter saved in ``folder`` (``save_pretrained``, safetensors) as
        ``name`` and add it to every layer it adapts, wrapping layers as needed."""
        if not isinstance(name, str) or not name or name == NO_ADAPTER:
            raise ValueError(f"adapter name must be a non-empty string other than "
                             f"{NO_ADAPTER!r}, got {name!r}")
        if name in self.names:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        weights = _read_adapter(Path(folder), name)
        modules = dict(self.model.named_modules())
        for path in weights:  # check everything before changing anything
            self._check_not_taken(path, modules.get(path))
        problem = _mismatch(self.model, name, weights)
        if problem:
            raise ValueError(problem)
        for path in weights:
            if path not in self.layers:
                self._wrap(path, modules[path])
        for path, layer in self.layers.items():
            if path in weights:
                a, b, scale = weights[path]
                layer.add_adapter(a, b, scale=scale)
            else:  # an adapter that leaves this layer alone: a zero entry keeps stacks aligned
                layer.add_adapter(torch.zeros(layer.in_features, 0),
                                  torch.zeros(0, layer.out_features))
        self.names.append(name)
        self.set_rows(None)

    def wrap_all(self) -> list[str]:
        """Wrap every layer an adapter could adapt (each ``nn.Linear``, GPT-2 ``Conv1D`` and
        ``nn.Embedding``) now, before any adapter is loaded, and return their paths. Adapters
        loaded later then only fill the stacks: the model's modules stay the same objects.
        A compiled model needs this (lesson 10): torch guards on each module's type, so a
        layer wrapped after compiling would send every step back to the compiler. With no
        row using an adapter, a wrapped layer is just its base layer."""
        from transformers.pytorch_utils import Conv1D

        wrappers = []
        for path, module in list(self.model.named_modules()):
            if not path or any(path.startswith(w + ".") for w in wrappers):
                continue                                 # the base layer inside a wrapper
            if isinstance(module, MultiLoraLayer):
                wrappers.append(path)
            if path not in self.layers and isinstance(module, (nn.Linear, Conv1D, nn.Embedding,
                                                               MultiLoraLayer)):
                self._check_not_taken(path, module)
                self._wrap(path, module)
        self.set_rows(None)
        return list(self.layers)

    def _check_not_taken(self, path: str, module) -> None:
        """ValueError when the layer at ``path`` carries another MultiLora's adapters (a
        wrapper that holds none may be shared: it changes nothing)."""
        if (isinstance(module, MultiLoraLayer) and path not in self.layers
                and module.lora_a.shape[0] > 1):
            raise ValueError(f"{path!r} already carries adapters from another MultiLora; "
                             f"call its remove() first")

    def _wrap(self, path: str, base: nn.Module) -> None:
        """Wrap the layer at ``path`` (or take over a wrapper that holds no adapter yet), with
        a zero entry for each adapter loaded so far."""
        if isinstance(base, MultiLoraLayer):
            layer = base
            for _ in self.names:
                layer.add_adapter(torch.zeros(layer.in_features, 0),
                                  torch.zeros(0, layer.out_features))
        else:
            layer = MultiLoraLayer(base, n_adapters=len(self.names))
            parent_path, _, attr = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            setattr(parent, attr, layer)
        self.layers[path] = layer

    def stack_indices_for(self, rows) -> torch.Tensor:
        """Each row's stack index (adapter index + 1, 0 for none) for ``rows`` (adapter names,
        None/"__base__", or adapter indices), as a tensor on the adapters' device."""
        indices = []
        for row in rows:
            if row is None or row == NO_ADAPTER:
                indices.append(0)
            elif isinstance(row, str):
                if row not in self.names:
                    raise ValueError(f"unknown adapter name {row!r}; loaded adapters: "
                                     f"{self.names} (or None / {NO_ADAPTER!r} for none)")
                indices.append(self.names.index(row) + 1)
            elif isinstance(row, int) and not isinstance(row, bool):
                if not -1 <= row < len(self.names):
                    raise ValueError(f"adapter index {row} is out of range: {len(self.names)} "
                                     f"adapters are loaded (0..{len(self.names) - 1}, or -1 "
                                     f"for none)")
                indices.append(row + 1)
            else:
                raise ValueError(f"a row's adapter must be a name, None or an int, got {row!r}")
        device = next(iter(self.layers.values())).lora_a.device if self.layers else "cpu"
        return torch.tensor(indices, dtype=torch.long, device=device)

    def set_rows(self, rows) -> None:
        """Choose each row's adapter for the following forward passes: a list with one entry
        per row of the batch (an adapter name, None or "__base__" for none, or an index; -1 is
        none). ``None`` instead of a list turns every adapter off.

        Call it again whenever the batch changes (rows join, finish or are reordered); calling
        it with the same rows as before costs almost nothing."""
        indices = None if rows is None else self.stack_indices_for(list(rows))
        if indices is not None and bool((indices == 0).all()):
            indices = None  # no row uses an adapter: skip the adapter work entirely
        self._rows = None if rows is None else list(rows)
        old = self._stack_indices
        unchanged = (indices is None and old is None) or (
            indices is not None and old is not None
            and indices.device == old.device and torch.equal(indices, old))
        if unchanged and all(layer.stack_indices is old for layer in self.layers.values()):
            return
        self._stack_indices = indices
        for layer in self.layers.values():
            layer.set_stack_indices(indices)

    @property
    def current_rows(self) -> list | None:
        """What ``set_rows`` was last given (None when adapters are off)."""
        return self._rows

    @contextlib.contextmanager
    def rows(self, rows):
        """``with lora.rows([...]):`` sets the rows for the block, then restores the old ones."""
        previous = self._rows
        self.set_rows(rows)
        try:
            yield self
        finally:
            self.set_rows(previous)

    def remove(self) -> nn.Module:
        """Take every adapter out: put the original layers back and return the model, as it was
        before. The rows are reset as well (``current_rows`` is None afterwards), so no row
        goes on naming an adapter that is gone."""
        self.set_rows(None)
        for path, layer in self.layers.items():
            parent_path, _, attr = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            setattr(parent, attr, layer.base)
        self.layers.clear()
        self.names.clear()
        return self.model

    def __repr__(self) -> str:
        return f"MultiLora(adapters={self.names}, layers={len(self.layers)})"


def load_adapters(model: nn.Module, adapters=None) -> MultiLora:
    """Install LoRA adapters saved by peft into ``model`` for per-row use. (Lesson 06.)

    adapters: None for every shipped adapter (``shipped_adapters()``); a list of shipped
              adapter names and/or folders (a folder's name becomes the adapter's name); or a
              dict ``{name: folder}``.

    Each folder must hold ``adapter_config.json`` and ``adapter_model.safetensors`` (what
    ``save_pretrained`` writes). The layers named by the adapter's weights (its
    ``target_modules``) are wrapped in ``MultiLoraLayer``; scale = lora_alpha / r (per module
    where the config has ``rank_pattern`` / ``alpha_pattern``; lora_alpha / √r with
    ``use_rslora``). Linear, Conv1D and Embedding layers can be adapted. Returns the
    ``MultiLora`` that chooses each row's adapter (see ``MultiLora.set_rows``).
    """
    if adapters is None:
        adapters = shipped_adapters()
        if not adapters:
            raise ValueError(f"no shipped adapters found in {ADAPTERS_DIR} "
                             f"(run scripts/train_adapters.py)")
    if isinstance(adapters, (str, os.PathLike)):
        adapters = [adapters]
    items = (list(adapters.items()) if isinstance(adapters, dict)
             else [_adapter_folder(item) for item in adapters])
    lora = MultiLora(model)
    for name, folder in items:
        lora.add(name, folder)
    return lora
