"""The engine: one scheduler thread that owns the model and runs continuous batching with a
different adapter on every row. (Lesson 07.)

The HTTP side (``app.py``) never touches the model. It checks a request (``Engine.prepare``:
tokens, limits, adapter, JSON schema), hands it over (``Engine.submit``) and reads the
request's events from an ``asyncio.Queue``. The scheduler thread repeats ``Engine.step``:

1. drop the rows whose client went away (``filter_batch``, lesson 03);
2. admit waiting requests into the free slots: their prompts are padded into a new batch, read
   in one forward pass (the prefill) and merged into the running batch (``merge_batches``);
3. run one decode step for the whole batch;
4. choose each row's next token with that row's own rules (greedy, or seeded sampling with
   temperature / top-k / top-p; JSON mode masks the tokens its guide forbids), hand every
   token to its request's queue (``loop.call_soon_threadsafe``: the queue belongs to the
   event loop's thread), and drop the rows that finished (``filter_batch``).

Each row's adapter is set with ``MultiLora.set_rows`` (lesson 06) before every forward pass, so
the rows of one batch can use different adapters, or none.

Greedy decoding gives exactly what ``helpers.generate_sequential`` gives for the same prompt
(and, with an adapter, what generating that row alone with the adapter gives): batching
changes when answers come, not what they are.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import traceback
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch

from ..batching import (Batch, filter_batch, left_pad, merge_batches, model_context,
                        position_ids_from_mask)
from ..lora import ADAPTERS_DIR
from .adapters import AdapterStore
from .json_mode import JsonMode
from .protocol import ApiError, GenerationParams, invalid

log = logging.getLogger("helpers.server")


# --- what travels between the HTTP side and the scheduler --------------------------------

@dataclass
class Prepared:
    """A checked request, ready for the scheduler (made by ``Engine.prepare``)."""

    prompt: str
    input_ids: list[int]
    params: GenerationParams
    max_new_tokens: int
    adapter: str | None          # the name loaded in the engine's MultiLora, None for none
    schema: object | None        # the compiled JSON schema (json_mode.CompiledSchema)
    seed: int | None             # the sampling seed (drawn at random when not given)


@dataclass
class TokenEvent:
    """One generated token. ``finish`` is set on a request's last token: finish_reason,
    generated_text, generated_tokens, prompt_tokens, seed, and stop_at (where a matched stop
    sequence starts in the text, else None)."""

    token: dict
    finish: dict | None = None


@dataclass
class ErrorEvent:
    """The request failed after it was accepted (the model raised, or the server stops)."""

    message: str
    error_type: str = "generation"
    status: int = 500


@dataclass(eq=False)
class Handle:
    """A submitted request. Its events arrive on ``queue`` as ``(tag, event)`` pairs."""

    id: int
    prepared: Prepared
    loop: object
    queue: object
    tag: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    finished: bool = False


def _deliver(items) -> None:
    """Runs in the event loop's thread: put each event on its request's queue."""
    for queue, tag, event in items:
        queue.put_nowait((tag, event))


# --- one row of the running batch -----------------------------------------------------------

class _Row:
    """The per-request state the scheduler keeps while a request is in the batch."""

    def __init__(self, handle: Handle, engine: "Engine"):
        prepared = handle.prepared
        params = prepared.params
        self.handle = handle
        self.params = params
        self.max_new_tokens = prepared.max_new_tokens
        self.prompt_ids = prepared.input_ids
        self.adapter = prepared.adapter
        self.sampling = params.sampling
        self.generator = None
        if self.sampling:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(prepared.seed)
        self.schema = prepared.schema
        self.guide = engine.json.guide(prepared.schema) if prepared.schema is not None else None
        self.penalty = (params.repetition_penalty
                        if params.repetition_penalty not in (None, 1.0) else None)
        # ignore_eos_token: EOS is an ordinary token that does not end the request (as in TGI
        # and LoRAX, and as generate_sequential(stop_at_eos=False)). Not in JSON mode, where
        # EOS is only allowed once the JSON is complete.
        self.ignore_eos = params.ignore_eos_token and self.guide is None
        self.ids: list[int] = []       # generated tokens (EOS only with ignore_eos)
        self.count = 0                 # generated tokens, EOS included
        self.text = ""                 # text handed out so far
        self.full_len = 0              # length of the decoded text at the previous step
        self.longest_stop = max((len(s) for s in params.stop), default=0)

    @property
    def needs_processing(self) -> bool:
        return self.penalty is not None or self.guide is not None


class Engine:
    """Continuous batching with per-row adapters, sampling rules and JSON mode. (Lesson 07.)

    model, tokenizer:  from ``helpers.load_model`` (any causal LM; the tokenizer pads with EOS)
    adapters_dir:      folder of local adapters, one sub-folder each (default: the course's)
    max_batch_size:    rows generated together (the slots of lesson 03)
    max_input_tokens:  longest prompt accepted, in tokens (default: half the context)
    max_total_tokens:  prompt + new tokens of one request (default: the model's context)
    max_queue:         requests that may wait for a slot; one more gets 429 "overloaded"
    default_max_new_tokens: what a request that does not say gets (capped by the room left)

    ``start()`` starts the scheduler thread, ``stop()`` ends it (waiting and running requests
    get an error event). Use ``prepare`` then ``submit`` from the HTTP side; ``cancel`` drops a
    request whose client went away.
    """

    def __init__(self, model, tokenizer, *, adapters_dir=ADAPTERS_DIR, max_batch_size: int = 8,
                 max_input_tokens: int | None = None, max_total_tokens: int | None = None,
                 max_queue: int = 64, default_max_new_tokens: int = 64,
                 model_id: str | None = None):
        context = model_context(model)
        if max_total_tokens is None:
            max_total_tokens = context or 2048
        if context is not None and max_total_tokens > context:
            raise ValueError(f"max_total_tokens={max_total_tokens} is beyond the model's context "
                             f"of {context} tokens")
        if max_input_tokens is None:
            max_input_tokens = max(1, max_total_tokens // 2)
        for name, value in (("max_batch_size", max_batch_size), ("max_queue", max_queue),
                            ("max_input_tokens", max_input_tokens),
                            ("default_max_new_tokens", default_max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not max_input_tokens < max_total_tokens:
            raise ValueError(f"max_input_tokens ({max_input_tokens}) must be smaller than "
                             f"max_total_tokens ({max_total_tokens})")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id or getattr(model.config, "_name_or_path", "") or "model"
        self.max_batch_size = max_batch_size
        self.max_input_tokens = max_input_tokens
        self.max_total_tokens = max_total_tokens
        self.max_queue = max_queue
        self.default_max_new_tokens = default_max_new_tokens
        self.device = model.device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.special_ids = set(tokenizer.all_special_ids)
        self.eos_text = (tokenizer.convert_ids_to_tokens(self.eos_id)
                         if self.eos_id is not None else "")

        self._model_lock = threading.RLock()    # held during a step, and to add an adapter
        self._cond = threading.Condition()      # guards the waiting queue and the flags
        self._encode_lock = threading.Lock()
        self._waiting: deque[Handle] = deque()
        self._rows: dict[int, _Row] = {}
        self._batch = Batch.empty()
        self._next_id = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.adapters = AdapterStore(model, adapters_dir, self._model_lock)
        self.json = JsonMode(tokenizer)
        self.stats = defaultdict(float)

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> "Engine":
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="helpers.server scheduler",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._failure is None)

    # --- the HTTP side ----------------------------------------------------------------------

    def prepare(self, prompt: str, params: GenerationParams) -> Prepared:
        """Check a request against the server's limits and make it ready. Tokenizes the
        prompt, loads the adapter if needed, compiles the JSON schema. Raises ``ApiError``.
        May block (loading an adapter): call it from a worker thread."""
        if not isinstance(prompt, str) or prompt == "":
            raise invalid("`inputs` must not be empty")
        with self._encode_lock:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if params.truncate is not None and len(ids) > params.truncate:
            ids = ids[-params.truncate:]          # keep the end, nearest the answer
        if not ids:
            raise invalid("`inputs` has no tokens")
        if len(ids) > self.max_input_tokens:
            raise invalid(f"`inputs` must have at most {self.max_input_tokens} tokens "
                          f"(--max-input-tokens); given: {len(ids)} tokens")
        room = self.max_total_tokens - len(ids)
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = min(self.default_max_new_tokens, room)
        elif max_new > room:
            raise invalid(f"`inputs` tokens + `max_new_tokens` must be <= "
                          f"{self.max_total_tokens} (--max-total-tokens); given: {len(ids)} "
                          f"`inputs` tokens and {max_new} `max_new_tokens`")
        adapter = self.adapters.resolve(params.adapter_id, params.adapter_source,
                                        params.api_token)
        schema = None
        if params.grammar is not None:
            kind, value = params.grammar
            if kind != "json":
                raise invalid(f"grammar type {kind!r} is not supported")
            schema = self.json.compile(value)
        if schema is not None:
            shortest = schema.distance.get(schema.automaton.get_initial_state())
            if shortest is not None and shortest + 1 > max_new:   # + 1: the EOS after it
                raise invalid(f"JSON mode: the shortest answer this schema allows takes "
                              f"{shortest} tokens of this model, plus the end token; "
                              f"`max_new_tokens` is {max_new}")
        seed = None
        if params.sampling:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        return Prepared(prompt, list(ids), params, max_new, adapter, schema, seed)

    def submit(self, prepared: Prepared, loop, queue, tag: int = 0) -> Handle:
        """Queue a prepared request; its events will go to ``queue`` (an asyncio.Queue of
        ``loop``). Raises ``ApiError`` 429 when the queue is full, 503 when stopping."""
        with self._cond:
            if not self.healthy:
                raise ApiError(503, "the server is not running (its scheduler stopped"
                               + (f": {self._failure})" if self._failure else ")"), "generation")
            if len(self._waiting) >= self.max_queue:
                self.stats["rejected_overloaded"] += 1
                raise ApiError(429, f"Model is overloaded: {len(self._waiting)} requests are "
                               f"already waiting (--max-queue {self.max_queue}); retry later",
                               "overloaded")
            handle = Handle(self._next_id, prepared, loop, queue, tag)
            self._next_id += 1
            self._waiting.append(handle)
            self.stats["requests"] += 1
            self._cond.notify_all()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Forget a request (its client went away): it leaves the batch before the next step,
        and its slot goes to the next waiting request."""
        with self._cond:
            if handle.finished or handle.cancelled:
                return
            handle.cancelled = True
            self._cond.notify_all()

    def snapshot(self) -> dict:
        """Counters and the current load, for /metrics and /info."""
        with self._cond:
            state = {"waiting": len(self._waiting), "running": len(self._rows)}
        return {**state, **{k: v for k, v in self.stats.items()}}

    # --- the scheduler thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:     # a bug in the scheduler itself: say so in /health
            self._failure = f"{type(err).__name__}: {err}"
            log.error("the scheduler stopped:\n%s", traceback.format_exc())
            raise
        finally:
            self._shutdown()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._rows:
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    break
            try:
                with self._model_lock, torch.inference_mode():
                    self.step()
            except Exception as err:   # the model failed: fail the rows, keep serving
                log.error("generation failed:\n%s", traceback.format_exc())
                self._fail_rows(f"generation failed: {type(err).__name__}: {err}")

    def step(self) -> None:
        """One turn of the scheduler loop: continuous batching (lesson 03) in which every row
        may use its own adapter (lesson 06). Runs in the scheduler thread, which holds the
        model lock. Lesson 07 shows this method."""
        # 1. Rows whose client went away leave before any work is spent on them.
        self._drop_cancelled()
        # 2. Free slots go to waiting requests. Their prompts are left-padded into a batch of
        #    their own and read in one forward pass, the prefill, which gives each its first
        #    token. Rows already finished (one token was all they needed) are filtered out,
        #    the rest merge into the running batch.
        with self._cond:
            new = self._take_waiting()
        if new:
            prefill = self._new_batch(new)
            self._forward(prefill, "prefill")
            self._batch = merge_batches(self._batch, filter_batch(prefill))
            self.stats["rows_max"] = max(self.stats["rows_max"], len(self._batch))
        # 3. One decode step: every running row, new or old, gets its next token; the rows
        #    that finished leave the batch and free their slots for the next turn.
        if len(self._batch):
            self._forward(self._batch, "decode")
            self._batch = filter_batch(self._batch)

    def _take_waiting(self) -> list[Handle]:
        free = self.max_batch_size - len(self._rows)
        taken = []
        while self._waiting and len(taken) < free:
            handle = self._waiting.popleft()
            if handle.cancelled:
                self.stats["cancelled"] += 1
                continue
            taken.append(handle)
        return taken

    def _drop_cancelled(self) -> None:
        batch = self._batch
        if not any(self._rows[rid].handle.cancelled for rid in batch.request_ids):
            return
        for i, rid in enumerate(batch.request_ids):
            if self._rows[rid].handle.cancelled:
                batch.done[i] = True
                del self._rows[rid]
                self.stats["cancelled"] += 1
        self._batch = filter_batch(batch)

    def _new_batch(self, handles: list[Handle]) -> Batch:
        """The rows of newly admitted requests and their prompts, left-padded (as
        ``helpers.init_batch`` of lesson 03 does before its forward pass)."""
        for handle in handles:
            self._rows[handle.id] = _Row(handle, self)
        input_ids, attention_mask = left_pad([h.prepared.input_ids for h in handles], self.pad_id)
        return Batch(request_ids=[h.id for h in handles],
                     max_tokens=[h.prepared.max_new_tokens for h in handles],
                     token_ids=[[] for _ in handles], done=[False] * len(handles),
                     input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids_from_mask(attention_mask))

    def _forward(self, batch: Batch, kind: str) -> None:
        """One forward pass for ``batch``, one token per row, events out, finished rows
        marked done (the caller filters them out)."""
        start = time.perf_counter()
        rows = [self._rows[rid] for rid in batch.request_ids]
        if self.adapters.lora.names:
            self.adapters.lora.set_rows([row.adapter for row in rows])
        device = self.device
        output = self.model(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
            past_key_values=batch.past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens, logprobs, alternatives = self._choose(rows, output.logits[:, -1, :])

        outgoing = []
        try:
            for i, (row, token) in enumerate(zip(rows, tokens)):
                event, finished = self._accept(row, token, logprobs[i], alternatives[i])
                outgoing.append((row.handle, event))
                if token != self.eos_id or row.ignore_eos:
                    batch.token_ids[i].append(token)
                if finished:
                    batch.done[i] = True
                    row.handle.finished = True
                    del self._rows[row.handle.id]
                    self.stats["finished"] += 1
        finally:   # even if a row failed: the rows that finished must hear so
            self._send(outgoing)

        # What the next step feeds: as in helpers.generate_next_token (lesson 03).
        running = torch.tensor([not done for done in batch.done], dtype=torch.long, device=device)
        new_tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        batch.input_ids = torch.where(running == 1, new_tokens, self.pad_id).unsqueeze(1)
        batch.attention_mask = torch.cat([batch.attention_mask.to(device), running.unsqueeze(1)],
                                         dim=1)
        batch.position_ids = batch.attention_mask.sum(dim=1, keepdim=True) - 1
        batch.past_key_values = output.past_key_values

        self.stats[f"steps_{kind}"] += 1
        self.stats["tokens"] += len(rows)
        self.stats["busy_seconds"] += time.perf_counter() - start

    # --- choosing tokens --------------------------------------------------------------------

    def _choose(self, rows: list[_Row], logits: torch.Tensor):
        """Each row's next token, its log probability and (if asked) the top alternatives."""
        logits = logits.float()
        vocab = logits.shape[-1]
        if any(row.needs_processing for row in rows):
            logits = logits.clone()
            for i, row in enumerate(rows):
                if row.penalty is not None:
                    seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.ids)),
                                        device=logits.device)
                    values = logits[i, seen]
                    logits[i, seen] = torch.where(values > 0, values / row.penalty,
                                                  values * row.penalty)
                if row.guide is not None:
                    budget = row.max_new_tokens - row.count - 1   # tokens left after this one
                    logits[i] += self.json.mask(row.schema, row.guide, vocab, budget,
                                                logits.device)
        logprobs = torch.log_softmax(logits, dim=-1)
        choice = logits.argmax(dim=-1)
        tokens = choice.tolist()
        chosen_logprobs = logprobs.gather(1, choice.unsqueeze(1)).squeeze(1).tolist()
        alternatives: list[list | None] = [None] * len(rows)
        for i, row in enumerate(rows):
            if row.guide is not None and not torch.isfinite(logits[i]).any():
                tokens[i], chosen_logprobs[i] = self.eos_id, 0.0   # nothing allowed: stop
                continue
            if row.sampling:
                tokens[i], chosen_logprobs[i] = self._sample(row, logits[i])
            k = row.params.alternatives
            if k:
                top = logprobs[i].topk(min(k, vocab))
                alternatives[i] = [{"id": int(t), "text": self.tokenizer.decode([int(t)]),
                                    "logprob": _finite(float(lp))}
                                   for lp, t in zip(top.values.tolist(), top.indices.tolist())]
        return tokens, chosen_logprobs, alternatives

    @staticmethod
    def _sample(row: _Row, logits: torch.Tensor) -> tuple[int, float]:
        """Draw a token from one row's logits: temperature, then top-k, then top-p, with the
        request's own seeded generator (so the same seed gives the same answer)."""
        params = row.params
        x = logits.detach().to("cpu", torch.float32)
        if params.temperature is not None:
            x = x / params.temperature
        if params.top_k is not None and params.top_k < x.numel():
            kth = torch.topk(x, params.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if params.top_p is not None and params.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            before = probs.cumsum(dim=-1) - probs      # mass of the tokens ranked above
            drop = before >= params.top_p
            drop[0] = False                            # the most likely token always stays
            x = x.clone()
            x[order[drop]] = float("-inf")
        probs = torch.softmax(x, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=row.generator))
        return token, float(torch.log_softmax(x, dim=-1)[token])

    def _accept(self, row: _Row, token: int, logprob: float,
                alternatives) -> tuple[TokenEvent, bool]:
        """Add a token to a row: its text, its event, and whether the row is finished."""
        row.count += 1
        reason = None
        stop_at = None
        is_eos = token == self.eos_id and not row.ignore_eos
        if is_eos:
            piece, special = self.eos_text, True
            reason = "eos_token"
        else:
            row.ids.append(token)
            if row.guide is not None:
                row.guide.advance(token, return_tokens=False)
            full = self.tokenizer.decode(row.ids)
            special = token in self.special_ids
            if row.params.stop:
                start = max(0, row.full_len - row.longest_stop + 1)
                found = [(full.find(s, start), s) for s in row.params.stop]
                found = [(pos, s) for pos, s in found if pos >= 0]
                if found:
                    stop_at = min(found)[0]
                    reason = "stop_sequence"
            row.full_len = len(full)
            if reason is None and row.count >= row.max_new_tokens:
                reason = "length"
            # A token may end inside a multi-byte character: hold its text back until the
            # character is complete (or the request ends).
            if full.endswith("\ufffd") and reason is None:
                piece = ""
            else:
                piece = full[len(os.path.commonprefix([full, row.text])):]
                row.text = full
        if reason is None and row.count >= row.max_new_tokens:
            reason = "length"
        out = {"id": int(token), "text": piece, "logprob": _finite(logprob), "special": special}
        if alternatives is not None:
            out["alternative_tokens"] = alternatives
        finish = None
        if reason is not None:
            final_text = row.text if not is_eos and row.text else self.tokenizer.decode(row.ids)
            finish = {"finish_reason": reason, "generated_text": final_text,
                      "generated_tokens": row.count, "prompt_tokens": len(row.prompt_ids),
                      "seed": row.handle.prepared.seed, "stop_at": stop_at,
                      "seconds": time.perf_counter() - row.handle.submitted}
        return TokenEvent(out, finish), reason is not None

    # --- delivery and failures ----------------------------------------------------------------

    def _send(self, outgoing: list[tuple[Handle, object]]) -> None:
        """Hand events to their event loops: one call per loop for the whole step."""
        by_loop = defaultdict(list)
        for handle, event in outgoing:
            by_loop[handle.loop].append((handle.queue, handle.tag, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:          # that event loop is closed: nobody is listening
                pass

    def _fail_rows(self, message: str) -> None:
        outgoing = [(row.handle, ErrorEvent(message)) for row in self._rows.values()]
        for row in self._rows.values():
            row.handle.finished = True
        self._rows.clear()
        self._batch = Batch.empty()
        self.stats["failed"] += len(outgoing)
        self._send(outgoing)

    def _shutdown(self) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        message = "the server is shutting down"
        self._send([(h, ErrorEvent(message, status=503)) for h in waiting if not h.cancelled])
        self._fail_rows(message)

    # --- description ----------------------------------------------------------------------

    def info(self) -> dict:
        model = self.model
        return {
            "model_id": self.model_id,
            "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "model_device_type": self.device.type,
            "model_pipeline_tag": "text-generation",
            "max_batch_size": self.max_batch_size,
            "max_concurrent_requests": self.max_batch_size + self.max_queue,
            "max_queue": self.max_queue,
            "max_input_length": self.max_input_tokens,
            "max_total_tokens": self.max_total_tokens,
            "default_max_new_tokens": self.default_max_new_tokens,
            "max_best_of": 1,
            "max_stop_sequences": 4,
            "adapters_folder": str(self.adapters.folder) if self.adapters.folder else None,
            "adapters_available": self.adapters.available(),
            "adapters_loaded": self.adapters.loaded,
            "json_mode": JsonMode.available(),
        }


def _finite(value: float) -> float:
    """JSON has no -inf: a log probability of an impossible token is reported as -1e9."""
    return value if value > -1e9 else -1e9
