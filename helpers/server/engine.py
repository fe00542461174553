"""The engine: one scheduler thread that owns the model and runs continuous batching with a
different adapter on every row. (Lesson 07.)

``submit`` admits and queues a submission (``admission.py``); the scheduler thread repeats
``Engine.step`` (``kv.py``'s passes, ``sampling.py``'s choices). Greedy answers are exactly
``helpers.generate_sequential``'s: batching changes when answers come, not what they are.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import defaultdict, deque
from itertools import count

import torch

from ..compilation import CAPTURE_SIZES
from ..lora import ADAPTERS_DIR
from .adapters import AdapterStore
from .admission import POLICIES, Admission, take_waiting
from .contract import ErrorEvent, Handle, PromptEvent, Sink, Submission, deliver
from .errors import Overloaded, Unavailable
from .grammar import Grammars
from .kv import make_kv
from .options import DEFAULTS, check
from .sampling import Sequence, TokenChooser, guarded, prompt_logprobs

log = logging.getLogger("helpers.server")


class Engine:
    """Continuous batching with per-row adapters, sampling rules and grammars. (Lesson 07.)
    The keywords are the server's options (``options.check`` judges them; ``graph_sizes``:
    ``--cuda-graph-sizes``); ``layout``: the paged layout's others (``kv.make_kv``)."""

    restarts = 0              # never: a scheduler thread is not restarted (EngineProcess is)

    def __init__(self, model, tokenizer, *, adapters_dir=ADAPTERS_DIR,
                 max_batch_size: int = DEFAULTS["max_batch_size"],
                 max_input_tokens: int | None = DEFAULTS["max_input_tokens"],
                 max_total_tokens: int | None = DEFAULTS["max_total_tokens"],
                 max_queue: int = DEFAULTS["max_queue"],
                 default_max_new_tokens: int = DEFAULTS["default_max_new_tokens"],
                 admission: str = DEFAULTS["admission"], kv_cache: str = DEFAULTS["kv_cache"],
                 model_id: str | None = None, compile="off", cuda_graphs="off",
                 graph_sizes=CAPTURE_SIZES, **layout):
        judged = check(dict(max_batch_size=max_batch_size, max_input_tokens=max_input_tokens,
                            max_total_tokens=max_total_tokens, max_queue=max_queue,
                            default_max_new_tokens=default_max_new_tokens, admission=admission,
                            kv_cache=kv_cache, compile=compile, cuda_graphs=cuda_graphs,
                            cuda_graph_sizes=graph_sizes),
                       model, device=None if layout.get("capture") else model.device)
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id or getattr(model.config, "_name_or_path", "") or "model"
        self.max_batch_size = max_batch_size
        self.max_input_tokens = judged["max_input_tokens"]
        self.max_total_tokens = judged["max_total_tokens"]
        self.max_queue = max_queue
        self.kv_cache = kv_cache                # the KV layout's name: "paged" or "contiguous"
        self.default_max_new_tokens = default_max_new_tokens
        self.policy_name, self.policy = admission, POLICIES[admission]
        self.device = model.device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.special_ids = set(tokenizer.all_special_ids)
        self.eos_text = (tokenizer.convert_ids_to_tokens(self.eos_id)
                         if self.eos_id is not None else "")
        self.vocab_size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
        self.choose = TokenChooser(tokenizer, self.eos_id, self.pad_id)

        self._model_lock = threading.RLock()    # held during a step, and to add an adapter
        self._cond = threading.Condition()      # guards the waiting queue and the flags
        self._waiting: deque[Sequence] = deque()
        self._rows: dict[int, Sequence] = {}    # the running sequences, by id
        self._sequence_ids = count()            # the engine's number for each sequence
        self._handle_ids = count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.adapters = AdapterStore(model, adapters_dir, self._model_lock)
        self.admission = Admission(tokenizer, self.adapters,
                                   max_input_tokens=self.max_input_tokens,
                                   max_total_tokens=self.max_total_tokens,
                                   default_max_new_tokens=default_max_new_tokens,
                                   vocab_size=self.vocab_size)
        self.max_prompt_chars = self.admission.max_prompt_chars
        self.stats = defaultdict(float)
        if kv_cache == "paged":
            layout.update(compile=judged["compile"], cuda_graphs=judged["cuda_graphs"],
                          graph_sizes=judged["cuda_graph_sizes"])
        self.kv = make_kv(kv_cache, model, tokenizer, self.pad_id,
                          max_batch_size=max_batch_size, max_total_tokens=self.max_total_tokens,
                          lora=self.adapters.lora, **layout)
        self.deliver = deliver_to_sinks     # where events go (the engine's process sets its own)

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

    def submit(self, submission: Submission, sink: Sink | None = None,
               tag: object = None) -> Handle:
        """Admit every prompt of ``submission`` (may block: call it from a worker thread) and
        queue ``submission.copies`` sequences of each, their events for ``sink``. Raises
        ``errors.EngineError``, and then nothing was queued."""
        admitted = self.admission.admit(submission)
        params, copies = submission.params, submission.copies
        seeds = [seed for _ in admitted for seed in self.admission.seeds(params, copies)]
        with self._cond:
            if not self.healthy:
                raise Unavailable("the server is not running (its scheduler stopped)")
            # Room for all of its sequences (a submission alone may always wait).
            if self._waiting and len(self._waiting) + len(seeds) > self.max_queue:
                self.stats["rejected_overloaded"] += 1
                raise Overloaded(f"Model is overloaded: {len(self._waiting)} requests are "
                                 f"already waiting (--max-queue {self.max_queue}); retry later")
            handle = Handle(next(self._handle_ids), [a.text for a in admitted], len(seeds),
                            seeds, sink, tag)
            self._waiting.extend(Sequence(next(self._sequence_ids), handle, sequence,
                                          admitted[sequence // copies], params, seed,
                                          self.tokenizer, self.eos_id)
                                 for sequence, seed in enumerate(seeds))
            self.stats["requests"] += handle.sequences
            self._cond.notify_all()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Forget a submission (its client went away): its rows leave before the next step."""
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
        return {
            "model_id": self.model_id,
            "model_dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
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

    # --- the scheduler thread ----------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
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
        except BaseException as err:     # a bug in the scheduler itself: say so in /health
            self._failure = f"{type(err).__name__}: {err}"
            log.error("the scheduler stopped:\n%s", traceback.format_exc())
            raise
        finally:
            self._shutdown()

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
        """Each new ``prompt_logprobs`` sequence's PromptEvent, from a pass of its prompt alone
        (its prefill may be chunked or cached)."""
        outgoing = []
        for row in new:
            if row.params.prompt_logprobs:
                guarded(row, self._score_alone, row, outgoing)
        if outgoing:
            self.deliver(outgoing)

    def _score_alone(self, row: Sequence, outgoing: list) -> None:
        lora = self.adapters.lora
        ids = torch.tensor([row.prompt_ids], device=self.device)
        with lora.rows([row.adapter] if lora.names else None):   # then the rows as they were
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
        tokens = prompt_logprobs(logits, row.prompt_ids, self.tokenizer, row.params.alternatives)
        outgoing.append((row, PromptEvent(tokens)))

    def _generate(self, batch) -> None:
        """One pass of the layout over ``batch``, each row with its adapter and its choice."""
        start = time.perf_counter()
        kind = "decode" if batch.prefilled else "prefill"      # before the pass changes it
        self.stats["rows_max"] = max(self.stats["rows_max"], len(self._rows))
        chosen = []

        def choose(logits, rows):
            picked = [self._rows[batch.request_ids[i]] for i in rows]
            chosen.extend(zip(rows, picked))
            return self.choose(picked, logits)

        lora = self.adapters.lora
        adapters = None
        if lora.names:
            adapters = (lora, [self._rows[rid].adapter for rid in batch.request_ids])
        self.kv.forward(batch, adapters, choose)
        self._hand_out(batch, chosen)
        self.stats[f"steps_{kind}"] += 1
        self.stats["tokens"] += len(chosen)
        self.stats["busy_seconds"] += time.perf_counter() - start

    def _hand_out(self, batch, rows: list[tuple[int, Sequence]]) -> None:
        """Each row's event (its token, or its failure) goes out; the finished ones leave."""
        outgoing = []
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
    deliver([(sequence.handle, sequence.sequence, event) for sequence, event in outgoing])
