"""Each row's next token by the rules its request sets, and the sequence that keeps them.
(Lesson 07.)

``TokenChooser`` adjusts each row's logits (penalties, bias, grammar), then takes the likeliest
token or draws one with the row's own seeded generator (the same seed, the same answer,
whatever runs beside it). A new sampling rule is a field of ``GenerationParams`` and a filter
here, called from ``sample``.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter

import torch

from .admission import Admitted
from .contract import ErrorEvent, Finish, GenerationParams, Handle, TokenEvent
from .errors import EngineError, GenerationFailed
from .tokens import IncrementalDecoder

log = logging.getLogger("helpers.server")


def repetition_penalty(logits: torch.Tensor, seen_ids, penalty: float) -> None:
    """Make every token already seen less likely, in place, by transformers' and TGI's rule: a
    positive logit divided by ``penalty``, a negative one multiplied."""
    seen = torch.tensor(sorted(set(seen_ids)), dtype=torch.long, device=logits.device)
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)


def frequency_presence_penalty(logits: torch.Tensor, counts: Counter, frequency: float,
                               presence: float) -> None:
    """OpenAI's penalties over the tokens generated so far, in place: a token's logit loses
    ``frequency`` for each time it was generated, and ``presence`` once if it was at all."""
    add_logit_bias(logits, {token: -(frequency * n + presence) for token, n in counts.items()})


def add_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI's ``logit_bias``: a fixed amount added to the logits of listed token ids."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)


def check_finite(logits: torch.Tensor) -> None:
    """A row's logits may hold -inf (forbidden tokens) but never NaN or +inf: those come from
    extreme settings (a temperature of 1e-40, a penalty of 1e-40) and cannot be sampled."""
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise GenerationFailed("the next token's probabilities are not numbers (NaN or "
                               "infinity); extreme sampling settings are the usual cause")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Only the ``k`` likeliest tokens stay (ties with the k-th stay too)."""
    if k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling: the likeliest tokens stay until their mass reaches ``p``."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    return _keep_mass(logits, order, torch.softmax(sorted_logits, dim=-1), p)


def _keep_mass(logits: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, p: float):
    """``logits`` with the tokens in ``order`` (``probs``: theirs) kept until their mass
    reaches ``p``: the one that crosses it, and the first, stay."""
    drop = probs.cumsum(dim=-1) - probs >= p        # the mass of the tokens ranked above
    drop[0] = False
    return logits.index_fill(0, order[drop], float("-inf"))


def min_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Min-p (vLLM's and transformers'): the tokens at least ``p`` times as likely as the
    likeliest stay."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.max(), float("-inf"))


def typical_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Typical sampling (Meister et al., 2022): the tokens whose surprise (-log prob) is
    nearest the entropy stay, until their mass reaches ``p``."""
    if p >= 1.0:
        return logits
    logprobs = torch.log_softmax(logits, dim=-1)
    probs = logprobs.exp()
    entropy = -(probs * logprobs.nan_to_num(neginf=0.0)).sum()
    distance = (-logprobs - entropy).abs()
    order = torch.argsort(distance)                # most typical first
    return _keep_mass(logits, order, probs[order], p)


def sample(logits: torch.Tensor, params, generator: torch.Generator) -> tuple[int, float]:
    """Draw one token from a row's logits reshaped by the request's rules: the token and its
    log probability under the distribution it was drawn from."""
    x = logits.detach().to("cpu", torch.float32)
    if params.temperature is not None:
        x = x / params.temperature
    for keep, value in ((top_k_filter, params.top_k), (top_p_filter, params.top_p),
                        (typical_filter, params.typical_p), (min_p_filter, params.min_p)):
        if value is not None:
            x = keep(x, value)
    check_finite(x)
    logprobs = torch.log_softmax(x, dim=-1)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])


def finite(value: float) -> float:
    """JSON has no -inf: a log probability of an impossible token is reported as -1e9."""
    return value if value > -1e9 else -1e9


def top_alternatives(logprobs: torch.Tensor, n: int, tokenizer) -> list[dict]:
    """The ``n`` likeliest tokens of a row and their log probabilities, likeliest first."""
    top = logprobs.topk(min(n, logprobs.numel()))
    return [{"id": int(t), "text": tokenizer.decode([int(t)]), "logprob": finite(float(lp))}
            for lp, t in zip(top.values.tolist(), top.indices.tolist())]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], tokenizer,
                    alternatives: int | None = None) -> list[dict]:
    """Every prompt token with its log probability given the tokens before it (None for the
    first, as in TGI and OpenAI's ``echo``), from the logits at the prompt's positions; with
    ``alternatives``, the top alternatives too (evaluation harnesses read them)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    # Position i predicts token i + 1.
    values = logprobs[range(len(prompt_ids) - 1), prompt_ids[1:]].tolist()
    out = [{"id": int(prompt_ids[0]), "text": tokenizer.decode([prompt_ids[0]]), "logprob": None}]
    for i, (token, value) in enumerate(zip(prompt_ids[1:], values)):
        out.append({"id": int(token), "text": tokenizer.decode([token]),
                    "logprob": finite(value)})
        if alternatives:
            out[-1]["alternative_tokens"] = top_alternatives(logprobs[i], alternatives, tokenizer)
    return out


def guarded(row, function, *args) -> None:
    """Run one row's part of the choice unless it failed already; an exception fails that row
    (``row.error``), not the batch."""
    if row.error is not None:
        return
    try:
        function(*args)
    except Exception as err:
        row.error = err


class TokenChooser:
    """``chooser(rows, logits)``: each row's next token by its own rules. (Lesson 07.)"""

    def __init__(self, tokenizer, eos_id: int | None, pad_id: int):
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.pad_id = pad_id

    def __call__(self, rows: list, logits: torch.Tensor) -> list[int]:
        last = logits[:, -1, :].float()
        if any(row.adjusts_logits for row in rows):
            last = last.clone()
            for i, row in enumerate(rows):
                if row.adjusts_logits:
                    guarded(row, self._adjust, row, last[i])
        logprobs = torch.log_softmax(last, dim=-1)
        tokens = last.argmax(dim=-1).tolist()
        chosen = logprobs[range(len(rows)), tokens].tolist()
        broken = (torch.isnan(last).any(dim=-1) | torch.isposinf(last).any(dim=-1)).tolist()
        for i, row in enumerate(rows):
            if broken[i]:
                guarded(row, check_finite, last[i])
            guarded(row, self._pick, row, tokens[i], chosen[i], last[i], logprobs[i])
        return [row.choice[0] if row.error is None and row.choice[0] is not None
                else self.pad_id for row in rows]

    def _adjust(self, row, logits: torch.Tensor) -> None:
        params = row.params
        if row.penalty is not None:
            repetition_penalty(logits, row.prompt_ids + row.ids, row.penalty)
        if params.frequency_penalty or params.presence_penalty:
            frequency_presence_penalty(logits, row.counts, params.frequency_penalty,
                                       params.presence_penalty)
        if params.logit_bias:
            add_logit_bias(logits, params.logit_bias)
        if row.matcher is not None:
            row.matcher.apply(logits, row.max_new_tokens - row.count - 1)   # tokens left after it

    def _pick(self, row, token: int, logprob: float, logits: torch.Tensor,
              logprobs: torch.Tensor) -> None:
        """Set ``row.choice``: (token, logprob, alternatives), ``token`` unless the row samples."""
        if row.max_new_tokens == 0:                 # prefill only: nothing is chosen
            row.choice = (None, None, None)
            return
        if row.matcher is not None and not torch.isfinite(logits).any():
            row.choice = (self.eos_id, 0.0, None)   # the grammar allows nothing: stop
            return
        if row.generator is not None:              # the row samples
            token, logprob = sample(logits, row.params, row.generator)
        alternatives = None
        if row.params.alternatives:
            alternatives = top_alternatives(logprobs, row.params.alternatives, self.tokenizer)
        row.choice = (token, logprob, alternatives)


class Sequence:
    """One sequence of a submission (a prompt, or a copy of it for ``best_of``/``n``), from the
    queue to its last token; ``accept`` alone decides when it is finished."""

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
        self.generator = torch.Generator().manual_seed(seed) if params.sampling else None
        self.error: BaseException | None = None      # set if this row failed (alone)
        self.matcher = None
        if admitted.grammar is not None:
            try:
                self.matcher = admitted.grammar.matcher()
            except Exception as err:
                self.error = err
        self.penalty = (params.repetition_penalty
                        if params.repetition_penalty not in (None, 1.0) else None)
        # ignore_eos_token: EOS is an ordinary token (as in TGI and LoRAX); not with a grammar,
        # which allows EOS only once the answer is complete.
        self.ignore_eos = params.ignore_eos_token and self.matcher is None
        self.ids: list[int] = []       # generated tokens (EOS only with ignore_eos)
        self.counts: Counter = Counter()   # how often each of them was generated
        self.count = 0                 # generated tokens, EOS included
        self.decoder = IncrementalDecoder(tokenizer)     # the text handed out so far
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
        out = {"id": int(token), "text": piece, "logprob": finite(logprob), "special": special}
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
        """The new piece of text, and where a stop sequence it completes starts (or None)."""
        piece = self.decoder.add(self.ids[-1])
        if self.count >= self.max_new_tokens:
            piece += self.decoder.flush()
        text = self.decoder.text
        start = max(0, len(text) - len(piece) - self.longest_stop + 1)
        found = [pos for pos in (text.find(s, start) for s in self.params.stop) if pos >= 0]
        return piece, min(found, default=None)

    def _finish(self, reason: str, stop_at: int | None) -> Finish:
        return Finish(reason, self.tokenizer.decode(self.ids), self.count,
                      len(self.prompt_ids), self.seed, stop_at,
                      time.perf_counter() - self.submitted)
