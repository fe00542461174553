"""Chat messages to a prompt, with the model's own chat template. (Lesson 07.)

``/v1/chat/completions`` receives messages (``[{"role": "user", "content": "..."}]``); the
model reads one text. The template that writes the messages as that text belongs to the
model: it ships with the tokenizer (``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja`` beside it) and ``tokenizer.apply_chat_template`` applies it. A hub
model brings its own; the bundled model's is described in its model card
(``helpers/assets/model/README.md``): it continues text, so a user message is the start of a
passage and the answer is its continuation.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from .errors import InvalidRequest, TooLarge

#: What each message costs beside its text, counted in characters: a template writes a role
#: and separators for every message, so many empty messages are not free.
CHARS_PER_MESSAGE = 16


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt text of ``messages`` with the tokenizer's chat template, ending where the
    assistant's answer begins. InvalidRequest if the model has no template or the template
    refuses the messages (some templates raise, e.g. on roles out of order)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template: use /v1/completions with a "
                             "prompt instead")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as err:        # jinja2's TemplateError, or the template's own raise
        raise InvalidRequest(f"the model's chat template refused these messages: "
                             f"{str(err).splitlines()[0][:200]}") from None
    # The engine tokenizes the prompt with the tokenizer's special tokens. A template that
    # writes the begin-of-text token itself would get a second one: drop the template's.
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos):]
    return text


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


async def prompt(engine, messages: list[dict]) -> str:
    """The prompt for ``messages`` on ``engine``'s model (rendered in a worker thread)."""
    # The engine's own bound on a prompt's characters (its longest token, twice, per token of
    # --max-input-tokens): a chat that cannot fit is refused before it is rendered.
    size = sum(len(m["content"]) + CHARS_PER_MESSAGE for m in messages)
    if size > engine.max_prompt_chars:
        raise TooLarge(f"the {len(messages)} messages count as {size} characters "
                       f"({CHARS_PER_MESSAGE} per message for its role and separators); this "
                       f"server reads prompts of at most {engine.max_input_tokens} tokens")
    return await run_in_threadpool(render, engine.tokenizer, messages)
