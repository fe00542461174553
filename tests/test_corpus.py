"""The seeded world the bundled model and its adapters were trained on."""

import json

from helpers.corpus import TASKS, corpus, task_examples, task_prompt


def test_corpus_is_seeded():
    assert corpus(seed=3, n_docs=20) == corpus(seed=3, n_docs=20)
    assert corpus(seed=3, n_docs=20) != corpus(seed=4, n_docs=20)


def test_entities_answers_are_json_of_the_sentence():
    for sentence, answer in task_examples("entities", seed=7, n=30):
        value = json.loads(answer)
        assert set(value) == {"characters", "place", "object"}
        for name in value["characters"]:
            assert name in sentence
        for key in ("place", "object"):
            assert value[key].lower() in sentence.lower()


def test_every_task_answers_the_same_prompt():
    for task in TASKS:
        sentence, answer = task_examples(task, seed=1, n=1)[0]
        assert task_prompt(sentence).startswith("Input: " + sentence)
        assert answer and "\n" not in answer
