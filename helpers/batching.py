"""Many requests at once: padding, batched generation, static and continuous batching.

Introduced in lesson 02 (padding, attention mask, position ids, batched greedy generation) and
lesson 03 (static versus continuous batching). Lesson 03 writes ``init_batch``,
``generate_next_token``, ``merge_batches`` and ``filter_batch`` in its own cells, step by step,
and checks that they give the very tokens of the versions here, which add only checks of their
input (a ValueError that says what is wrong).

The life of a batch, in the order the lessons build it:

1. ``init_batch(tokenizer, requests)`` tokenizes the prompts and pads them on the LEFT, so that
   every row's last token sits in the last column (that is where the next token comes from).
   It only prepares tensors; the model has not read anything yet.
2. ``generate_next_token(model, tokenizer, batch)`` runs the model once. The first call on a
   new batch reads the whole prompts (the *prefill*) and fills the KV cache; every later call
   feeds one token per row (a *decode* step). Each call adds one greedy token to every row
   that is still running and marks a row done at its ``max_tokens`` or at the EOS token.
3. ``merge_batches(batch1, batch2)`` puts two batches into one: the batch with the shorter
   history is padded on the left (zeros in its KV cache, 0 in its attention mask).
4. ``filter_batch(batch)`` drops the finished rows, then cuts away the padding columns that
   every remaining row has, so the cache does not keep growing.

The server of lesson 07 runs these very functions: it builds its batches from prompts it has
already tokenized (``batch_from_token_ids``, what ``init_batch`` does after tokenizing) and
gives ``generate_next_token`` its own ``choose`` (sampling, penalties, grammars) in place of
the greedy choice.

Static batching (``generate_static``) only uses 1 and 2: a batch runs until its longest request
is done, and finished rows idle in their slots. Continuous batching (``generate_continuous``)
uses all four: whenever a row finishes, a request from the queue takes its slot.

Every driver returns the same strings as ``generate_sequential`` (one request at a time):
batching changes how fast answers come, never what they are. Pass ``trace=Trace()`` to any
driver to record what happened at every step (which request sat in which slot, how long the
step took), e.g. to draw the timeline of lesson 03 with ``helpers.plots.plot_timeline``
(this module draws nothing and never imports matplotlib).

The KV cache is the transformers ``DynamicCache``. We never use its removed tuple API
(transformers 5): we read ``cache.layers[i].keys`` / ``.values`` (shape: batch, kv_heads,
seq, head_dim) and build new caches from tensors.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

#: A request is a prompt and the largest number of tokens it wants back.
Request = tuple[str, int]


# --- lesson 02: padding and position ids ---------------------------------------------------

def left_pad(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad lists of token ids on the left into one rectangle. (Lesson 02.)

    Returns ``(input_ids, attention_mask)``, both of shape (rows, longest list). The mask is 1
    for a real token and 0 for padding, so the model can ignore the padding.
    """
    if not token_lists:
        raise ValueError("token_lists is empty: give at least one list of token ids")
    width = max(len(ids) for ids in token_lists)
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        if ids:
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every token, counting real tokens only: ``cumsum(mask) - 1``. (Lesson 02.)

    With left padding a row's first real token gets position 0, just as if it were alone.
    Padding gets position 1: any valid position would do, because the mask hides it.
    """
    positions = attention_mask.long().cumsum(dim=-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


# --- the batch -----------------------------------------------------------------------------

@dataclass
class Batch:
    """Requests being generated together, one row each. (Lesson 03; it stays imported there:
    a plain record of per-row lists and the tensors the model reads.)

    ``input_ids`` is what the next ``generate_next_token`` feeds the model: the padded prompts
    before the prefill, then one token per row. ``attention_mask`` covers everything the model
    will have seen after that call (the KV cache plus ``input_ids``); ``position_ids`` are the
    positions of ``input_ids``. ``past_key_values`` is None until the prefill has run.
    """

    request_ids: list[int]
    max_tokens: list[int]
    token_ids: list[list[int]]   # the answer so far, per row
    done: list[bool]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    past_key_values: object | None = None

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def prefilled(self) -> bool:
        """True once the model has read the prompts (the batch holds a KV cache)."""
        return self.past_key_values is not None

    @classmethod
    def empty(cls) -> "Batch":
        """A batch with no rows: what ``filter_batch`` returns when every row has finished."""
        nothing = torch.zeros((0, 0), dtype=torch.long)
        return cls([], [], [], [], nothing, nothing.clone(), nothing.clone(), None)


def init_batch(tokenizer, requests: list[Request], request_ids: list[int] | None = None) -> Batch:
    """Tokenize the prompts of ``requests`` and pad them on the left into a new batch.
    (Lesson 03 writes this function in a cell of its own.)

    ``requests`` is a list of ``(prompt, max_tokens)``. ``request_ids`` (default 0, 1, ...)
    travel with the rows, so answers can be put back in queue order whatever happens to the
    rows. Nothing runs through the model here: the first ``generate_next_token`` on the new
    batch reads the prompts (the prefill).
    """
    _check_requests(requests)
    if request_ids is None:
        request_ids = list(range(len(requests)))
    if len(request_ids) != len(requests):
        raise ValueError(f"got {len(request_ids)} request_ids for {len(requests)} requests")
    prompts = [prompt for prompt, _ in requests]
    token_lists = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    return batch_from_token_ids(token_lists, [max_tokens for _, max_tokens in requests],
                                request_ids, _pad_id(tokenizer))


def batch_from_token_ids(token_lists: list[list[int]], max_tokens: list[int],
                         request_ids: list[int], pad_id: int) -> Batch:
    """``init_batch`` for prompts already tokenized: a new batch of the left-padded
    ``token_lists``, each row with its ``max_tokens`` and request id. (Lesson 03; the server of
    lesson 07 tokenizes each request as it arrives and builds its batches with this.)"""
    if not len(token_lists) == len(max_tokens) == len(request_ids):
        raise ValueError(f"got {len(token_lists)} token lists, {len(max_tokens)} max_tokens and "
                         f"{len(request_ids)} request_ids: give one of each per request")
    for rid, ids in zip(request_ids, token_lists):
        if len(ids) == 0:
            raise ValueError(f"request {rid}: the prompt is empty; give the model at least one token")
    input_ids, attention_mask = left_pad(token_lists, pad_id)
    return Batch(
        request_ids=list(request_ids),
        max_tokens=list(max_tokens),
        token_ids=[[] for _ in token_lists],
        done=[False] * len(token_lists),
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )


@torch.no_grad()
def generate_next_token(model, tokenizer, batch: Batch, stop_at_eos: bool = True, *,
                        choose=None, logits_to_keep: int = 1) -> Batch:
    """Run the model once and add one greedy token to every running row.
    (Lesson 03 writes this function in a cell of its own.)

    On a new batch this reads the whole prompts (prefill); afterwards it feeds one token per
    row (decode). A row is done once it has ``max_tokens`` tokens, or when the model picks the
    EOS token (with ``stop_at_eos``; EOS is not added to the answer). A finished row that stays
    in the batch (static batching) is fed padding, hidden by the mask: it does nothing useful
    but still takes its slot. Updates ``batch`` in place and returns it.

    The server of lesson 07 uses two more knobs. ``choose`` replaces the greedy choice: it is
    given the logits the model returned, (rows, positions, vocab), and returns one token id
    per row (sampling, penalties, grammars: ``helpers.server.sampling``). ``logits_to_keep``
    is how many positions those logits cover, counted from the end (0: all of them, to score
    every prompt token in the prefill).
    """
    if len(batch) == 0:
        raise ValueError("the batch is empty: there is nothing to generate")
    device = model.device
    output = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        past_key_values=batch.past_key_values,
        use_cache=True,
        logits_to_keep=logits_to_keep,   # by default only the last position's logits
    )
    if choose is None:
        next_tokens = output.logits[:, -1, :].argmax(dim=-1).tolist()   # greedy
    else:
        next_tokens = choose(output.logits)

    for row, token in enumerate(next_tokens):
        if not batch.done[row]:
            take_token(batch, row, token, stop_at_eos, tokenizer.eos_token_id)

    # What the next call feeds: each running row its new token; a finished row padding, masked.
    running = torch.tensor([not done for done in batch.done], dtype=torch.long, device=device)
    new_tokens = torch.tensor(next_tokens, dtype=torch.long, device=device)
    batch.input_ids = torch.where(running == 1, new_tokens, _pad_id(tokenizer)).unsqueeze(1)
    batch.attention_mask = torch.cat([batch.attention_mask.to(device), running.unsqueeze(1)], dim=1)
    # The new token's position is the number of real tokens before it.
    batch.position_ids = batch.attention_mask.sum(dim=1, keepdim=True) - 1
    batch.past_key_values = output.past_key_values
    return batch


def take_token(batch, row: int, token: int, stop_at_eos: bool, eos: int | None) -> None:
    """Give ``token`` to a running ``row`` of ``batch``: EOS (with ``stop_at_eos``) ends the row
    and is not part of its answer; any other token joins the answer, and the row is done once
    it has ``max_tokens`` of them. (Lesson 03; lesson 08's paged batches keep the same rule.)"""
    if stop_at_eos and token == eos:
        batch.done[row] = True
        return
    batch.token_ids[row].append(token)
    if len(batch.token_ids[row]) >= batch.max_tokens[row]:
        batch.done[row] = True


# --- lesson 03: merging and filtering batches ----------------------------------------------

def merge_batches(batch1: Batch, batch2: Batch) -> Batch:
    """One batch holding the rows of ``batch1`` then those of ``batch2``.
    (Lesson 03 writes this function in a cell of its own.)

    Both must have read their prompts already (``generate_next_token`` ran on them). Their
    histories usually differ in length: the shorter one is padded on the LEFT, with 0 in its
    attention mask and zeros in its KV cache, so that every row's newest token stays in the
    last column. An empty batch merges into anything unchanged.
    """
    if len(batch1) == 0:
        return batch2
    if len(batch2) == 0:
        return batch1
    if not (batch1.prefilled and batch2.prefilled):
        raise ValueError("merge_batches needs batches that have read their prompts: call "
                         "generate_next_token on a new batch (the prefill) before merging it")
    width = max(batch1.attention_mask.shape[1], batch2.attention_mask.shape[1])
    mask1, layers1 = _pad_history(batch1, width)
    mask2, layers2 = _pad_history(batch2, width)
    layers = [(torch.cat([k1, k2]), torch.cat([v1, v2]))
              for (k1, v1), (k2, v2) in zip(layers1, layers2)]
    return Batch(
        request_ids=batch1.request_ids + batch2.request_ids,
        max_tokens=batch1.max_tokens + batch2.max_tokens,
        token_ids=batch1.token_ids + batch2.token_ids,
        done=batch1.done + batch2.done,
        input_ids=torch.cat([batch1.input_ids, batch2.input_ids]),
        attention_mask=torch.cat([mask1, mask2]),
        position_ids=torch.cat([batch1.position_ids, batch2.position_ids]),
        past_key_values=cache_from_layers(layers),
    )


def filter_batch(batch: Batch) -> Batch:
    """The batch without its finished rows, and without the padding they all share.
    (Lesson 03 writes this function in a cell of its own.)

    After rows leave, the columns on the left may be padding in every remaining row: they are
    cut from the attention mask and from every layer's keys and values. Returns a new batch
    (``Batch.empty()`` when every row has finished; the batch itself when there is nothing to
    drop or cut). Collect the finished answers first: their rows are gone afterwards.
    """
    keep = [row for row, done in enumerate(batch.done) if not done]
    if not keep:
        return Batch.empty()
    if not batch.prefilled:
        raise ValueError("filter_batch needs a batch that has read its prompts: call "
                         "generate_next_token on it first")
    if len(keep) == len(batch) and bool(batch.attention_mask[:, 0].any()):
        return batch        # nothing to drop, nothing to cut (checked cheaply: most steps)
    rows = torch.tensor(keep, device=batch.attention_mask.device)
    mask = batch.attention_mask[rows]
    # The first column where some row has a real token: everything before it is shared padding.
    shared_padding = int(mask.any(dim=0).int().argmax())
    if len(keep) == len(batch) and shared_padding == 0:
        return batch        # nothing to drop, nothing to cut: no need to copy the cache
    # The cache covers every column but the last (the token the next step feeds).
    layers = [(keys[rows, :, shared_padding:], values[rows, :, shared_padding:])
              for keys, values in cache_layers(batch.past_key_values)]
    return Batch(
        request_ids=[batch.request_ids[r] for r in keep],
        max_tokens=[batch.max_tokens[r] for r in keep],
        token_ids=[batch.token_ids[r] for r in keep],
        done=[False] * len(keep),
        input_ids=batch.input_ids[rows],
        attention_mask=mask[:, shared_padding:],
        position_ids=batch.position_ids[rows],
        past_key_values=cache_from_layers(layers),
    )


def _pad_history(batch: Batch, width: int):
    """The batch's attention mask and cache layers padded on the left to ``width`` columns."""
    pad = torch.nn.functional.pad
    missing = width - batch.attention_mask.shape[1]
    mask = pad(batch.attention_mask, (missing, 0), value=0)
    # Keys and values are (batch, kv_heads, seq, head_dim): zeros on the left of dimension 2.
    layers = [(pad(keys, (0, 0, missing, 0)), pad(values, (0, 0, missing, 0)))
              for keys, values in cache_layers(batch.past_key_values)]
    return mask, layers


# --- the KV cache as tensors ---------------------------------------------------------------

def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(keys, values)`` of every layer of a transformers cache. (Lesson 03.)

    Each tensor has shape (batch, kv_heads, seq, head_dim). Uses ``cache.layers`` (the old
    ``cache[i]`` / ``key_cache`` access is gone in transformers 5).
    """
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    """A ``DynamicCache`` holding the given ``(keys, values)`` per layer. (Lesson 03.)"""
    from transformers import DynamicCache

    # The cache's public API: an empty cache grows one layer per update, in layer order.
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


# --- recording what happened ---------------------------------------------------------------

@dataclass
class Step:
    """One forward pass of a driver. (Lesson 03.)

    kind:       "prefill" (read new prompts) or "decode" (one token for every row)
    rows:       request id of every row the model computed, in row order
    slots:      request id in each slot of the batch, None for a free or idle slot
    seconds:    wall time of the forward pass and the choice of the next tokens
    new_tokens: tokens this step added to answers
    """

    kind: str
    rows: list[int]
    slots: list[int | None]
    seconds: float
    new_tokens: int


@dataclass
class Trace:
    """What a driver did, step by step: pass ``trace=Trace()`` to a driver. (Lesson 03.)"""

    driver: str = ""
    batch_size: int = 0
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0     # wall time of the whole run, merging and filtering included
    token_ids: list[list[int]] = field(default_factory=list)   # each answer's tokens, request order

    @property
    def decode_steps(self) -> int:
        """Number of decode steps (one token for every row in the batch)."""
        return sum(step.kind == "decode" for step in self.steps)

    @property
    def prefill_steps(self) -> int:
        """Number of forward passes that read new prompts."""
        return sum(step.kind == "prefill" for step in self.steps)

    @property
    def tokens(self) -> int:
        """Tokens generated in all."""
        return sum(step.new_tokens for step in self.steps)

    def occupancy(self, kind: str | None = "decode") -> list[list[int | None]]:
        """Slot contents per step (steps of ``kind``; None for all): request id or None."""
        return [step.slots for step in self.steps if kind is None or step.kind == kind]

    def utilization(self) -> float:
        """Share of slot-steps of the decode steps that served a running request (0..1)."""
        table = self.occupancy("decode")
        total = sum(len(slots) for slots in table)
        used = sum(rid is not None for slots in table for rid in slots)
        return used / total if total else float("nan")


# --- the drivers ---------------------------------------------------------------------------

def generate_sequential(model, tokenizer, requests: list[Request], *, stop_at_eos: bool = True,
                        trace: Trace | None = None) -> list[str]:
    """Answer the requests one at a time, in order: the reference. (Lesson 03.)

    ``requests`` is a list of ``(prompt, max_tokens)``. Returns the continuation of every
    request (the prompt excluded) in request order. Greedy; a request stops at ``max_tokens``
    tokens or at EOS (not included).
    """
    _check_requests(requests, tokenizer, model)
    trace = _start_trace(trace, "sequential", 1, len(requests))
    _synchronize(model.device)
    start = time.perf_counter()
    for rid, request in enumerate(requests):
        batch = init_batch(tokenizer, [request], request_ids=[rid])
        while not batch.done[0]:
            _step(model, tokenizer, batch, stop_at_eos, trace, slots=[rid])
        trace.token_ids[rid] = batch.token_ids[0]
    return _finish(trace, start, tokenizer, model.device)


def generate_static(model, tokenizer, requests: list[Request], batch_size: int = 8,
                    progress: bool = True, *, stop_at_eos: bool = True,
                    trace: Trace | None = None) -> list[str]:
    """Static batching: ``batch_size`` requests at a time, each batch until its longest is done.
    (Lesson 03.)

    Rows that finish early stay in the batch, idle, until the whole batch is done; the next
    requests wait for that. Same arguments, result and stopping rule as
    ``generate_sequential``.
    """
    _check_requests(requests, tokenizer, model)
    _check_batch_size(batch_size)
    trace = _start_trace(trace, "static", batch_size, len(requests))
    _synchronize(model.device)
    start = time.perf_counter()
    with _progress(progress, len(requests), "static batching") as bar:
        for first in range(0, len(requests), batch_size):
            ids = list(range(first, min(first + batch_size, len(requests))))
            batch = init_batch(tokenizer, [requests[i] for i in ids], request_ids=ids)
            while not all(batch.done):
                # A slot whose request has finished is idle (None) but still computed.
                slots = [None if done else rid for rid, done in zip(batch.request_ids, batch.done)]
                finished_before = sum(batch.done)
                _step(model, tokenizer, batch, stop_at_eos, trace, slots)
                bar.update(sum(batch.done) - finished_before)
            for rid, tokens in zip(batch.request_ids, batch.token_ids):
                trace.token_ids[rid] = tokens
    return _finish(trace, start, tokenizer, model.device)


def generate_continuous(model, tokenizer, requests: list[Request], batch_size: int = 8,
                        progress: bool = True, *, stop_at_eos: bool = True,
                        trace: Trace | None = None) -> list[str]:
    """Continuous batching: a finished request's slot goes to the next one in the queue at once.
    (Lesson 03.)

    Each round: fill the free slots (``init_batch``, the prefill with ``generate_next_token``,
    ``merge_batches``), run one decode step for the whole batch (``generate_next_token``),
    collect the finished answers and drop their rows (``filter_batch``). Same arguments,
    result and stopping rule as ``generate_sequential``.
    """
    _check_requests(requests, tokenizer, model)
    _check_batch_size(batch_size)
    trace = _start_trace(trace, "continuous", batch_size, len(requests))
    _synchronize(model.device)
    start = time.perf_counter()
    queue = deque(range(len(requests)))
    slot_of = {}   # request id -> slot number (only for the record: rows move, slots do not)
    batch = Batch.empty()

    def slots_now():
        slots = [None] * batch_size
        for rid, slot in slot_of.items():
            slots[slot] = rid
        return slots

    def collect(batch, bar):
        """Store the answers of finished rows, free their slots, drop their rows."""
        if not any(batch.done):
            return batch
        for rid, tokens, done in zip(batch.request_ids, batch.token_ids, batch.done):
            if done:
                trace.token_ids[rid] = tokens
                del slot_of[rid]
                bar.update(1)
        return filter_batch(batch)

    with _progress(progress, len(requests), "continuous batching") as bar:
        while queue or len(batch) > 0:
            # 1. Free slots take the next requests of the queue: read their prompts, merge them in.
            while queue and len(batch) < batch_size:
                free = [s for s in range(batch_size) if s not in slot_of.values()]
                ids = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                slot_of.update(zip(ids, free))
                new = init_batch(tokenizer, [requests[i] for i in ids], request_ids=ids)
                _step(model, tokenizer, new, stop_at_eos, trace, slots_now(), kind="prefill")
                batch = merge_batches(batch, collect(new, bar))
            if len(batch) == 0:
                break
            # 2. One decode step for every row, then collect what finished.
            _step(model, tokenizer, batch, stop_at_eos, trace, slots_now())
            batch = collect(batch, bar)
    return _finish(trace, start, tokenizer, model.device)


def generate_batched(model, tokenizer, prompts: list[str], max_new_tokens: int = 10, *,
                     stop_at_eos: bool = True, trace: Trace | None = None) -> list[str]:
    """All ``prompts`` in one batch, ``max_new_tokens`` each: batched greedy generation with the
    KV cache. (Lesson 02.)

    The same as ``generate_static`` with one batch holding every prompt.
    """
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of strings, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    requests = [(prompt, max_new_tokens) for prompt in prompts]
    return generate_static(model, tokenizer, requests, batch_size=len(requests),
                           progress=False, stop_at_eos=stop_at_eos, trace=trace)


def _step(model, tokenizer, batch, stop_at_eos, trace, slots, kind=None):
    """``generate_next_token`` with a stopwatch; appends a ``Step`` to ``trace``."""
    kind = kind or ("decode" if batch.prefilled else "prefill")
    tokens_before = sum(len(tokens) for tokens in batch.token_ids)
    # On a GPU the work runs behind Python's back: wait for it before reading the clock, so
    # that each step is charged its own work (merging and filtering run between the steps).
    _synchronize(model.device)
    start = time.perf_counter()
    generate_next_token(model, tokenizer, batch, stop_at_eos=stop_at_eos)
    _synchronize(model.device)
    seconds = time.perf_counter() - start
    new_tokens = sum(len(tokens) for tokens in batch.token_ids) - tokens_before
    trace.steps.append(Step(kind, list(batch.request_ids), list(slots), seconds, new_tokens))


def _start_trace(trace: Trace | None, driver: str, batch_size: int, n_requests: int) -> Trace:
    trace = Trace() if trace is None else trace
    trace.driver, trace.batch_size, trace.steps, trace.seconds = driver, batch_size, [], 0.0
    trace.token_ids = [[] for _ in range(n_requests)]
    return trace


def _synchronize(device) -> None:
    """Wait until the GPU has done all the work queued so far (nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _finish(trace: Trace, start: float, tokenizer, device) -> list[str]:
    """Stop the clock and turn every answer's tokens into text, in request order."""
    _synchronize(device)
    trace.seconds = time.perf_counter() - start
    return [tokenizer.decode(tokens) for tokens in trace.token_ids]


def _progress(enabled: bool, total: int, description: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="request", disable=not enabled)


# --- the ideal schedule --------------------------------------------------------------------

def ideal_decode_steps(token_counts: list[int], batch_size: int) -> int:
    """Decode steps continuous batching needs for a queue, at best. (Lesson 03.)

    ``token_counts`` is how many tokens the model produces for each request, in queue order:
    its ``max_tokens``, or, for a request that stopped at EOS, its answer's length plus one
    (the EOS was produced too). A request's first token comes from its prefill, so it sits
    in a slot for ``count - 1`` decode steps; a slot freed by a step is filled from the queue
    before the next step. Returns the number of steps until the last request is done.
    """
    _check_batch_size(batch_size)
    _check_counts(token_counts)
    free_at = [0] * batch_size          # the step at which each slot is free again (a heap)
    for count in token_counts:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + count - 1)
    return max(free_at)


def static_decode_steps(token_counts: list[int], batch_size: int) -> int:
    """Decode steps static batching needs: each batch runs until its longest request is done.
    (Lesson 03.)"""
    _check_batch_size(batch_size)
    _check_counts(token_counts)
    return sum(max(token_counts[i:i + batch_size]) - 1 for i in range(0, len(token_counts), batch_size))


def _check_counts(token_counts):
    if not token_counts:
        raise ValueError("token_counts is empty: give the number of tokens of at least one request")
    for i, count in enumerate(token_counts):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"token_counts[{i}] must be a positive integer, got {count!r}")


# --- transformers' own continuous batching -------------------------------------------------

def transformers_generate_batch(model, tokenizer, requests: list[Request],
                                batch_size: int | None = None, progress: bool = False,
                                timeout: float = 600.0, stop_at_eos: bool = True) -> list[str]:
    """The same queue through transformers' own continuous batching: what the library does.
    (Lesson 03.)

    Uses the manager behind ``model.generate_batch`` (paged attention, a background thread),
    adding each request with its own ``max_tokens`` (``generate_batch`` itself takes one
    ``max_new_tokens`` for all). Greedy; EOS ends a request and is left out of its text, as in
    our drivers (with ``stop_at_eos=False`` it is an ordinary token: every request gets its
    ``max_tokens``). Returns the continuations in request order. ``batch_size`` caps the requests
    per step (None: the library decides).

    The paged KV cache is sized for this queue: left to itself, transformers sizes it from the
    free memory of the device, which on a CPU means gigabytes and tens of seconds of set-up.
    The model's attention implementation is restored afterwards.
    """
    from transformers import GenerationConfig

    _check_requests(requests, tokenizer, model)
    if batch_size is not None:
        _check_batch_size(batch_size)
    token_lists = tokenizer([prompt for prompt, _ in requests])["input_ids"]
    config = GenerationConfig(do_sample=False, max_new_tokens=max(m for _, m in requests),
                              eos_token_id=tokenizer.eos_token_id if stop_at_eos else [],
                              pad_token_id=_pad_id(tokenizer))
    manager = _batching_manager(model, config, token_lists, [m for _, m in requests], batch_size)
    manager.start()
    try:
        for rid, (ids, (_, max_tokens)) in enumerate(zip(token_lists, requests)):
            manager.add_request(ids, request_id=f"request-{rid}", max_new_tokens=max_tokens)
        return _collect_answers(manager, tokenizer, len(requests), stop_at_eos, timeout, progress)
    finally:
        manager.stop(block=True)


def _batching_manager(model, config, token_lists: list[list[int]], max_tokens: list[int],
                      batch_size: int | None):
    """transformers' continuous-batching manager (not started yet), its paged KV cache sized
    for these requests: enough pages for every request at its full length, and room for
    every prompt in one forward pass."""
    page = 64
    pages = sum(math.ceil((len(ids) + m) / page) for ids, m in zip(token_lists, max_tokens))
    sizes = {"num_blocks": pages + 1,
             "max_batch_tokens": max(256, sum(len(ids) for ids in token_lists))}
    from transformers import ContinuousBatchingConfig

    return model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=_batching_config(ContinuousBatchingConfig, page, sizes,
                                                    batch_size))


def _batching_config(config_class, page: int, sizes: dict, batch_size: int | None):
    """A ``ContinuousBatchingConfig`` with what this installed transformers accepts: its
    fields have changed between 5.x releases (the page size was ``block_size`` before 5.18,
    ``page_size`` after), so the name is read from the class, not assumed."""
    import dataclasses

    accepted = {field.name for field in dataclasses.fields(config_class)}
    args = {("page_size" if "page_size" in accepted else "block_size"): page, **sizes}
    if batch_size:
        args["max_requests_per_batch"] = batch_size
    missing = sorted(set(args) - accepted)
    if missing:
        raise RuntimeError(f"this transformers' ContinuousBatchingConfig has no {missing}")
    return config_class(**args)


def _collect_answers(manager, tokenizer, count: int, stop_at_eos: bool, timeout: float,
                     progress: bool) -> list[str]:
    """Wait for the running manager to finish requests ``request-0`` .. ``request-<count-1>``;
    their texts in request order (without the EOS and what follows, with ``stop_at_eos``)."""
    answers = [None] * count
    deadline = time.perf_counter() + timeout
    with _progress(progress, count, "transformers generate_batch") as bar:
        while any(answer is None for answer in answers):
            if time.perf_counter() > deadline or not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before answering "
                                   "every request")
            result = manager.get_result(timeout=1)
            if result is None or not result.is_finished():
                continue
            tokens = list(result.generated_tokens)
            if stop_at_eos and tokenizer.eos_token_id in tokens:
                tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
            answers[int(result.request_id.split("-")[1])] = tokenizer.decode(tokens)
            bar.update(1)
    return answers


# --- checks --------------------------------------------------------------------------------

def model_context(model) -> int | None:
    """The most positions the model can handle (``n_positions`` / ``max_position_embeddings``).
    (Lesson 02.)"""
    config = model.config
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _check_positive_int(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_batch_size(batch_size) -> None:
    _check_positive_int("batch_size", batch_size)


def _check_requests(requests, tokenizer=None, model=None) -> None:
    """ValueError unless ``requests`` is a non-empty list of (prompt string, max_tokens >= 1),
    and (given a tokenizer and model) every prompt plus its tokens fits the model's context."""
    if not isinstance(requests, (list, tuple)) or len(requests) == 0:
        raise ValueError("requests is empty: give a list of at least one (prompt, max_tokens) pair")
    for rid, request in enumerate(requests):
        if not isinstance(request, (list, tuple)) or len(request) != 2:
            raise ValueError(f"request {rid} must be a (prompt, max_tokens) pair, got {request!r}")
        prompt, max_tokens = request
        if not isinstance(prompt, str):
            raise ValueError(f"request {rid}: the prompt must be a string, got {type(prompt).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"request {rid}: max_tokens must be a positive integer, got {max_tokens!r}")
    if tokenizer is None or model is None:
        return
    context = model_context(model)
    token_lists = tokenizer([prompt for prompt, _ in requests])["input_ids"]
    for rid, (ids, (_, max_tokens)) in enumerate(zip(token_lists, requests)):
        if len(ids) == 0:
            raise ValueError(f"request {rid}: the prompt is empty; give the model at least one token")
        if context is not None and len(ids) + max_tokens > context:
            raise ValueError(f"request {rid}: the prompt has {len(ids)} tokens and asks for {max_tokens} "
                             f"more, {len(ids) + max_tokens} in all, beyond the model's context of "
                             f"{context} tokens")


# --- measurement harnesses of lessons 02 and 03 --------------------------------------------

def time_batch(model, tokenizer, prompts: list[str], batch_size: int,
               new_tokens: int = 10) -> dict:
    """Time one batched generation of ``new_tokens`` tokens for each of ``batch_size`` rows.
    (Lesson 02.)

    The rows cycle through ``prompts``; EOS does not stop them, so every row makes exactly
    ``new_tokens`` tokens. Returns a dict: ``batch`` (the batch size), ``latency`` (seconds for
    the whole batch: what every request in it waits), ``ttft`` (seconds of the prefill),
    ``tpot`` (mean seconds of a decode step; NaN when ``new_tokens`` is 1) and ``throughput``
    (tokens per second, all rows together).
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    _check_batch_size(batch_size)
    _check_positive_int("new_tokens", new_tokens)
    rows = [prompts[i % len(prompts)] for i in range(batch_size)]
    trace = Trace()
    generate_batched(model, tokenizer, rows, max_new_tokens=new_tokens, stop_at_eos=False,
                     trace=trace)
    decode = [step.seconds for step in trace.steps if step.kind == "decode"]
    return {"batch": batch_size, "latency": trace.seconds, "ttft": trace.steps[0].seconds,
            "tpot": sum(decode) / len(decode) if decode else math.nan,
            "throughput": batch_size * new_tokens / trace.seconds}


def time_batch_sizes(model, tokenizer, prompts: list[str], batch_sizes: list[int],
                     new_tokens: int = 10, rounds: int = 3, on_progress=None) -> list[dict]:
    """Latency and throughput of batched generation at each batch size. (Lesson 02.)

    Times ``time_batch`` for every size in ``batch_sizes``, going round all sizes ``rounds``
    times, and keeps each size's fastest run: the one least disturbed by other programs
    (going round, rather than repeating one size, spreads a burst of load over all sizes).
    A small untimed run first pays the one-off costs. Returns one ``time_batch`` dict per size,
    in the order of ``batch_sizes``.

    ``on_progress(results)``, if given, is called with the results so far (sorted by batch
    size) whenever a size gets its first result, and again after every later round: a live
    plot redraws from it.
    """
    if (not isinstance(batch_sizes, (list, tuple)) or not batch_sizes
            or len(set(batch_sizes)) != len(batch_sizes)):
        raise ValueError(f"batch_sizes must be a non-empty list of different sizes, got {batch_sizes!r}")
    for size in batch_sizes:
        _check_batch_size(size)
    _check_positive_int("rounds", rounds)
    _check_positive_int("new_tokens", new_tokens)
    time_batch(model, tokenizer, prompts, min(batch_sizes), min(new_tokens, 2))   # warm-up
    best = {}
    for round_ in range(rounds):
        for size in batch_sizes:
            result = time_batch(model, tokenizer, prompts, size, new_tokens)
            if size not in best or result["latency"] < best[size]["latency"]:
                best[size] = result
            if on_progress is not None and (round_ == 0 or size == batch_sizes[-1]):
                on_progress([best[s] for s in sorted(best)])
    return [best[size] for size in batch_sizes]


def time_schedules(model, tokenizer, requests: list[Request], batch_size: int = 8, *,
                   stop_at_eos: bool = True) -> dict[str, Trace]:
    """Run the same requests with static, then with continuous batching, each with a ``Trace``.
    (Lesson 03.)

    Returns ``{"static": trace, "continuous": trace}``: the wall time (``trace.seconds``), the
    steps and every answer's tokens (``trace.token_ids``) of each schedule, ready for
    ``helpers.plots.durations_figure`` and ``timelines_figure``.
    """
    _check_requests(requests, tokenizer, model)
    _check_batch_size(batch_size)
    traces = {"static": Trace(), "continuous": Trace()}
    for (name, trace), driver in zip(traces.items(), (generate_static, generate_continuous)):
        driver(model, tokenizer, requests, batch_size=batch_size, progress=False,
               stop_at_eos=stop_at_eos, trace=trace)
    return traces
