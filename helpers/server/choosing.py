"""Choosing each row's next token by its own rules. (Lesson 07.)

After a forward pass the scheduler holds one row of logits per request. Each request may want
something different from them: the greedy token or a seeded sample, penalties for repeated
tokens, a logit bias, a grammar's mask (JSON mode), its prompt's log probabilities, the top
alternatives. ``TokenChooser`` applies each row's rules to its own row of logits and sets
``request.choice`` (token, log probability, alternatives); ``Request.accept`` then turns the
choice into the token's event.

A row whose choice fails (NaN logits from extreme settings, a failing grammar) gets its
``error`` set and the padding token as its token: it fails alone, and the other rows of the
batch carry on.
"""

from __future__ import annotations

import torch

from . import sampling
from .contract import PromptEvent


def guarded(row, function, *args) -> None:
    """Run one row's part of the choice; an exception fails that row (``row.error``), not the
    batch. Nothing runs for a row that has failed already."""
    if row.error is not None:
        return
    try:
        function(*args)
    except Exception as err:
        row.error = err


class TokenChooser:
    """``chooser(rows, logits, outgoing)``: each row's next token by its own rules, the list
    given back to lesson 03's ``generate_next_token`` (or lesson 08's ``paged_next_token``)
    as its ``choose``. (Lesson 07.)

    rows:     the sequences, one per row of ``logits``
    logits:   (rows, positions, vocab); the last position is the one to choose from
    outgoing: where ``score_prompt`` puts the prompt events (the token events come from
              ``Sequence.accept``)
    """

    def __init__(self, tokenizer, eos_id: int | None, pad_id: int):
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.pad_id = pad_id

    def __call__(self, rows: list, logits: torch.Tensor, outgoing: list) -> list[int]:
        last = logits[:, -1, :].float()
        if any(row.adjusts_logits for row in rows):
            last = last.clone()
            for i, row in enumerate(rows):
                if row.adjusts_logits:
                    guarded(row, self._adjust, row, last[i])
        logprobs = torch.log_softmax(last, dim=-1)
        tokens = sampling.greedy(last)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=last.device)[:, None])
        chosen = chosen.squeeze(1).tolist()
        broken = (torch.isnan(last).any(dim=-1) | torch.isposinf(last).any(dim=-1)).tolist()
        for i, row in enumerate(rows):
            if broken[i]:
                guarded(row, sampling.check_finite, last[i])
            if row.error is None:
                guarded(row, self._pick, row, tokens[i], chosen[i], last[i], logprobs[i])
        return [row.choice[0] if row.error is None and row.choice[0] is not None
                else self.pad_id for row in rows]

    def score_prompt(self, row, logits: torch.Tensor, outgoing: list) -> None:
        """The PromptEvent: every prompt token's logprob, from the logits at its positions."""
        tokens = sampling.prompt_logprobs(logits, row.prompt_ids, self.tokenizer,
                                          row.params.alternatives)
        outgoing.append((row, PromptEvent(tokens)))

    def _adjust(self, row, logits: torch.Tensor) -> None:
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

    def _pick(self, row, token: int, logprob: float, logits: torch.Tensor,
              logprobs: torch.Tensor) -> None:
        """Set ``row.choice``: the greedy ``token`` unless the row samples, its logprob, and
        the top alternatives if asked."""
        if row.max_new_tokens == 0:                 # prefill only: nothing is chosen
            row.choice = (None, None, None)
            return
        if row.matcher is not None and not torch.isfinite(logits).any():
            row.choice = (self.eos_id, 0.0, None)   # the grammar allows nothing: stop
            return
        if row.generator is not None:              # the row samples
            token, logprob = sampling.sample(logits, row.params, row.generator)
        alternatives = None
        if row.params.alternatives:
            alternatives = sampling.top_alternatives(logprobs, row.params.alternatives,
                                                     self.tokenizer)
        row.choice = (token, logprob, alternatives)
