"""Lessons 05-07 with $COURSE_MODEL naming a model the shipped adapters were not trained for
(and lesson 09 with one whose tokenizer is not the course draft's, lesson 02 with one of
another size: what a learner sets on a GPU to see larger gains).

The model is a tiny random GPT-2 (hidden 64 instead of the bundled 256) saved with the bundled
tokenizer, so no hub is needed. Each lesson must say in one printed sentence why the adapters
do not fit and what still runs, and then run every cell without an error. Outputs are not
compared with the saved ones (they are the bundled model's). Each test runs a whole lesson in a
kernel (about 20 s on 2 CPU threads).
"""

import pathlib

import nbformat
import pytest
import torch
from nbclient import NotebookClient

LESSONS = pathlib.Path(__file__).resolve().parents[1] / "lessons"


def save_tiny_gpt2(folder, extra_tokens=()):
    """A tiny random GPT-2 and the bundled tokenizer (with ``extra_tokens`` added) in ``folder``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import load_tokenizer

    tokenizer = load_tokenizer()
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2,
                        n_positions=256, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A folder holding a tiny random GPT-2 and the bundled tokenizer."""
    return save_tiny_gpt2(tmp_path_factory.mktemp("models") / "tiny-gpt2")


def run_lesson(name: str, model_folder, monkeypatch) -> dict[str, str]:
    """Execute lessons/<name> with $COURSE_MODEL set (CellExecutionError if a cell fails);
    returns what each code cell printed, by cell id."""
    monkeypatch.setenv("COURSE_MODEL", str(model_folder))
    nb = nbformat.read(LESSONS / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(LESSONS)}}).execute()
    return {cell.id: "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            for cell in nb.cells if cell.cell_type == "code"}


def one_note(printed: dict[str, str]) -> str:
    """The one printed line that says why the shipped adapters do not fit (it quotes
    adapter_mismatch's reason) and what changes."""
    notes = [line for text in printed.values() for line in text.splitlines()
             if "shipped adapters" in line and "shape mismatch" in line]
    assert len(notes) == 1, notes
    return notes[0]


def test_lesson_02_measures_the_three_costs_of_another_model(tiny_gpt2, monkeypatch):
    """What a learner does on a GPU to see larger gains: $COURSE_MODEL names another model
    (here of another width and depth). Lesson 02 measures the three costs of that model's
    step, shrinks it to measure its overhead, and names the bound at every batch size."""
    printed = run_lesson("02_batching.ipynb", tiny_gpt2, monkeypatch)
    lines = [line for text in printed.values() for line in text.splitlines()]
    assert any("2 layers, hidden 64" in line for line in lines)   # it ran on the tiny model
    table = [line for line in lines if line.split()[:1] and line.split()[0] in
             ("1", "8", "64", "256", "1024") and line.rstrip().endswith(
                 ("overhead", "arithmetic", "reading weights"))]
    assert len(table) == 5, table
    assert sum("bound by" in line for line in lines) == 2


def test_lesson_05_trains_a_fresh_adapter(tiny_gpt2, monkeypatch):
    """Section 6 (the shipped adapters side by side) is skipped; training, scoring, saving,
    reloading and merging run on the tiny model (its answers are not expected to be right)."""
    printed = run_lesson("05_lora.ipynb", tiny_gpt2, monkeypatch)
    setup = next(text for text in printed.values() if "M parameters" in text)
    assert "hidden 64" in setup  # the lesson really ran on the tiny model
    # one sentence in the setup cell: what is skipped and what still runs
    assert "Section 6" in setup and "skipped" in setup
    assert "training, saving, reloading and merging" in setup
    note = one_note(printed)  # section 6's cell says why it skips
    assert note.startswith("Section 6: skipped, the shipped adapters do not fit this model")
    assert any("held-out sentences right" in text for text in printed.values())
    assert any("merged by hand == merged by peft: True" in text for text in printed.values())
    assert any("reloaded == trained: True" in text for text in printed.values())


def test_lesson_06_compares_ours_and_peft_on_random_adapters(tiny_gpt2, monkeypatch):
    """Random adapters of the tiny model's shapes replace the shipped ones; ours and peft still
    give identical tokens."""
    printed = run_lesson("06_multi_lora.ipynb", tiny_gpt2, monkeypatch)
    note = one_note(printed)
    assert "random adapters" in note and "identical tokens" in note
    assert any("identical tokens, batch of 32: True" in text for text in printed.values())


def test_lesson_07_serves_the_base_model_only(tiny_gpt2, monkeypatch):
    """The server runs without adapters; the cells that need one say they are skipped."""
    monkeypatch.delenv("LORAX_URL", raising=False)
    printed = run_lesson("07_serving.ipynb", tiny_gpt2, monkeypatch)
    lines = [line for text in printed.values() for line in text.splitlines()]
    notes = [line for line in lines if line.startswith("The server runs the base model only")]
    assert len(notes) == 1, notes  # one sentence says why (adapter_mismatch's reason) ...
    assert "shipped adapters do not fit" in notes[0] and "shape mismatch" in notes[0]
    assert "every section still runs" in notes[0].lower()  # ... and what still runs
    skipped = [line for line in lines if "skipped, the shipped adapters do not fit" in line]
    assert len(skipped) >= 3, skipped  # each cell that needs an adapter says it skips
    assert not any(line.startswith("adapters:") for line in lines)


@pytest.fixture(scope="module")
def tiny_gpt2_other_tokenizer(tmp_path_factory):
    """A tiny random GPT-2 whose tokenizer is the bundled one plus a token: not the draft's."""
    return save_tiny_gpt2(tmp_path_factory.mktemp("models") / "tiny-gpt2-other-tokenizer",
                          extra_tokens=["<extra>"])


def test_lesson_09_runs_prompt_lookup_without_the_draft(tiny_gpt2_other_tokenizer, monkeypatch):
    """The course's draft does not share this model's tokenizer (``course_draft`` returns None
    and a ``Needs``): one sentence says so and that prompt lookup still runs, the draft's cells
    (its guesses, section 5's cost model) say they are skipped, and prompt lookup still gives
    plain greedy's tokens, here and against transformers."""
    printed = run_lesson("09_speculative_decoding.ipynb", tiny_gpt2_other_tokenizer, monkeypatch)
    lines = [line for text in printed.values() for line in text.splitlines()]
    notes = [line for line in lines if line.startswith("The course's draft does not share")]
    assert len(notes) == 1 and "prompt lookup" in notes[0]
    assert any("vocabulary 944" in line for line in lines)   # it really ran on the tiny model
    assert not any(line.startswith("draft:") for line in lines)
    skipped = [line for line in lines if "skipped, the course's draft does not share" in line]
    assert len(skipped) >= 2 and any(line.startswith("Section 5") for line in skipped), skipped
    lookup_rows = [line for line in lines if "lookup:" in line and " passes, " in line]
    assert len(lookup_rows) == 4 and all("same tokens as plain greedy: True" in line
                                         for line in lookup_rows)
    assert any(line.startswith("Skipped: the entities adapter does not fit") for line in lines)
    assert any("'prompt lookup, rhymes, k = 8': True" in line for line in lines)
