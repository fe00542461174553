"""Client text to tokens, never to special tokens, and tokens back to text as they come.
(Lesson 07.)

A tokenizer reads its special tokens' text anywhere: a client typing ``<|im_start|>`` would
forge a turn. Here client text is tokenized as text, while a chat template's own special
tokens stay special, by private copies of the Rust tokenizer set once and then only read
(transformers' ``split_special_tokens=True`` sets the *shared* one at each call, where two
threads change it under each other).

``IncrementalDecoder`` decodes a small window, as TGI and vLLM do: the whole answer at each
token costs n²/2 token decodes, and the last token alone may hold half a character.
"""

from __future__ import annotations

import functools
import re
import secrets
import threading
from typing import Callable, NamedTuple

from .errors import InvalidRequest

#: What a chat message costs beside its text, in characters, in the bound on a prompt's size
#: before the template runs (a template writes a role and separators for each message).
CHARS_PER_MESSAGE = 16

#: Text to check that a copy of the Rust tokenizer tokenizes as the tokenizer does.
_SAMPLE = "Jack and Jill went up the hill, 1 2 3 :) \n\u00e9"
#: Only for tokenizers without a Rust tokenizer: they are called under this lock.
_SHARED_LOCK = threading.Lock()


def own_encoder(tokenizer):
    """A private copy of ``tokenizer``'s Rust tokenizer for client text (special tokens' text
    read as text), which threads call without a lock. None without a Rust tokenizer, or if
    the copy tokenizes differently (transformers adds some models' special tokens itself)."""
    own = _rust_copy(tokenizer)
    if own is not None:
        own.encode_special_tokens = True
    return own


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of client ``text``, special tokens' text read as text (the tokenizer's
    own BOS/EOS still added). ``tokenizer``: a transformers one or ``own_encoder``'s copy."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        if not tokenizer.encode_special_tokens:
            raise ValueError("this Rust tokenizer reads special tokens in text: give the copy "
                             "that own_encoder(tokenizer) makes")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return _encoders(tokenizer).text(text, add_special_tokens)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` in the chat template: the template's text as usual, each
    ``content`` as client text. The template is also applied to copies whose contents are
    random markers: cut there, it gives its own pieces, each tokenized alone (as transformers
    5.23's ``sanitize_control_tokens=True`` does), if with the contents put back (as they are,
    or stripped by ``| trim``) they give the real text. Otherwise the whole text is tokenized,
    accepted only if its special tokens are the template's own."""
    contents = [message.get("content") for message in messages]
    if any(content is not None and not isinstance(content, str) for content in contents):
        raise InvalidRequest("a message's content must be text")
    encoders = _encoders(tokenizer)
    rendered = _render(tokenizer, messages, add_generation_prompt)
    nonce = secrets.token_hex(8)
    while nonce in rendered or any(nonce in content for content in contents if content):
        nonce = secrets.token_hex(8)
    # Markers of private-use characters around a random part that no client can guess.
    marked = _render(tokenizer, [{**message, "content": f"\ue000{nonce}:{i}\ue001"} if content
                                 else message for i, (message, content)
                                 in enumerate(zip(messages, contents))], add_generation_prompt)
    # Template text at even places, the index of a message at odd ones.
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)
    bos = tokenizer.bos_token if encoders.prefix[:1] == [tokenizer.bos_token_id] else None
    drop = len(bos) if bos and marked.startswith(bos) and rendered.startswith(bos) else 0
    for put_back in (str, str.strip):
        parts = [piece if k % 2 == 0 else put_back(contents[int(piece)])
                 for k, piece in enumerate(pieces)]
        if "".join(parts) == rendered:
            break
    else:
        return _whole(tokenizer, encoders, rendered[drop:], pieces[::2], drop)
    parts[0] = parts[0][drop:]
    ids, start = list(encoders.prefix), True
    for k, part in enumerate(parts):
        if part:
            ids += _piece(encoders, encoders.text if k % 2 else encoders.plain, part, start)
            start = False
    return ids + encoders.suffix


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text ``encode_chat`` tokenizes, ending where the answer begins (without the
    template's BOS when the tokenizer adds one: never two)."""
    text = _render(tokenizer, messages)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and _encoders(tokenizer).prefix[:1] == [
            tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


class _Encoders(NamedTuple):
    plain: Callable[[str, bool], list[int]]     # special tokens are special: the template's text
    text: Callable[[str, bool], list[int]]      # special tokens are text: the client's text
    prefix: list[int]                           # what add_special_tokens puts before the text
    suffix: list[int]                           # ... and after it
    newline: list[int]                          # the ids of "\n", for _piece


@functools.lru_cache(maxsize=8)
def _encoders(tokenizer) -> _Encoders:
    """Both ways to tokenize with ``tokenizer``, made once (a tokenizer given tokens afterwards
    needs ``_encoders.cache_clear()``)."""
    plain, text = _rust_copy(tokenizer), own_encoder(tokenizer)
    if plain is not None and text is not None:
        def plain_ids(s, add): return plain.encode(s, add_special_tokens=add).ids
        def text_ids(s, add): return text.encode(s, add_special_tokens=add).ids
    else:                             # no Rust tokenizer of our own: the shared one, locked
        def plain_ids(s, add): return _shared(tokenizer, s, add, split=False)
        def text_ids(s, add): return _shared(tokenizer, s, add, split=True)
    bare, full = plain_ids("a", False), plain_ids("a", True)
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare),
              None)
    if at is None:
        raise ValueError("the tokenizer's special tokens are not added around the text")
    return _Encoders(plain_ids, text_ids, full[:at], full[at + len(bare):],
                     plain_ids("\n", False))


def _rust_copy(tokenizer):
    """A copy of the Rust tokenizer, without truncation or padding; None as in ``own_encoder``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    own = Tokenizer.from_str(backend.to_str())
    own.no_truncation()
    own.no_padding()
    if own.encode(_SAMPLE, add_special_tokens=True).ids != \
            tokenizer(_SAMPLE, add_special_tokens=True)["input_ids"]:
        return None
    return own


def _shared(tokenizer, text: str, add_special_tokens: bool, split: bool) -> list[int]:
    with _SHARED_LOCK:
        return tokenizer(text, add_special_tokens=add_special_tokens,
                         split_special_tokens=split)["input_ids"]


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to ``messages``; InvalidRequest if there is none or it
    refuses them (some raise, e.g. on roles out of order)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template: use /v1/completions with a "
                             "prompt instead")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:        # jinja2's TemplateError, or the template's own raise
        raise InvalidRequest(f"the model's chat template refused these messages: "
                             f"{str(err).splitlines()[0][:200]}") from None


def _piece(encoders: _Encoders, encode, piece: str, start: bool) -> list[int]:
    """The ids of a piece, without BOS/EOS. A piece after the start is tokenized after a
    newline then taken off, or SentencePiece would put its "\u2581" before every piece (as
    transformers does in ``encode_marked_chat``)."""
    if not start:
        ids = encode("\n" + piece, False)
        if ids[:len(encoders.newline)] == encoders.newline:
            return ids[len(encoders.newline):]
    return encode(piece, False)


def _whole(tokenizer, encoders: _Encoders, text: str, template_pieces: list[str],
           drop: int) -> list[int]:
    """The ids of the whole ``text``, for a template that changes the contents; InvalidRequest
    if it holds other special tokens than the template's own."""
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    template_pieces[0] = template_pieces[0][drop:]
    own = [i for piece in template_pieces for i in encoders.plain(piece, False) if i in special]
    ids = encoders.plain(text, True)
    inner = ids[len(encoders.prefix):len(ids) - len(encoders.suffix)]
    if [i for i in inner if i in special] != own:
        raise InvalidRequest("this model's chat template changes the messages' text, so special "
                             "tokens written in a message cannot be told from the template's "
                             "own: remove them from the messages")
    return ids


# --- the way out: tokens to text, one token at a time ----------------------------------------

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """The text of a growing list of tokens, a piece per token (``add``), then ``flush()`` at
    the end; ``text`` is then what ``tokenizer.decode(ids)`` gives. The window: the tokens not
    handed out yet, after a few as context; its text minus the context's is the new text, held
    back ('') while it ends inside a character (U+FFFD). (Lesson 07.)"""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        if not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"the tokenizer must have a decode method; got {type(tokenizer)}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        # ids[_context:_done]: the window's context, already handed out; ids[_done:]: not yet
        self._context = 0
        self._done = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Add one token; return the text it completes ('' if it ends inside a character)."""
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"a token must be a non-negative integer id, got {token!r}")
        self.ids.append(token)
        return self._piece(final=False)

    @property
    def pending(self) -> int:
        """Tokens added whose text is held back."""
        return len(self.ids) - self._done

    def flush(self) -> str:
        """The text held back, as it stands (an incomplete character stays U+FFFD, as a full
        decode shows it)."""
        return self._piece(final=True) if self.pending else ""

    def _piece(self, final: bool) -> str:
        known = self._decode(self.ids[self._context:self._done])
        window = self._decode(self.ids[self._context:])
        if not final and (window.endswith(REPLACEMENT) or len(window) <= len(known)):
            return ""       # an incomplete character (or nothing new yet): wait for more
        # The context decodes to the same text with or without what follows it (for the
        # tokenizers of this course): the new text is what comes after it.
        piece = window[len(known):]
        self._context, self._done = (len(self.ids) if final else self._done), len(self.ids)
        self.text += piece
        return piece
