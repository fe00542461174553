"""JSON mode: only let the model write tokens that keep the text valid for a JSON schema.
(Lesson 07.)

The recipe is Outlines' (which LoRAX uses), through ``outlines-core``:

1. the JSON schema becomes a regular expression (``build_regex_from_schema``);
2. the regular expression and the model's vocabulary become an ``Index``: for every state of
   the expression's automaton, the tokens that may come next and the state each one leads to;
3. each request in JSON mode gets a ``Guide`` (its own position in the automaton). At every
   step the logits of the tokens the guide does not allow are set to -inf, then the chosen
   token advances the guide. EOS is allowed only where the JSON is complete.

Two additions of ours:

* the answer always closes within ``max_new_tokens`` when it can: from the automaton we know,
  for every state, the fewest tokens that still complete the JSON; when the token budget runs
  low, tokens that lead to states too far from the end are masked too. (Without this a small
  model happily writes "48888888..." until the budget ends, and the JSON never closes.)
* outlines-core ignores ``minimum``/``maximum`` on integers; a bounded integer with at most
  ``MAX_ENUM_RANGE`` values is turned into an ``enum`` of its values, which it does follow.

The vocabulary must hold what each token really writes, as bytes. Byte-level BPE tokenizers
(GPT-2, Llama 3, Qwen) store tokens in a printable alphabet: "Ġthe" is the bytes " the". We
undo that mapping here; for SentencePiece-style tokenizers "▁" is a space and "<0x0A>" a byte.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from .protocol import invalid


def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte in byte-level BPE, mapped back to the byte.

    Bytes that are printable and not spaces stand for themselves; the others (control bytes,
    space, a few Latin-1 ones) are given the characters from U+0100 on, in byte order.
    """
    printable = (set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD))
                 | set(range(0xAE, 0x100)))
    char_to_byte, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            char_to_byte[chr(byte)] = byte
        else:
            char_to_byte[chr(0x100 + extra)] = byte
            extra += 1
    return char_to_byte


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:       # a tokenizer that cannot describe itself: assume not byte-level
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


def token_bytes(tokenizer) -> dict[int, bytes]:
    """The bytes every ordinary token writes (special tokens left out). (Lesson 07.)"""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    out: dict[int, bytes] = {}
    if _is_byte_level(tokenizer):
        alphabet = _byte_level_alphabet()
        for token, token_id in vocab.items():
            if token_id in special:
                continue
            try:
                out[token_id] = bytes(alphabet[ch] for ch in token)
            except KeyError:        # an added token written in plain text
                out[token_id] = token.encode("utf-8")
    else:
        for token, token_id in vocab.items():
            if token_id in special:
                continue
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                out[token_id] = bytes([int(token[3:5], 16)])
            else:
                out[token_id] = token.replace("\u2581", " ").encode("utf-8")
    return {i: b for i, b in out.items() if b}


#: Bounded integers with at most this many values become an enum (see the module's notes).
MAX_ENUM_RANGE = 1000
_FAR = 1 << 30


def bounded_integers_as_enums(schema):
    """A copy of ``schema`` where every integer with a small [minimum, maximum] range is an
    ``enum`` of its values (exclusiveMinimum/exclusiveMaximum too)."""
    if isinstance(schema, list):
        return [bounded_integers_as_enums(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_integers_as_enums(value) for key, value in schema.items()}
    if out.get("type") == "integer":
        low, high = out.get("minimum"), out.get("maximum")
        if isinstance(out.get("exclusiveMinimum"), (int, float)):
            low = out["exclusiveMinimum"] + 1 if isinstance(out["exclusiveMinimum"], int) else None
        if isinstance(out.get("exclusiveMaximum"), (int, float)):
            high = out["exclusiveMaximum"] - 1 if isinstance(out["exclusiveMaximum"], int) else None
        if (isinstance(low, int) and isinstance(high, int) and not isinstance(low, bool)
                and 0 <= high - low < MAX_ENUM_RANGE):
            for key in ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                out.pop(key, None)
            out["enum"] = list(range(low, high + 1))
    return out


@dataclass
class CompiledSchema:
    """A schema ready for guides: its token-level automaton (``automaton``, an outlines-core
    ``Index``: states, and for each state the tokens allowed and where they lead); for each state
    the fewest tokens that complete the JSON (``distance``); and for each state its allowed
    tokens with the distance each one leads to (``moves``: two tensors), and the largest of
    those (``worst``). Tensors, not dicts: with a 50k-token vocabulary the automaton has
    about a million transitions."""

    automaton: object
    distance: dict
    moves: dict
    worst: dict

    @classmethod
    def build(cls, automaton) -> "CompiledSchema":
        transitions = automaton.get_transitions()      # state -> {token: next state}
        finals = set(automaton.get_final_states())
        # Breadth-first search backwards from the final states.
        incoming: dict[int, set[int]] = {}
        for state, moves in transitions.items():
            for nxt in set(moves.values()):
                if nxt != state:
                    incoming.setdefault(nxt, set()).add(state)
        distance = {state: 0 for state in finals}
        todo = deque(finals)
        while todo:
            state = todo.popleft()
            for before in incoming.get(state, ()):
                if before not in distance:
                    distance[before] = distance[state] + 1
                    todo.append(before)
        moves, worst = {}, {}
        for state, table in transitions.items():
            tokens = torch.tensor(list(table.keys()), dtype=torch.long)
            after = torch.tensor([distance.get(nxt, _FAR) for nxt in table.values()],
                                 dtype=torch.int32)
            moves[state] = (tokens, after)
            worst[state] = int(after.max()) if len(after) else 0
        return cls(automaton, distance, moves, worst)


class JsonMode:
    """Schemas to token-level guides for one tokenizer, with the compiled schemas cached.
    (Lesson 07.)

    ``compile(schema)`` checks and compiles a schema into a ``CompiledSchema`` (an
    ``ApiError`` 422 when outlines-core cannot use it); ``guide(compiled)`` starts a new guide
    for one request; ``mask(compiled, guide, size, budget)`` is the additive mask for its next
    token (0 where allowed, -inf elsewhere).
    """

    def __init__(self, tokenizer, cache_size: int = 16):
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._vocabulary = None
        self._compiled: OrderedDict[str, CompiledSchema] = OrderedDict()  # by schema text
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        try:
            import outlines_core  # noqa: F401
        except ImportError:
            return False
        return True

    def vocabulary(self):
        """The outlines-core ``Vocabulary`` of the tokenizer (built once)."""
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            by_bytes: dict[bytes, list[int]] = {}
            for token_id, data in token_bytes(self.tokenizer).items():
                by_bytes.setdefault(data, []).append(token_id)
            self._vocabulary = Vocabulary(self.tokenizer.eos_token_id, by_bytes)
        return self._vocabulary

    def regex_for(self, schema: dict) -> str:
        """The regular expression of a JSON schema (``ApiError`` 422 if unusable)."""
        from outlines_core.json_schema import build_regex_from_schema

        try:
            return build_regex_from_schema(json.dumps(bounded_integers_as_enums(schema)))
        except (ValueError, TypeError, RuntimeError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise invalid(f"invalid JSON schema for JSON mode: {first_line}") from None

    def compile(self, schema: dict) -> CompiledSchema:
        """The compiled schema, built once and cached by the schema's text."""
        if not self.available():
            raise invalid("JSON mode needs the outlines-core package, which is not installed "
                          "on this server", 422)
        key = json.dumps(schema, sort_keys=True)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        from outlines_core import Index

        regex = self.regex_for(schema)
        try:
            compiled = CompiledSchema.build(Index(regex, self.vocabulary()))
        except (ValueError, RuntimeError) as err:
            raise invalid(f"JSON mode cannot follow this schema with this model's vocabulary: "
                          f"{err}") from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    @staticmethod
    def guide(compiled: CompiledSchema):
        from outlines_core import Guide

        return Guide(compiled.automaton)

    def allowed(self, compiled: CompiledSchema, guide, budget: int | None = None) -> list[int]:
        """The tokens the guide allows next. With ``budget`` (the tokens left AFTER this one),
        only those from which the JSON can still be completed in time, when there are any."""
        state = guide.get_state()
        if budget is None or compiled.worst.get(state, 0) <= budget:
            return guide.get_tokens()            # every choice still leaves enough room
        tokens, after = compiled.moves[state]
        in_time = tokens[after <= budget].tolist()
        if compiled.automaton.is_final_state(state):
            in_time.append(self.tokenizer.eos_token_id)
        return in_time or guide.get_tokens()

    def mask(self, compiled: CompiledSchema, guide, size: int, budget: int | None = None,
             device=None) -> torch.Tensor:
        """0 for the tokens allowed next (see ``allowed``), -inf for the others; shape (size,)."""
        allowed = torch.tensor(self.allowed(compiled, guide, budget), dtype=torch.long)
        mask = torch.full((size,), float("-inf"))
        mask[allowed[allowed < size]] = 0.0
        return mask if device is None else mask.to(device)
