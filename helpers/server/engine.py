"""The engine: one scheduler thread that owns the model and runs continuous batching with a
different adapter on every row. (Lesson 07.)

It is read top to bottom in four parts:

1. ``Sequence``: one sequence the scheduler generates, and the only record of its state (its
   tokens, its text, its grammar, its sampler) and of whether it is finished.
2. ``Engine``'s life cycle and its door: ``submit`` (admission, ``admission.py``: tokens,
   limits, adapter, grammar, seeds) queues a submission's sequences and answers once with a
   ``Handle``; ``cancel`` drops them when the client goes away.
3. The scheduler thread, which repeats ``Engine.step``, the same turn whatever the KV layout
   and however the model runs: drop the cancelled, admit (``scheduling.py``: the admission
   policy; the KV layout's room), run the layout's forward passes (``kv.py``: lesson 03's
   padded batch or lesson 08's paged cache, whose passes run through ``runner.py``: eager,
   compiled or CUDA graphs), choose each row's token and hand it out.
4. Choosing each row's token by its own rules (greedy or seeded sampling, penalties, logit
   bias, a grammar's mask: ``sampling.py``), and handing the events out: after every
   forward pass, one call to ``deliver`` with its events.

Greedy decoding gives exactly what ``helpers.generate_sequential`` gives for the same prompt
(and, with an adapter, what generating that row alone with the adapter gives): batching
changes when answers come, not what they are.

The server runs the engine in a process of its own by default (``engine_process.py``: the
scheduler then never waits for the HTTP side's thread to give back Python's lock); the engine
is the same either way. Errors are the engine's own (``helpers.server.errors``); the HTTP side
turns them into status codes. A row whose token cannot be chosen (NaN logits from extreme
settings, a failing grammar) fails alone: the other rows of the batch carry on.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import Counter, defaultdict, deque

import torch

from ..batching import model_context
from ..lora import ADAPTERS_DIR
from . import sampling
from .adapters import AdapterStore
from .admission import Admission, Admitted
from .sampling import TokenChooser, guarded
from .contract import (ErrorEvent, Finish, GenerationParams, Handle, Sink, Submission,
                       TokenEvent, deliver)
from .tokens import IncrementalDecoder
from .errors import EngineError, Overloaded, Unavailable
from .grammar import Grammars
from .kv import make_kv
from .options import DEFAULTS
from .scheduling import POLICIES, take_waiting

log = logging.getLogger("helpers.server")


# --- 1. one sequence -------------------------------------------------------------------------

class Sequence:
    """One sequence of a submission (a prompt, or one copy of it for ``best_of``/``n``): what
    the scheduler knows of it, from the queue to its last token. It alone decides when it is
    finished (``accept``); the engine copies that into the batch."""

    def __init__(self, number: int, handle: Handle, sequence: int, admitted: Admitted,
                 params: GenerationParams, seed: int | None, tokenizer, eos_id: int | None):
        self.id = number                    # the engine's number for it (its batch row's id)
        self.handle = handle                # the submission it belongs to
        self.sequence = sequence            # which of the submission's sequences it is
        self.params = params
        self.prompt_ids = admitted.input_ids
        self.max_new_tokens = admitted.max_new_tokens
        self.adapter = admitted.adapter
        self.seed = seed
        self.submitted = time.perf_counter()
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.generator = None
        if params.sampling:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(seed)
        self.error: BaseException | None = None      # set if this row failed (alone)
        self.matcher = None
        if admitted.grammar is not None:
            try:
                self.matcher = admitted.grammar.matcher()
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
        self.decoder = None            # its IncrementalDecoder (tokens.py), from the first token
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        self.choice: tuple | None = None   # (token, logprob, alternatives) of this step
        self.finished = False

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled

    @property
    def adjusts_logits(self) -> bool:
        params = self.params
        return (self.penalty is not None or self.matcher is not None or bool(params.logit_bias)
                or bool(params.frequency_penalty) or bool(params.presence_penalty))

    def accept(self, token: int | None, logprob: float | None, alternatives,
               special_ids: set, eos_text: str) -> TokenEvent:
        """Add this step's token: its text, its event, and whether the request is finished."""
        if self.max_new_tokens == 0:
            self.finished = True
            return TokenEvent(None, self._finish("length", None))
        self.count += 1
        reason, stop_at = None, None
        if token == self.eos_id and not self.ignore_eos:
            piece, special, reason = eos_text, True, "eos_token"
        else:
            self.ids.append(token)
            self.counts[token] += 1
            if self.matcher is not None:
                self.matcher.advance(token)
            special = token in special_ids
            piece, stop_at = self._add_text()
            if stop_at is not None:
                reason = "stop_sequence"
        if reason is None and self.count >= self.max_new_tokens:
            reason = "length"
        out = {"id": int(token), "text": piece, "logprob": sampling.finite(logprob),
               "special": special}
        if alternatives is not None:
            out["alternative_tokens"] = alternatives
        self.finished = reason is not None
        return TokenEvent(out, self._finish(reason, stop_at) if self.finished else None)

    def fail(self) -> ErrorEvent:
        """The event of a request that failed alone (``error`` is set)."""
        self.finished = True
        err = self.error
        log.warning("request %s failed alone: %s", self.id,
                    "".join(traceback.format_exception(err)).strip())
        if isinstance(err, EngineError):
            return ErrorEvent(f"generation failed: {err.message}")
        return ErrorEvent("generation failed while choosing the next token; the server's log "
                          "has the details")

    def _add_text(self) -> tuple[str, int | None]:
        """The new piece of text, and where a stop sequence starts in the text (None if none
        matched). Only the last few tokens are decoded (``tokens.IncrementalDecoder``): decoding the whole
        answer at every token would cost more the longer it gets."""
        if self.decoder is None:
            self.decoder = IncrementalDecoder(self.tokenizer)
        # A token may end inside a multi-byte character: the decoder holds its text back until
        # the character is complete, or until the request ends.
        piece = self.decoder.add(self.ids[-1])
        if self.count >= self.max_new_tokens:
            piece += self.decoder.flush()
        stop_at = None
        stops = self.params.stop
        if stops and piece:
            start = max(0, len(self.text) - self.longest_stop + 1)
            text = self.text + piece
            found = [pos for pos in (text.find(s, start) for s in stops) if pos >= 0]
            stop_at = min(found) if found else None
        self.text += piece
        return piece, stop_at

    def _finish(self, reason: str, stop_at: int | None) -> Finish:
        return Finish(reason, self.tokenizer.decode(self.ids), self.count,
                      len(self.prompt_ids), self.seed, stop_at,
                      time.perf_counter() - self.submitted)


# --- 2. the engine: life cycle and door ----------------------------------------------------

class Engine:
    """Continuous batching with per-row adapters, sampling rules and grammars. (Lesson 07.)

    model, tokenizer:  from ``helpers.load_model`` (any causal LM; the tokenizer pads with EOS)
    adapters_dir:      folder of local adapters, one sub-folder each (default: the course's)
    max_batch_size:    rows generated together (the slots of lesson 03)
    max_input_tokens:  longest prompt accepted, in tokens (default: half the context)
    max_total_tokens:  prompt + new tokens of one request (default: the model's context)
    max_queue:         requests that may wait for a slot; one more is refused (Overloaded)
    default_max_new_tokens: what a request that does not say gets (capped by the room left)
    admission:         the order in which waiting requests are admitted: "fcfs" or
                       "shortest" (``scheduling.py``)
    kv_cache:          the KV layout (``kv.py``): "paged" (lesson 08, the server's default)
                       or "contiguous" (lesson 03)
    layout:            the paged layout's options (``kv.make_kv``): block_size,
                       prefix_caching, max_prefill_tokens, num_blocks, and how its passes
                       run (``runner.Runner``): compile, cuda_graphs, graph_sizes, capture.
                       Compiling and capturing happen here, before the engine answers
                       anything, and never after.

    ``start()`` starts the scheduler thread, ``stop()`` ends it (waiting and running requests
    get an error event). ``submit`` and ``cancel`` are the HTTP side's (``contract.EngineClient``).
    """

    restarts = 0              # never: a scheduler thread is not restarted (EngineProcess is)

    def __init__(self, model, tokenizer, *, adapters_dir=ADAPTERS_DIR,
                 max_batch_size: int = DEFAULTS["max_batch_size"],
                 max_input_tokens: int | None = DEFAULTS["max_input_tokens"],
                 max_total_tokens: int | None = DEFAULTS["max_total_tokens"],
                 max_queue: int = DEFAULTS["max_queue"],
                 default_max_new_tokens: int = DEFAULTS["default_max_new_tokens"],
                 admission: str = DEFAULTS["admission"], kv_cache: str = DEFAULTS["kv_cache"],
                 model_id: str | None = None, **layout):
        max_input_tokens, max_total_tokens = _check_limits(
            model, max_batch_size, max_input_tokens, max_total_tokens, max_queue,
            default_max_new_tokens)
        if admission not in POLICIES:
            raise ValueError(f"admission must be one of {', '.join(POLICIES)}, got {admission!r}")
        if kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"kv_cache must be 'paged' or 'contiguous', got {kv_cache!r}")
        if kv_cache == "contiguous" and layout:
            raise ValueError(f"{', '.join(layout)}: options of the paged KV layout, not of "
                             f"kv_cache='contiguous'")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id or getattr(model.config, "_name_or_path", "") or "model"
        self.max_batch_size = max_batch_size
        self.max_input_tokens = max_input_tokens
        self.max_total_tokens = max_total_tokens
        self.max_queue = max_queue
        self.default_max_new_tokens = default_max_new_tokens
        self.policy_name, self.policy = admission, POLICIES[admission]
        self.device = model.device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.special_ids = set(tokenizer.all_special_ids)
        self.eos_text = (tokenizer.convert_ids_to_tokens(self.eos_id)
                         if self.eos_id is not None else "")
        self.vocab_size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
        #: Each row's next token by its own rules (``sampling.py``).
        self.choose = TokenChooser(tokenizer, self.eos_id, self.pad_id)

        self._model_lock = threading.RLock()    # held during a step, and to add an adapter
        self._cond = threading.Condition()      # guards the waiting queue and the flags
        self._waiting: deque[Sequence] = deque()
        self._rows: dict[int, Sequence] = {}    # the running sequences, by id
        self._next_id = 0
        self._next_handle = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.adapters = AdapterStore(model, adapters_dir, self._model_lock)
        self.admission = Admission(tokenizer, self.adapters, max_input_tokens=max_input_tokens,
                                   max_total_tokens=max_total_tokens,
                                   default_max_new_tokens=default_max_new_tokens,
                                   vocab_size=self.vocab_size)
        self.max_prompt_chars = self.admission.max_prompt_chars
        self.stats = defaultdict(float)
        #: Where the running rows' keys and values live, and the passes of a turn (``kv.py``).
        self.kv = make_kv(kv_cache, model, tokenizer, self.pad_id,
                          max_batch_size=max_batch_size, max_total_tokens=max_total_tokens,
                          lora=self.adapters.lora, **layout)
        #: Where every step's events go: ``deliver([(sequence, event), ...])``. Here, to each
        #: submission's sink; the engine's process replaces it with one message to the HTTP
        #: process (``engine_process.py``).
        self.deliver = deliver_to_sinks

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
    def kv_cache(self) -> str:
        """The KV layout's name: "paged" or "contiguous"."""
        return self.kv.name

    @property
    def healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._failure is None)

    def submit(self, submission: Submission, sink: Sink | None = None,
               tag: object = None) -> Handle:
        """Admit every prompt of ``submission`` (``admission.py``: may block, loading an
        adapter or compiling a grammar: call it from a worker thread) and queue
        ``submission.copies`` requests of each; their events go to ``sink`` (``tag``: the
        caller's name for the submission, kept on the handle). Raises
        ``errors.EngineError`` (``Overloaded`` when the queue is full, ``Unavailable`` when
        the engine is not running), and then nothing was queued."""
        admitted = self.admission.admit(submission)
        params, copies = submission.params, submission.copies
        # Each prompt its own seeds (the request's seed, if it gave one, for each prompt).
        seeds = [seed for _ in admitted for seed in self.admission.seeds(params, copies)]
        with self._cond:
            if not self.healthy:
                raise Unavailable("the server is not running (its scheduler stopped)")
            # Room for all of its sequences (a submission alone may always wait).
            if self._waiting and len(self._waiting) + len(seeds) > self.max_queue:
                self.stats["rejected_overloaded"] += 1
                raise Overloaded(f"Model is overloaded: {len(self._waiting)} requests are "
                                 f"already waiting (--max-queue {self.max_queue}); retry later")
            handle = Handle(self._next_handle, [a.text for a in admitted], len(seeds), seeds,
                            sink, tag)
            self._next_handle += 1
            requests = [Sequence(self._next_id + sequence, handle, sequence,
                                admitted[sequence // copies], params, seed, self.tokenizer,
                                self.eos_id)
                        for sequence, seed in enumerate(seeds)]
            self._next_id += len(requests)
            self._waiting.extend(requests)
            self.stats["requests"] += handle.sequences
            self._cond.notify_all()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Forget a submission (its client went away): its requests leave the batch before the
        next step, and their slots go to the next waiting requests."""
        with self._cond:
            if handle.finished or handle.cancelled:
                return
            handle.cancelled = True
            self._cond.notify_all()

    def snapshot(self) -> dict:
        """Counters and the current load, for /metrics and /info."""
        with self._cond:
            state = {"waiting": len(self._waiting), "running": len(self._rows)}
        return {**state, **self.stats, **self.kv.snapshot()}

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
            "adapters_folder": self.adapters.folder_name,   # its name only, never the path
            "adapters_available": self.adapters.available(),
            "adapters_loaded": self.adapters.loaded,
            "json_mode": Grammars.available(),
            "admission": self.policy_name,
            **self.kv.info(),
            "engine": "thread",             # EngineProcess says "process"
            "engine_restarts": self.restarts,
        }

    def tokenize(self, text: str) -> list[dict]:
        return self.admission.tokenize(text)

    def adapters_available(self) -> list[str]:
        return self.adapters.available()

    def adapters_loaded(self) -> list[str]:
        return self.adapters.loaded

    # --- 3. the scheduler thread ----------------------------------------------------------

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
        """One turn of the scheduler, the same for every KV layout and every way of running
        the model. Runs in the scheduler thread, which holds the model lock. Lesson 07 shows
        this method."""
        # 1. Rows whose client went away leave before any work is spent on them.
        self._drop_cancelled()
        # 2. Admit: free slots take waiting requests, in the order the admission policy picks
        #    them, each with the room the KV layout promises it (a request the layout cannot
        #    hold yet waits, and so do those behind it).
        if self.kv.admits():
            with self._cond:
                new = take_waiting(self._waiting, self.max_batch_size - len(self._rows),
                                   self.kv.admit, self.policy, self.stats)
            self._rows.update((sequence.id, sequence) for sequence in new)
            self._score_prompts(new)
        # 3. Run, choose, hand out: the layout's forward passes of this turn (lesson 03's
        #    reads the new prompts in a pass of their own, then decodes every row; lesson 08's
        #    reads prompts and decodes in one pass). After each pass every row that read all
        #    its tokens gets its next one, by its own rules, and its client gets it at once;
        #    the rows that finished leave, and their room goes back to the layout.
        for batch in self.kv.passes():
            self._generate(batch)

    def _drop_cancelled(self) -> None:
        gone = {rid for rid, row in self._rows.items() if row.cancelled}
        if gone:
            self.kv.drop(gone)
            for rid in gone:
                del self._rows[rid]
            self.stats["cancelled"] += len(gone)

    def _score_prompts(self, new: list[Sequence]) -> None:
        """The PromptEvent of every new sequence that asked for it (``prompt_logprobs``),
        from a forward pass of its prompt alone, with its adapter: its prefill may be split
        into chunks, or skipped for a cached prefix, and keeps only the last position."""
        outgoing = []
        for row in new:
            if row.params.prompt_logprobs:
                guarded(row, self._score_alone, row, outgoing)
        if outgoing:             # (in its own process, every delivery is a message)
            self.deliver(outgoing)

    def _score_alone(self, row: Sequence, outgoing: list) -> None:
        lora = self.adapters.lora
        ids = torch.tensor([row.prompt_ids], device=self.device)
        with lora.rows([row.adapter] if lora.names else None):   # then the rows as they were
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
        self.choose.score_prompt(row, logits, outgoing)

    def _generate(self, batch) -> None:
        """One forward pass of the layout over ``batch``, each row with its adapter; the rows
        that read all their tokens get their next one, chosen by ``TokenChooser``; then every
        such row's event goes out and the finished rows are marked done."""
        start = time.perf_counter()
        kind = "decode" if batch.prefilled else "prefill"
        self.stats["rows_max"] = max(self.stats["rows_max"], len(self._rows))
        outgoing, chosen = [], []

        def choose(logits, rows):
            picked = [self._rows[batch.request_ids[i]] for i in rows]
            chosen.extend(zip(rows, picked))
            return self.choose(picked, logits, outgoing)

        lora = self.adapters.lora
        adapters = None
        if lora.names:
            adapters = (lora, [self._rows[rid].adapter for rid in batch.request_ids])
        self.kv.forward(batch, adapters, choose)
        self._hand_out(batch, chosen, outgoing)
        self.stats[f"steps_{kind}"] += 1
        self.stats["tokens"] += len(chosen)
        self.stats["busy_seconds"] += time.perf_counter() - start

    # --- 4. handing out tokens --------------------------------------------------------------

    def _hand_out(self, batch, rows: list[tuple[int, Sequence]], outgoing: list) -> None:
        """After a forward pass: each row's event (its token, or its failure) goes out; the
        requests that finished leave ``_rows``, and their batch rows are marked done (the
        caller filters them out)."""
        try:
            for i, row in rows:
                if row.error is None:
                    try:
                        event = row.accept(*row.choice, self.special_ids, self.eos_text)
                    except Exception as err:      # this row's text or grammar: it alone fails
                        row.error = err
                if row.error is not None:
                    event = row.fail()
                    self.stats["failed"] += 1
                outgoing.append((row, event))
                batch.done[i] = row.finished
                if row.finished:
                    del self._rows[row.id]
                    self.stats["finished"] += 1
        finally:   # even if a row failed: the rows that finished must hear so
            self.deliver(outgoing)

    def _fail_rows(self, message: str) -> None:
        outgoing = [(row, ErrorEvent(message)) for row in self._rows.values()]
        self._rows.clear()
        self.kv.clear()
        self.stats["failed"] += len(outgoing)
        self.deliver(outgoing)

    def _shutdown(self) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        message = "the server is shutting down"
        self.deliver([(r, ErrorEvent(message, status=503)) for r in waiting if not r.cancelled])
        self._fail_rows(message)


def deliver_to_sinks(outgoing: list[tuple[Sequence, object]]) -> None:
    """A step's events to their submissions' sinks (``contract.deliver``)."""
    deliver([(sequence.handle, sequence.sequence, event) for sequence, event in outgoing])


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
