"""The grammar engines ``bench_grammar.py`` compares, each behind the same four calls:
``compile(kind, value)`` (a JSON schema or a regular expression), ``start(compiled)`` (a
matcher for one request), ``mask(matcher, logits)`` (the allowed tokens of a logits row, the
others set to -inf) and ``advance(matcher, token)``."""

from __future__ import annotations

import json

#: Each engine's package and the module it imports as.
ENGINES = {"outlines-core": "outlines_core", "llguidance": "llguidance", "xgrammar": "xgrammar"}


def _byte_level_bytes(tokenizer) -> dict[int, bytes]:
    """What each ordinary token of a byte-level BPE tokenizer writes, as bytes (outlines-core
    needs the vocabulary as bytes; the other two engines read the tokenizer themselves)."""
    printable = ({*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)})
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}
    special = set(tokenizer.all_special_ids)
    out = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id not in special:
            try:
                out[token_id] = bytes(alphabet[ch] for ch in token)
            except KeyError:
                out[token_id] = token.encode()
    return out


class OutlinesCore:
    """The schema becomes one regular expression, then one token-level automaton, up front."""

    def __init__(self, tokenizer):
        from outlines_core import Vocabulary

        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in _byte_level_bytes(tokenizer).items():
            by_bytes.setdefault(data, []).append(token_id)
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, by_bytes)

    def compile(self, kind, value):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(value)) if kind == "json" else value
        return Index(regex, self.vocabulary)

    def start(self, compiled):
        from outlines_core import Guide

        return Guide(compiled)

    def mask(self, guide, logits):
        import torch

        allowed = torch.tensor(guide.get_tokens(), dtype=torch.long)
        keep = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = keep

    def advance(self, guide, token):
        guide.advance(token, return_tokens=False)


class LLGuidance:
    """An Earley parser over a lazily built lexer: nothing is expanded before it is needed.
    Set up as the server sets it up (helpers/server/grammar.py: closed objects, json.dumps's
    layout, the server's limits), without the server's checks, cache and closer."""

    def __init__(self, tokenizer):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def compile(self, kind, value):
        from llguidance import LLMatcher

        from helpers.server.grammar import JSON_OPTIONS, closed_objects, parser_limits

        grammar = (LLMatcher.grammar_from_json_schema(closed_objects(value),
                                                      defaults=JSON_OPTIONS)
                   if kind == "json" else LLMatcher.grammar_from_regex(value))
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def start(self, compiled):
        return compiled.deep_copy()

    def mask(self, matcher, logits):
        import torch

        bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        logits[: bias.numel()].masked_fill_(bias == 0, float("-inf"))
        logits[bias.numel():] = float("-inf")

    def advance(self, matcher, token):
        matcher.consume_token(token)


class XGrammar:
    """A pushdown automaton whose token masks are precomputed per state where they can be."""

    def __init__(self, tokenizer):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, kind, value):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
        return self.compiler.compile_regex(value)

    def start(self, compiled):
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def mask(self, matcher, logits):
        import xgrammar

        matcher.fill_next_token_bitmask(self.bitmask)
        xgrammar.apply_token_bitmask_inplace(logits.unsqueeze(0), self.bitmask)

    def advance(self, matcher, token):
        matcher.accept_token(token)


ENGINE_CLASSES = {"outlines-core": OutlinesCore, "llguidance": LLGuidance, "xgrammar": XGrammar}
