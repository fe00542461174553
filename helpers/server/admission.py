"""Admission: a submission checked against the server's limits and made ready for the
scheduler, and the order in which the waiting ones join the batch. (Lesson 07.)

All that a request costs before the model happens in ``Admission.admit``, in the submitting
thread, never in the scheduler. Who joins first is a policy (``--admission``): ``fcfs`` (as in
vLLM and TGI; a large request is never starved) or ``shortest`` prompt first.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from ..lora import NO_ADAPTER
from .adapters import AdapterStore
from .contract import GenerationParams, Submission
from .errors import InvalidRequest, TooLarge
from .grammar import Grammars
from .tokens import CHARS_PER_MESSAGE, encode_chat, encode_text, own_encoder

#: A prompt longer than this many characters per allowed token is refused before it is
#: tokenized (see ``Admission.max_prompt_chars``).
CHARS_PER_TOKEN_MARGIN = 2
#: Memory one request may take for its ``prompt_logprobs``: every prompt position's float32
#: logits, about three times over (the model's output, a float copy, the log-softmax).
MAX_SCORING_BYTES = 256 * 2**20
SCORING_COPIES = 3


@dataclass
class Admitted:
    """One prompt of a submission, ready for the scheduler."""

    text: str                    # the prompt as text (decoded, when given as token ids)
    input_ids: list[int]
    max_new_tokens: int
    adapter: str | None          # the name loaded in the engine's MultiLora, None for none
    grammar: object | None       # the compiled grammar (grammar.Compiled), None for free text


class Admission:
    """The checks and preparation of ``Engine.submit``, with the engine's limits."""

    def __init__(self, tokenizer, adapters: AdapterStore, *, max_input_tokens: int,
                 max_total_tokens: int, default_max_new_tokens: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.grammars = Grammars(tokenizer)
        self.max_input_tokens = max_input_tokens
        self.max_total_tokens = max_total_tokens
        self.default_max_new_tokens = default_max_new_tokens
        self.vocab_size = vocab_size
        # Client text never becomes a special token (``tokens.py``); a private copy of the
        # Rust tokenizer needs no lock (None: the tokenizer has none, ``encode_text`` locks).
        self._encoder = own_encoder(tokenizer)
        # A token never stands for more characters than the longest token of the vocabulary.
        longest = max(len(token) for token in tokenizer.get_vocab())
        self.max_prompt_chars = max_input_tokens * longest * CHARS_PER_TOKEN_MARGIN

    def admit(self, submission: Submission) -> list[Admitted]:
        """Every prompt of ``submission``, checked and prepared; one bad prompt refuses all."""
        params = submission.params       # checked at the door (GenerationParams.check)
        prompts = submission.prompts
        if submission.messages is not None:       # refused by its size before the template
            size = sum(len(m["content"]) + CHARS_PER_MESSAGE for m in submission.messages)
            if size > self.max_prompt_chars:
                raise TooLarge(f"the {len(submission.messages)} messages count as {size} "
                               f"characters ({CHARS_PER_MESSAGE} per message for its role and "
                               f"separators); this server reads prompts of at most "
                               f"{self.max_input_tokens} tokens")
            prompts = [encode_chat(self.tokenizer, submission.messages)]
        if not prompts:
            raise InvalidRequest("the request holds no prompt")
        outside = [t for t in params.logit_bias if t >= self.vocab_size]
        if outside:           # the range was checked at the door; the vocabulary is the model's
            raise InvalidRequest(f"logit_bias names token id {outside[0]}, outside the "
                                 f"vocabulary (0 to {self.vocab_size - 1})")
        return [self._admit_one(prompt, params) for prompt in prompts]

    def seeds(self, params: GenerationParams, copies: int) -> list[int | None]:
        """The sampling seeds of one prompt's copies (None for greedy): the request's seed (or
        a random one), then hashes of it and the copy's number. Not ``seed + number``: seeds
        1234 and 1235 would then share samples, which an evaluation would count twice."""
        if not params.sampling:
            return [None] * copies
        first = params.seed if params.seed is not None else secrets.randbits(63)
        return [first] + [int.from_bytes(hashlib.blake2b(f"{first}/{number}".encode(),
                                                         digest_size=8).digest(), "big")
                          for number in range(1, copies)]

    def _admit_one(self, prompt, params: GenerationParams) -> Admitted:
        ids = self._prompt_ids(prompt, params.truncate)
        if len(ids) > self.max_input_tokens:
            raise InvalidRequest(f"the prompt must have at most {self.max_input_tokens} tokens "
                                 f"(--max-input-tokens); given: {len(ids)} tokens")
        # Bounded: a short request to a model with a large vocabulary could take gigabytes.
        most = MAX_SCORING_BYTES // (self.vocab_size * 4 * SCORING_COPIES)
        if params.prompt_logprobs and len(ids) > most:
            raise TooLarge(f"the prompt's log probabilities can be computed for at most {most} "
                           f"prompt tokens with this model's vocabulary of {self.vocab_size}; "
                           f"given: {len(ids)} tokens")
        room = self.max_total_tokens - len(ids)
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = min(self.default_max_new_tokens, room)
        elif max_new > room:
            raise InvalidRequest(f"prompt tokens + new tokens (`max_new_tokens`, `max_tokens`) "
                                 f"must be <= {self.max_total_tokens} (--max-total-tokens); given: "
                                 f"{len(ids)} prompt tokens and {max_new} new tokens")
        adapter = None
        if params.adapter_id not in (None, "", NO_ADAPTER):
            adapter = self.adapters.resolve(params.adapter_id, params.adapter_source,
                                            params.api_token)
        grammar = self._compile_grammar(params.grammar, max_new)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return Admitted(text, ids, max_new, adapter, grammar)

    def _prompt_ids(self, prompt, truncate: int | None) -> list[int]:
        """The prompt's token ids (the last ``truncate`` of them, if given). A text prompt too
        long to fit is refused by its length in characters, before any tokenizing."""
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequest("the prompt (`inputs`, `prompt`) must not be empty")
            ids = self._tokenize(prompt, truncate)
        elif isinstance(prompt, (list, tuple)):          # OpenAI's token-id prompts
            for i, token in enumerate(prompt):
                if isinstance(token, bool) or not isinstance(token, int) \
                        or not 0 <= token < self.vocab_size:
                    raise InvalidRequest(f"prompt token {i} is {token!r}: token ids are "
                                         f"integers from 0 to {self.vocab_size - 1}")
            ids = prompt
        else:
            raise InvalidRequest("the prompt must be a string or a list of token ids")
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]                 # keep the end, nearest the answer
        if not ids:
            raise InvalidRequest("the prompt (`inputs`, `prompt`) has no tokens")
        return list(ids)

    def _tokenize(self, text: str, truncate: int | None) -> list[int]:
        """Tokenize a prompt, bounding the work by its length first: with a ``truncate`` (within
        --max-input-tokens), only as many of its last characters as ``truncate + 1`` tokens can
        stand for are read; without, one longer than ``max_prompt_chars`` is refused."""
        if truncate is not None and truncate <= self.max_input_tokens:
            chars_per_token = self.max_prompt_chars // self.max_input_tokens
            text = text[-(truncate + 1) * chars_per_token:]
        elif len(text) > self.max_prompt_chars:
            raise InvalidRequest(f"the prompt must have at most {self.max_input_tokens} tokens "
                                 f"(--max-input-tokens); given: {len(text)} characters, more "
                                 f"than that many tokens can hold")
        return encode_text(self._encoder or self.tokenizer, text)

    def tokenize(self, text: str) -> list[dict]:
        """TGI's ``/tokenize``: the tokens of ``text`` read as a prompt is read (its limits
        too), each with its id, its text and where that text starts and stops in ``text``."""
        ids = self._tokenize(text, None)
        if self._encoder is not None:
            offsets = self._encoder.encode(text, add_special_tokens=True).offsets
        else:
            offsets = self.tokenizer(text, split_special_tokens=True,
                                     return_offsets_mapping=True)["offset_mapping"]
        return [{"id": token, "text": text[start:stop], "start": start, "stop": stop}
                for token, (start, stop) in zip(ids, offsets)]

    def _compile_grammar(self, grammar, max_new: int):
        """The compiled grammar (None for free text, or when nothing is generated)."""
        if grammar is None or max_new == 0:
            return None
        compiled = self.grammars.compile(*grammar)
        shortest = compiled.min_tokens
        if shortest is not None and shortest + 1 > max_new:       # + 1: the EOS after it
            raise InvalidRequest(f"the shortest answer this {grammar[0]} grammar allows takes "
                                 f"{shortest} tokens of this model, plus the end token; "
                                 f"`max_new_tokens` is {max_new}")
        return compiled


# --- who is admitted first -----------------------------------------------------------------

def first_come(waiting):
    return waiting[0]


def shortest_prompt(waiting):
    """The request with the shortest prompt (the first of them, on a tie)."""
    return min(waiting, key=lambda sequence: len(sequence.prompt_ids))


POLICIES = {"fcfs": first_come, "shortest": shortest_prompt}


def take_waiting(waiting, free: int, fits, policy, stats) -> list:
    """Up to ``free`` requests taken from ``waiting`` (a deque) in the order ``policy`` picks
    them, while ``fits(request)`` finds room for each (it reserves that room); those whose
    client went away are dropped on the way (and counted in ``stats["cancelled"]``)."""
    taken = []
    while waiting and len(taken) < free:
        sequence = policy(waiting)
        if sequence.cancelled:
            waiting.remove(sequence)
            stats["cancelled"] += 1
            continue
        if not fits(sequence):
            break
        waiting.remove(sequence)
        taken.append(sequence)
    return taken
