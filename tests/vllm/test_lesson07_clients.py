"""Lesson 07's client code against real vLLM: what "point them at it unchanged" buys.

Lesson 07 sends every request to ``url``, which its setup cell takes from ``LORAX_URL`` when
that is set (the lesson's one setting for a real endpoint). These tests read the lesson's
cells from ``lessons/07_serving.ipynb`` at test time (never a copy), run them in one namespace
with ``LORAX_URL`` pointing at vLLM serving the bundled model as ``bundled``, and check what
they produce. Nothing of a cell is changed; where a cell takes its model name from a variable
(section 7: ``info["model_id"]``), the test sets that variable, as a learner would.

What runs against vLLM:
- the setup cells (imports, ``LORAX_URL``, ``needs``, section 5's ``prompt``); vLLM has no
  ``/info`` (404), so ``info`` holds no ``model_id``;
- section 8, chat completions, unchanged: the model's name comes from ``/v1/models``, the
  chat template from the bundled tokenizer; the streamed answer equals the whole one, and
  both equal the course server's answer;
- section 7, OpenAI completions, with the base model (``bundled``).

What cannot, and how vLLM refuses it:
- every ``lorax-client`` cell (sections 2-6 and 9: ``generate``, ``generate_stream``,
  ``AsyncClient``, ``adapter_id``, JSON mode over ``/generate``): vLLM has no LoRAX/TGI routes,
  ``POST /generate`` is a 404 (``lorax.errors.NotFoundError``);
- section 7 as written asks for the ``title`` adapter in ``model``: vLLM cannot serve LoRA
  adapters for GPT-2 (``GPT2LMHeadModel does not support LoRA yet``), so it answers 404, the
  model ``title`` does not exist.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import httpx
import pytest

# lorax-client 0.6.3 calls pydantic's deprecated .dict() (the lesson hides it the same way)
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")

LESSON = Path(__file__).resolve().parents[2] / "lessons" / "07_serving.ipynb"
#: How the tests find a cell: a line only that cell has.
SETUP_CELLS = ["from lorax import AsyncClient, Client",          # imports
               'LORAX_URL = os.environ.get("LORAX_URL")',        # the endpoint
               "needs = Needs(",                                  # do the adapters fit?
               "prompt = task_prompt(SENTENCE)"]                  # section 5's prompt
COMPLETIONS = "oai.completions.create("                           # section 7
CHAT = "oai.chat.completions.create("                             # section 8
LORAX_GENERATE = 'answer = client.generate("Jack and Jill"'       # section 2
PROMPTS = ["The quick brown fox jumped over the", "The rain in Spain falls",
           "What comes up must", "Jack and Jill", "Humpty Dumpty sat"]


def cell(marker: str) -> tuple[str, str]:
    """The source of the one code cell of lesson 07 that contains ``marker``, and a name for
    tracebacks."""
    cells = json.loads(LESSON.read_text())["cells"]
    found = [(i, "".join(c["source"])) for i, c in enumerate(cells)
             if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} code cells of {LESSON.name} contain {marker!r}"
    index, source = found[0]
    return source, f"{LESSON.name}, cell {index}"


def run_cell(marker: str, namespace: dict) -> str:
    """Run the cell in ``namespace``, as the notebook's kernel would; returns what it
    printed."""
    source, name = cell(marker)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, name, "exec"), namespace)
    return printed.getvalue()


def lesson_at(url: str) -> dict:
    """The lesson's namespace after its setup cells, with ``LORAX_URL`` = ``url``."""
    namespace = {"__name__": "__lesson07__"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAX_URL", url)
        for marker in SETUP_CELLS:
            run_cell(marker, namespace)
    return namespace


@pytest.fixture(scope="module")
def on_vllm(vllm_url):
    return lesson_at(vllm_url)


@pytest.fixture(scope="module")
def on_ours(ours_url):
    return lesson_at(ours_url)


def test_setup_cells_take_the_url(on_vllm, vllm_url):
    assert on_vllm["server"] is None and on_vllm["url"] == vllm_url
    assert "model_id" not in on_vllm["info"]      # vLLM has no /info: {"detail": "Not Found"}
    assert on_vllm["needs"].ok                     # "a real LoRAX: the adapters are its own"
    assert on_vllm["prompt"].strip()


def test_chat_cell_runs_unchanged(on_vllm, on_ours):
    """Section 8 as written: the model's name from /v1/models, one answer whole and one
    streamed; the same answer as the course server's (greedy, the same chat template).
    Section 7 runs first, as in the notebook: it makes the client, ``oai``."""
    from openai import NotFoundError

    for lesson in (on_vllm, on_ours):
        with contextlib.suppress(NotFoundError):      # vLLM: no adapter "title" (below)
            run_cell(COMPLETIONS, lesson)
    run_cell(CHAT, on_vllm)
    assert on_vllm["chat_model"] == "bundled"
    reply = on_vllm["reply"]
    answer = reply.choices[0].message.content
    assert answer.strip() and reply.choices[0].finish_reason in ("length", "stop")
    assert 0 < reply.usage.completion_tokens <= 30
    assert on_vllm["streamed"] == answer           # the chunks arrived and add up
    run_cell(CHAT, on_ours)
    assert on_ours["reply"].choices[0].message.content == answer


def test_completions_cell_asks_for_an_adapter_vllm_cannot_serve(on_vllm):
    """Section 7 as written sends the ``title`` adapter's name in ``model``: vLLM cannot
    load LoRA adapters for GPT-2, so the name is unknown to it."""
    from openai import NotFoundError

    with pytest.raises(NotFoundError, match="title"):
        run_cell(COMPLETIONS, on_vllm)


def test_completions_cell_with_the_base_model(on_vllm, on_ours):
    """Section 7 with the base model (the lesson's branch for adapters that do not fit):
    the same text and usage from vLLM as from the course server."""
    from helpers import load_tokenizer
    from helpers.models import Needs

    texts = {}
    for name, lesson in (("vllm", dict(on_vllm)), ("ours", dict(on_ours))):
        lesson["needs"] = Needs("the adapters", "are not served by vLLM for GPT-2")
        # vLLM has no /info: the name it serves the model under instead
        lesson["info"] = {"model_id": "bundled", **lesson["info"]}
        run_cell(COMPLETIONS, lesson)
        completion = lesson["completion"]
        usage = completion.usage
        assert usage.prompt_tokens == len(load_tokenizer()(lesson["prompt"])["input_ids"])
        assert 0 < usage.completion_tokens <= 30
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        texts[name] = (completion.choices[0].text, completion.choices[0].finish_reason,
                       usage.completion_tokens)
    assert texts["vllm"][0].strip()
    assert texts["vllm"] == texts["ours"]


def test_lorax_client_cells_get_404(on_vllm, vllm_url):
    """The lorax-client cells (sections 2-6 and 9) need LoRAX's routes, which vLLM lacks."""
    from lorax.errors import NotFoundError

    with pytest.raises(NotFoundError):
        run_cell(LORAX_GENERATE, on_vllm)
    for route in ("/generate", "/generate_stream"):
        reply = httpx.post(vllm_url + route, json={"inputs": "Jack and Jill"}, timeout=30)
        assert reply.status_code == 404, route


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_the_course_servers(vllm_url, ours_url, prompt):
    """temperature 0, 16 tokens, through the openai client: the same text from both."""
    from openai import OpenAI

    texts = []
    for url, model in ((vllm_url, "bundled"), (ours_url, None)):
        client = OpenAI(base_url=url + "/v1", api_key="none")
        model = model or client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                                temperature=0)
        texts.append(completion.choices[0].text)
    assert texts[0].strip()
    assert texts[0] == texts[1]

