"""The engine: one scheduler thread that owns the model and runs continuous batching with a
different adapter on every row. (Lesson 07.)

The HTTP side never touches the model. It checks a request (``Engine.prepare``: tokens,
limits, adapter, grammar), hands it over (``Engine.submit``) and reads the request's events
from an ``asyncio.Queue``. The scheduler thread repeats ``Engine.step``, which is lesson 03's
continuous batching with the very functions of ``helpers.batching``:

1. drop the rows whose client went away (``filter_batch``);
2. admit waiting requests into the free slots: their prompts become a new batch
   (``batch_from_token_ids``, the tokenized form of ``init_batch``), are read in one forward
   pass (the prefill, ``generate_next_token``) and join the running batch (``merge_batches``);
3. run one decode step for the whole batch (``generate_next_token``) and drop the rows that
   finished (``filter_batch``).

What the server adds is *how each row's token is chosen*: ``generate_next_token`` takes a
chooser, and ours applies each row's own rules (greedy or seeded sampling, penalties, logit
bias, a grammar's mask: ``helpers.server.sampling``), then hands every token to its request's
queue (``loop.call_soon_threadsafe``: the queue belongs to the event loop's thread). Each
row's adapter is set with ``MultiLora.set_rows`` (lesson 06) before every forward pass.

Greedy decoding gives exactly what ``helpers.generate_sequential`` gives for the same prompt
(and, with an adapter, what generating that row alone with the adapter gives): batching
changes when answers come, not what they are. ``helpers.server.paged_engine`` runs the same
engine on lesson 08's paged KV cache.

The server runs the engine in a process of its own by default (``engine_process.py``: the
scheduler then never waits for the HTTP side's thread to give back Python's lock); the engine
is the same either way. Errors are the engine's own (``helpers.server.errors``); the HTTP side
turns them into status codes. A row whose token cannot be chosen (NaN logits from extreme
settings, a failing grammar) fails alone: the other rows of the batch carry on.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import traceback
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import torch

from ..batching import (Batch, batch_from_token_ids, filter_batch, generate_next_token,
                        merge_batches, model_context)
from ..lora import ADAPTERS_DIR
from . import sampling
from .adapters import AdapterStore
from .detok import IncrementalDecoder
from .errors import EngineError, InvalidRequest, Overloaded, TooLarge, Unavailable
from .grammar import Grammars
from .metrics import Metrics
from .options import DEFAULTS
from .protocol import GenerationParams

log = logging.getLogger("helpers.server")

#: A prompt longer than this many characters per allowed token is refused before it is
#: tokenized (see ``Engine.max_prompt_chars``).
CHARS_PER_TOKEN_MARGIN = 2
#: Memory one request may take for its prompt's log probabilities (``prompt_logprobs``): the
#: logits of every prompt position, in float32, about three times over (the model's output,
#: a float copy, the log-softmax).
MAX_SCORING_BYTES = 256 * 2**20
SCORING_COPIES = 3


# --- what travels between the HTTP side and the scheduler --------------------------------

@dataclass
class Prepared:
    """A checked request, ready for the scheduler (made by ``Engine.prepare``)."""

    prompt: str                  # the prompt as text (decoded, when given as token ids)
    input_ids: list[int]
    params: GenerationParams
    max_new_tokens: int
    adapter: str | None          # the name loaded in the engine's MultiLora, None for none
    grammar: object | None       # the compiled grammar (grammar.Compiled), None for free text
    seed: int | None             # the sampling seed (drawn at random when not given)


@dataclass
class PromptEvent:
    """The prompt's tokens with their log probabilities (first: None), before any token."""

    tokens: list[dict]


@dataclass
class TokenEvent:
    """One generated token. ``finish`` is set on a request's last token: finish_reason,
    generated_text, generated_tokens, prompt_tokens, seed, stop_at (where a matched stop
    sequence starts in the text, else None) and seconds. With ``max_new_tokens`` 0 the one
    event has ``token`` None."""

    token: dict | None
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


def send_events(outgoing: list[tuple[Handle, object]]) -> None:
    """Hand events to their requests' event loops: one call per loop for all of them (each
    call wakes that loop's thread once). Called by the scheduler after each step, and by
    ``EngineProcess`` for the events that come from its engine's process."""
    by_loop = defaultdict(list)
    for handle, event in outgoing:
        by_loop[handle.loop].append((handle.queue, handle.tag, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:          # that event loop is closed: nobody is listening
            pass


# --- one row of the running batch -----------------------------------------------------------

class _Row:
    """The per-request state the scheduler keeps while a request is in the batch."""

    def __init__(self, handle: Handle):
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
        self.error: BaseException | None = None      # set if this row failed (alone)
        self.matcher = None
        if prepared.grammar is not None:
            try:
                self.matcher = prepared.grammar.matcher()
            except Exception as err:
                self.error = err
        self.penalty = (params.repetition_penalty
                        if params.repetition_penalty not in (None, 1.0) else None)
        # ignore_eos_token: EOS is an ordinary token that does not end the request (as in TGI
        # and LoRAX, and as generate_sequential(stop_at_eos=False)). Not with a grammar, where
        # EOS is only allowed once the answer is complete.
        self.ignore_eos = params.ignore_eos_token and self.matcher is None
        self.ids: list[int] = []       # generated tokens (EOS only with ignore_eos)
        self.counts: Counter = Counter()   # how often each of them was generated
        self.count = 0                 # generated tokens, EOS included
        self.text = ""                 # text handed out so far
        self.decoder = None            # its IncrementalDecoder (detok.py), from the first token
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        self.choice: tuple | None = None   # (token, logprob, alternatives) of this step

    @property
    def adjusts_logits(self) -> bool:
        params = self.params
        return (self.penalty is not None or self.matcher is not None or bool(params.logit_bias)
                or bool(params.frequency_penalty) or bool(params.presence_penalty))


class Engine:
    """Continuous batching with per-row adapters, sampling rules and grammars. (Lesson 07.)

    model, tokenizer:  from ``helpers.load_model`` (any causal LM; the tokenizer pads with EOS)
    adapters_dir:      folder of local adapters, one sub-folder each (default: the course's)
    max_batch_size:    rows generated together (the slots of lesson 03)
    max_input_tokens:  longest prompt accepted, in tokens (default: half the context)
    max_total_tokens:  prompt + new tokens of one request (default: the model's context)
    max_queue:         requests that may wait for a slot; one more is refused (Overloaded)
    default_max_new_tokens: what a request that does not say gets (capped by the room left)

    ``start()`` starts the scheduler thread, ``stop()`` ends it (waiting and running requests
    get an error event). Use ``prepare`` then ``submit`` from the HTTP side; ``cancel`` drops a
    request whose client went away.
    """

    kv_cache = "contiguous"

    def __init__(self, model, tokenizer, *, adapters_dir=ADAPTERS_DIR,
                 max_batch_size: int = DEFAULTS["max_batch_size"],
                 max_input_tokens: int | None = DEFAULTS["max_input_tokens"],
                 max_total_tokens: int | None = DEFAULTS["max_total_tokens"],
                 max_queue: int = DEFAULTS["max_queue"],
                 default_max_new_tokens: int = DEFAULTS["default_max_new_tokens"],
                 model_id: str | None = None):
        max_input_tokens, max_total_tokens = _check_limits(
            model, max_batch_size, max_input_tokens, max_total_tokens, max_queue,
            default_max_new_tokens)
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
        self.vocab_size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
        self._encoder = _own_encoder(tokenizer)
        # A token never stands for more characters than the longest token of the vocabulary.
        longest = max(len(token) for token in tokenizer.get_vocab())
        self.max_prompt_chars = max_input_tokens * longest * CHARS_PER_TOKEN_MARGIN

        self._model_lock = threading.RLock()    # held during a step, and to add an adapter
        self._cond = threading.Condition()      # guards the waiting queue and the flags
        self._encode_lock = threading.Lock()    # only for tokenizers without a Rust backend
        self._waiting: deque[Handle] = deque()
        self._rows: dict[int, _Row] = {}
        self._batch = Batch.empty()
        self._next_id = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.adapters = AdapterStore(model, adapters_dir, self._model_lock)
        self.grammars = Grammars(tokenizer)
        self.stats = defaultdict(float)
        self.metrics = Metrics()                # latency histograms for /metrics

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

    def prepare(self, prompt: str | list[int], params: GenerationParams) -> Prepared:
        """Check a request against the server's limits and make it ready: tokenize the prompt
        (or check its token ids), load the adapter if needed, compile the grammar. Raises
        ``errors.EngineError``. May block (loading an adapter, compiling a grammar): call it
        from a worker thread."""
        ids = self._prompt_ids(prompt, params.truncate)
        if len(ids) > self.max_input_tokens:
            raise InvalidRequest(f"the prompt must have at most {self.max_input_tokens} tokens "
                                 f"(--max-input-tokens); given: {len(ids)} tokens")
        # Scoring a prompt keeps one row of logits per prompt token: bounded, so that a short
        # request to a model with a large vocabulary cannot take gigabytes.
        scoring_bytes = len(ids) * self.vocab_size * 4 * SCORING_COPIES
        if params.prompt_logprobs and scoring_bytes > MAX_SCORING_BYTES:
            most = MAX_SCORING_BYTES // (self.vocab_size * 4 * SCORING_COPIES)
            raise TooLarge(f"the prompt's log probabilities can be computed for at most {most} "
                           f"prompt tokens with this model's vocabulary of {self.vocab_size}; "
                           f"given: {len(ids)} tokens")
        max_new = self._max_new_tokens(len(ids), params.max_new_tokens)
        bad_bias = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise InvalidRequest(f"logit_bias names token id {bad_bias[0]}, outside the "
                                 f"vocabulary (0 to {self.vocab_size - 1})")
        adapter = self.adapters.resolve(params.adapter_id, params.adapter_source,
                                        params.api_token)
        grammar = self._compile_grammar(params.grammar, max_new)
        seed = None
        if params.sampling:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return Prepared(text, list(ids), params, max_new, adapter, grammar, seed)

    def _prompt_ids(self, prompt, truncate: int | None) -> list[int]:
        """The prompt's token ids (the last ``truncate`` of them, if given). A text prompt too
        long to fit is refused by its length in characters, before any tokenizing."""
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequest("the prompt (`inputs`, `prompt`) must not be empty")
            ids = self._tokenize(prompt, truncate)
        elif isinstance(prompt, (list, tuple)):
            ids = self._check_token_ids(prompt, truncate)
        else:
            raise InvalidRequest("the prompt must be a string or a list of token ids")
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]                 # keep the end, nearest the answer
        if not ids:
            raise InvalidRequest("the prompt (`inputs`, `prompt`) has no tokens")
        return list(ids)

    def _tokenize(self, text: str, truncate: int | None) -> list[int]:
        """Tokenize a prompt, bounding the work by its length first.

        Without ``truncate`` (or with one above --max-input-tokens) a prompt longer than
        ``max_prompt_chars`` cannot fit: refused at once. With ``truncate`` only the end of
        the text is tokenized, as many characters as ``truncate + 1`` tokens can stand for
        (the tokens kept are the same, unless the cut falls inside one very long word)."""
        keep = truncate if truncate is not None and truncate <= self.max_input_tokens else None
        if keep is None and len(text) > self.max_prompt_chars:
            raise InvalidRequest(f"the prompt must have at most {self.max_input_tokens} tokens "
                                 f"(--max-input-tokens); given: {len(text)} characters, more "
                                 f"than that many tokens can hold")
        if keep is not None:
            chars_per_token = self.max_prompt_chars // self.max_input_tokens
            text = text[-(keep + 1) * chars_per_token:]
        if self._encoder is not None:     # our own copy: no lock, nothing shared to mutate
            return self._encoder.encode(text, add_special_tokens=True).ids
        with self._encode_lock:
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def _check_token_ids(self, ids, truncate: int | None) -> list[int]:
        """A prompt given as token ids (OpenAI's token-id prompts): every id in the vocabulary."""
        if len(ids) > self.max_input_tokens and truncate is None:
            raise InvalidRequest(f"the prompt must have at most {self.max_input_tokens} tokens "
                                 f"(--max-input-tokens); given: {len(ids)} tokens")
        for i, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int) \
                    or not 0 <= token < self.vocab_size:
                raise InvalidRequest(f"prompt token {i} is {token!r}: token ids are integers "
                                     f"from 0 to {self.vocab_size - 1}")
        return list(ids)

    def _max_new_tokens(self, n_prompt: int, asked: int | None) -> int:
        room = self.max_total_tokens - n_prompt
        if asked is None:
            return min(self.default_max_new_tokens, room)
        if asked > room:
            raise InvalidRequest(f"prompt tokens + new tokens (`max_new_tokens`, `max_tokens`) "
                                 f"must be <= {self.max_total_tokens} (--max-total-tokens); given: "
                                 f"{n_prompt} prompt tokens and {asked} new tokens")
        return asked

    def _compile_grammar(self, grammar, max_new: int):
        """The compiled grammar (None for free text, or when nothing is generated)."""
        if grammar is None or max_new == 0:
            return None
        kind, value = grammar
        compiled = self.grammars.compile(kind, value)
        shortest = compiled.min_tokens
        if shortest is not None and shortest + 1 > max_new:       # + 1: the EOS after it
            raise InvalidRequest(f"the shortest answer this {kind} grammar allows takes "
                                 f"{shortest} tokens of this model, plus the end token; "
                                 f"`max_new_tokens` is {max_new}")
        return compiled

    def submit(self, prepared: Prepared, loop, queue, tag: int = 0) -> Handle:
        """Queue a prepared request; its events will go to ``queue`` (an asyncio.Queue of
        ``loop``). Raises ``Overloaded`` when the queue is full, ``Unavailable`` when the
        engine is not running."""
        with self._cond:
            if not self.healthy:
                raise Unavailable("the server is not running (its scheduler stopped)")
            if len(self._waiting) >= self.max_queue:
                self.stats["rejected_overloaded"] += 1
                raise Overloaded(f"Model is overloaded: {len(self._waiting)} requests are "
                                 f"already waiting (--max-queue {self.max_queue}); retry later")
            handle = Handle(self._next_id, prepared, loop, queue, tag)
            self._next_id += 1
            self._waiting.append(handle)
            self.stats["requests"] += 1
            self._cond.notify_all()
        return handle

    def release(self, prepared: Prepared) -> None:
        """The HTTP side will submit ``prepared`` no more. Nothing to do here, where it is an
        ordinary object (``EngineProcess`` lets go of it in the engine's process)."""

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
            except Exception:   # the model failed: fail the rows, keep serving
                log.error("generation failed:\n%s", traceback.format_exc())
                self._fail_rows("generation failed; the server's log has the details")

    def step(self) -> None:
        """One turn of the scheduler loop: lesson 03's continuous batching, in which every row
        may use its own adapter (lesson 06) and its own way of choosing tokens. Runs in the
        scheduler thread, which holds the model lock. Lesson 07 shows this method."""
        # 1. Rows whose client went away leave before any work is spent on them.
        self._drop_cancelled()
        # 2. Free slots go to waiting requests. Their prompts become a new batch (lesson 03's
        #    init_batch), read in one forward pass, the prefill, which gives each its first
        #    token (generate_next_token, called by _generate); the rows still running merge
        #    into the running batch. (Requests that want their prompt scored get a batch of
        #    their own, which keeps the logits of every position.)
        with self._cond:
            new = self._take_waiting()
        for prefill, keep in self._new_batches(new):
            self._generate(prefill, "prefill", logits_to_keep=keep)
            self._batch = merge_batches(self._batch, filter_batch(prefill))
        # 3. One decode step: every running row, new or old, gets its next token; the rows
        #    that finished leave the batch and free their slots for the next turn.
        if len(self._batch):
            self._generate(self._batch, "decode")
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

    def _new_batches(self, handles: list[Handle]) -> list[tuple[Batch, int]]:
        """The new requests as batches (lesson 03's ``init_batch``, from token ids), each with
        the logits its prefill keeps: the last position only, or every position (0) for the
        requests that asked for their prompt's log probabilities, which get a batch each so
        that nobody else's logits are kept."""
        for handle in handles:
            self._rows[handle.id] = _Row(handle)
        scoring = [[h] for h in handles if h.prepared.params.prompt_logprobs]
        others = [h for h in handles if not h.prepared.params.prompt_logprobs]
        batches = []
        # Each scoring request alone: its logits are bounded in prepare (MAX_SCORING_BYTES).
        for group, keep in [(others, 1)] + [(one, 0) for one in scoring]:
            if group:
                batch = batch_from_token_ids(
                    [h.prepared.input_ids for h in group],
                    [max(1, h.prepared.max_new_tokens) for h in group],
                    [h.id for h in group], self.pad_id)
                batches.append((batch, keep))
        return batches

    def _generate(self, batch: Batch, kind: str, logits_to_keep: int = 1) -> None:
        """Lesson 03's ``generate_next_token`` on ``batch`` with each row's adapter and our
        chooser; then every row's event goes out and finished rows are marked done."""
        start = time.perf_counter()
        self.stats["rows_max"] = max(self.stats["rows_max"], len(self._rows))
        rows = [self._rows[rid] for rid in batch.request_ids]
        if self.adapters.lora.names:
            self.adapters.lora.set_rows([row.adapter for row in rows])
        outgoing: list = []

        def choose(logits):
            return self._choose(rows, logits, outgoing, score=logits_to_keep == 0)

        # EOS is handled by _accept (per row: ignore_eos, grammars), not by the helper.
        generate_next_token(self.model, self.tokenizer, batch, stop_at_eos=False,
                            choose=choose, logits_to_keep=logits_to_keep)
        self._hand_out(batch, list(enumerate(rows)), outgoing)
        self.stats[f"steps_{kind}"] += 1
        self.stats["tokens"] += len(rows)
        self.stats["busy_seconds"] += time.perf_counter() - start

    # --- choosing tokens --------------------------------------------------------------------

    def _choose(self, rows: list[_Row], logits: torch.Tensor, outgoing: list,
                score: bool = False) -> list[int]:
        """The chooser given to ``generate_next_token``: each row's next token, by its own
        rules. ``logits`` is (rows, positions, vocab); ``score``: the prefill kept every
        position to score the prompts (a one-token prompt has one position and is scored
        too). A row whose choice fails gets
        ``error`` set (and padding as its token): it fails alone."""
        if score:
            for i, row in enumerate(rows):
                # The prompt sits in the last columns (padding is on the left).
                self._guarded(row, self._score_prompt, row, logits[i, -len(row.prompt_ids):],
                              outgoing)
        last = logits[:, -1, :].float()
        if any(row.adjusts_logits for row in rows):
            last = last.clone()
            for i, row in enumerate(rows):
                if row.adjusts_logits:
                    self._guarded(row, self._adjust, row, last[i])
        logprobs = torch.log_softmax(last, dim=-1)
        tokens = sampling.greedy(last)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=last.device)[:, None])
        chosen = chosen.squeeze(1).tolist()
        broken = (torch.isnan(last).any(dim=-1) | torch.isposinf(last).any(dim=-1)).tolist()
        for i, row in enumerate(rows):
            if broken[i]:
                self._guarded(row, sampling.check_finite, last[i])
            if row.error is None:
                self._guarded(row, self._pick, row, tokens[i], chosen[i], last[i], logprobs[i])
        return [row.choice[0] if row.error is None and row.choice[0] is not None
                else self.pad_id for row in rows]

    @staticmethod
    def _guarded(row: _Row, function, *args) -> None:
        """Run one row's part of the choice; an exception fails that row, not the batch."""
        if row.error is not None:
            return
        try:
            function(*args)
        except Exception as err:
            row.error = err

    def _score_prompt(self, row: _Row, logits: torch.Tensor, outgoing: list) -> None:
        """The PromptEvent: every prompt token's logprob, from the logits at its positions."""
        tokens = sampling.prompt_logprobs(logits, row.prompt_ids, self.tokenizer,
                                          row.params.alternatives)
        outgoing.append((row.handle, PromptEvent(tokens)))

    def _adjust(self, row: _Row, logits: torch.Tensor) -> None:
        """A row's logits after its penalties, its logit bias and its grammar's mask."""
        params = row.params
        if row.penalty is not None:
            sampling.repetition_penalty(logits, row.prompt_ids + row.ids, row.penalty)
        if params.frequency_penalty or params.presence_penalty:
            sampling.frequency_presence_penalty(logits, row.counts, params.frequency_penalty,
                                                params.presence_penalty)
        if params.logit_bias:
            sampling.add_logit_bias(logits, params.logit_bias)
        if row.matcher is not None:
            budget = row.max_new_tokens - row.count - 1   # tokens left after this one
            row.matcher.apply(logits, budget)

    def _pick(self, row: _Row, token: int, logprob: float, logits: torch.Tensor,
              logprobs: torch.Tensor) -> None:
        """Set ``row.choice``: the greedy ``token`` unless the row samples, its logprob, and
        the top alternatives if asked."""
        if row.max_new_tokens == 0:                 # prefill only: nothing is chosen
            row.choice = (None, None, None)
            return
        if row.matcher is not None and not torch.isfinite(logits).any():
            row.choice = (self.eos_id, 0.0, None)   # the grammar allows nothing: stop
            return
        if row.sampling:
            token, logprob = sampling.sample(logits, row.params, row.generator)
        alternatives = None
        if row.params.alternatives:
            alternatives = sampling.top_alternatives(logprobs, row.params.alternatives,
                                                     self.tokenizer)
        row.choice = (token, logprob, alternatives)

    # --- handing out tokens ---------------------------------------------------------------

    def _hand_out(self, batch, rows: list[tuple[int, _Row]], outgoing: list) -> None:
        """After a forward pass: each row's event (its token, or its failure) goes to its
        client; finished and failed rows are marked done (the caller filters them out)."""
        try:
            for i, row in rows:
                if row.error is None:
                    try:
                        event, finished = self._accept(row, *row.choice)
                    except Exception as err:      # this row's text or grammar: it alone fails
                        row.error = err
                if row.error is not None:
                    event, finished = self._row_failed(row), True
                outgoing.append((row.handle, event))
                if finished:
                    batch.done[i] = True
                    row.handle.finished = True
                    del self._rows[row.handle.id]
                    self.stats["finished"] += 1
        finally:   # even if a row failed: the rows that finished must hear so
            send_events(outgoing)

    def _row_failed(self, row: _Row) -> ErrorEvent:
        err = row.error
        log.warning("request %s failed alone: %s", row.handle.id,
                    "".join(traceback.format_exception(err)).strip())
        self.stats["failed"] += 1
        if isinstance(err, EngineError):
            return ErrorEvent(f"generation failed: {err.message}")
        return ErrorEvent("generation failed while choosing the next token; the server's log "
                          "has the details")

    def _accept(self, row: _Row, token: int | None, logprob: float | None,
                alternatives) -> tuple[TokenEvent, bool]:
        """Add a token to a row: its text, its event, and whether the row is finished."""
        if row.max_new_tokens == 0:
            return TokenEvent(None, self._finish(row, "length", None)), True
        row.count += 1
        self.metrics.observe_token(row.handle)
        reason, stop_at = None, None
        is_eos = token == self.eos_id and not row.ignore_eos
        if is_eos:
            piece, special, reason = self.eos_text, True, "eos_token"
        else:
            row.ids.append(token)
            row.counts[token] += 1
            if row.matcher is not None:
                row.matcher.advance(token)
            special = token in self.special_ids
            piece, stop_at = self._add_text(row)
            if stop_at is not None:
                reason = "stop_sequence"
        if reason is None and row.count >= row.max_new_tokens:
            reason = "length"
        out = {"id": int(token), "text": piece, "logprob": sampling.finite(logprob),
               "special": special}
        if alternatives is not None:
            out["alternative_tokens"] = alternatives
        finish = self._finish(row, reason, stop_at) if reason is not None else None
        return TokenEvent(out, finish), reason is not None

    def _add_text(self, row: _Row) -> tuple[str, int | None]:
        """The row's new piece of text, and where a stop sequence starts in the row's text
        (None if none matched). Only the last few tokens are decoded (``detok.py``): decoding
        the whole answer at every token would cost more the longer it gets."""
        if row.decoder is None:
            row.decoder = IncrementalDecoder(self.tokenizer)
        # A token may end inside a multi-byte character: the decoder holds its text back until
        # the character is complete, or until the request ends.
        piece = row.decoder.add(row.ids[-1])
        if row.count >= row.max_new_tokens:
            piece += row.decoder.flush()
        stop_at = None
        if row.params.stop and piece:
            start = max(0, len(row.text) - row.longest_stop + 1)
            text = row.text + piece
            found = [pos for pos in (text.find(s, start) for s in row.params.stop) if pos >= 0]
            stop_at = min(found) if found else None
        row.text += piece
        return piece, stop_at

    def _finish(self, row: _Row, reason: str, stop_at: int | None) -> dict:
        return {"finish_reason": reason, "generated_text": self.tokenizer.decode(row.ids),
                "generated_tokens": row.count, "prompt_tokens": len(row.prompt_ids),
                "seed": row.handle.prepared.seed, "stop_at": stop_at,
                "seconds": time.perf_counter() - row.handle.submitted}

    # --- delivery and failures ----------------------------------------------------------------

    def _fail_rows(self, message: str) -> None:
        outgoing = [(row.handle, ErrorEvent(message)) for row in self._rows.values()]
        for row in self._rows.values():
            row.handle.finished = True
        self._rows.clear()
        self._batch = Batch.empty()
        self.stats["failed"] += len(outgoing)
        send_events(outgoing)

    def _shutdown(self) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        message = "the server is shutting down"
        send_events([(h, ErrorEvent(message, status=503)) for h in waiting if not h.cancelled])
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
            "adapters_folder": self.adapters.folder_name,   # its name only, never the path
            "adapters_available": self.adapters.available(),
            "adapters_loaded": self.adapters.loaded,
            "json_mode": Grammars.available(),
            "kv_cache": self.kv_cache,
            "engine": "thread",             # EngineProcess says "process"
        }


def _check_limits(model, max_batch_size, max_input_tokens, max_total_tokens, max_queue,
                  default_max_new_tokens) -> tuple[int, int]:
    """ValueError for limits that make no sense; returns (max_input_tokens, max_total_tokens)
    with their defaults filled in."""
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
    return max_input_tokens, max_total_tokens


def _own_encoder(tokenizer):
    """A private copy of a fast tokenizer's Rust tokenizer, for prompts. Its ``encode`` holds
    Python's lock while it runs, and nobody else changes this copy's settings (transformers
    sets truncation and padding on the shared one at each call), so threads can use it
    without a lock of ours. None for a tokenizer without one (then a lock is used)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    own = Tokenizer.from_str(backend.to_str())
    own.no_truncation()
    own.no_padding()
    # transformers may add special tokens itself for some models: use the copy only if it
    # tokenizes like the tokenizer does.
    sample = "Jack and Jill went up the hill, 1 2 3 :) \n\u00e9"
    if own.encode(sample, add_special_tokens=True).ids != \
            tokenizer(sample, add_special_tokens=True)["input_ids"]:
        return None
    return own
