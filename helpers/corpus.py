"""The small world the bundled model was trained on.

A seeded generator of short stories, nursery rhymes and sayings. The course's prompts
("The quick brown fox jumped over the", "Jack and Jill", ...) live in this world, so the
bundled model continues them with sensible English even though it is tiny.

``scripts/train_tokenizer.py`` and ``scripts/train_model.py`` train on ``corpus(seed=0)``;
lesson 04 measures perplexity on ``corpus(seed=1)``, text the model has never seen. Later
lessons train LoRA adapters on tasks drawn from the same world (see ``TASKS``).

Introduced in lesson 01 (where the bundled model comes from); used again in lessons 04-07.
"""

from __future__ import annotations

import json
import random

EOS = "<|endoftext|>"

# --- the world ---------------------------------------------------------------------------

ANIMALS = ["fox", "rabbit", "owl", "bear", "cat", "dog", "duck", "frog", "mouse", "hen",
           "goat", "pig", "lamb", "squirrel", "hedgehog", "badger"]
NAMES = ["Tom", "Lily", "Sam", "Mia", "Ben", "Rosa", "Max", "Anna", "Leo", "Ella", "Finn",
         "Ruby", "Jack", "Jill", "Molly", "Oscar"]
PLACES = ["the forest", "the river", "the meadow", "the farm", "the village", "the hill",
          "the garden", "the beach", "the market", "the old mill", "the lake", "the castle"]
OBJECTS = ["a red ball", "a blue kite", "a shiny key", "a little boat", "a basket of apples",
           "a wooden box", "a golden coin", "a warm scarf", "a tiny bell", "a green hat",
           "a jar of honey", "a paper map"]
ADJECTIVES = ["little", "brave", "clever", "sleepy", "happy", "curious", "kind", "shy",
              "quick", "gentle"]
FEELINGS = ["happy", "sad", "scared", "excited", "tired", "proud", "surprised", "calm"]
WEATHER = ["the sun was shining", "it was raining softly", "the wind was blowing",
           "snow covered the ground", "the sky was grey", "the stars were bright"]
TIMES = ["One morning", "One day", "That evening", "Early one spring day", "Late at night",
         "On a cold winter day", "After breakfast", "One summer afternoon"]
FOODS = ["bread", "soup", "apples", "cake", "berries", "carrots", "cheese", "honey"]

# The classic lines the course prompts start. Each is a list of alternatives for what
# follows the prompt; the first is the most common, so greedy decoding finds it.
RHYMES = {
    "fox": ["The quick brown fox jumped over the lazy dog and ran into the woods.",
            "The quick brown fox jumped over the lazy dog and ran all the way home."],
    "spain": ["The rain in Spain falls mainly on the plain.",
              "The rain in Spain falls mainly on the plain, and the farmers are glad."],
    "jack": ["Jack and Jill went up the hill to fetch a pail of water. Jack fell down and "
             "broke his crown, and Jill came tumbling after."],
    "humpty": ["Humpty Dumpty sat on a wall. Humpty Dumpty had a great fall. All the king's "
               "horses and all the king's men could not put Humpty together again."],
    "twinkle": ["Twinkle, twinkle, little star, how I wonder what you are. Up above the world "
                "so high, like a diamond in the sky."],
    "mary": ["Mary had a little lamb, its fleece was white as snow. And everywhere that Mary "
             "went, the lamb was sure to go."],
    "baa": ["Baa, baa, black sheep, have you any wool? Yes sir, yes sir, three bags full."],
}
SAYINGS = [
    "What comes up must come down.",
    "An apple a day keeps the doctor away.",
    "Slow and steady wins the race.",
    "Early to bed and early to rise.",
    "A friend in need is a friend indeed.",
    "Every cloud has a silver lining.",
]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class _Story:
    """One story: a hero, a friend, a place and an object, told in 5 to 9 sentences."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.animal = rng.choice(ANIMALS)
        self.name = rng.choice(NAMES)
        self.friend_animal = rng.choice([a for a in ANIMALS if a != self.animal])
        self.friend = rng.choice([n for n in NAMES if n != self.name])
        self.place = rng.choice(PLACES)
        self.place2 = rng.choice([p for p in PLACES if p != self.place])
        self.obj = rng.choice(OBJECTS)
        self.adj = rng.choice(ADJECTIVES)

    def sentences(self) -> list[str]:
        r, n, f = self.rng, self.name, self.friend
        pron = r.choice(["he", "she"])
        Pron, poss = pron.capitalize(), ("his" if pron == "he" else "her")
        obj_the = "the " + self.obj.split(" ", 1)[1]
        out = [r.choice([
            f"Once upon a time, there was {_a(self.adj)} {self.animal} named {n}.",
            f"There once was {_a(self.adj)} {self.animal} called {n}.",
            f"{n} was {_a(self.adj)} {self.animal} who lived near {self.place}.",
        ])]
        out.append(r.choice([
            f"{Pron} lived in a small house near {self.place}.",
            f"Every day {pron} played with {poss} friend {f} the {self.friend_animal}.",
            f"{Pron} liked to eat {r.choice(FOODS)} and sing songs.",
        ]))
        time, weather = r.choice(TIMES), r.choice(WEATHER)
        out.append(f"{time}, {weather}, and {n} found {self.obj} at {self.place}.")
        out.append(r.choice([
            f"{Pron} was very {r.choice(FEELINGS)}.",
            f"{Pron} had never seen anything like it.",
            f"{Pron} picked up {obj_the} and looked at it for a long time.",
        ]))
        out.append(r.choice([
            f"{n} ran to {self.place2} to show {f} the {self.friend_animal}.",
            f"{n} wanted to give {obj_the} to {f}, who lived at {self.place2}.",
            f"So {n} walked all the way to {self.place2} to find {f}.",
        ]))
        if r.random() < 0.6:
            out.append(r.choice([
                f"On the way, {pron} met {_a(r.choice(ADJECTIVES))} {r.choice(ANIMALS)} "
                f"who asked for help.",
                f"On the way, it started to rain, but {n} did not stop.",
                f"The path was long, and {n} grew {r.choice(['tired', 'hungry', 'cold'])}.",
            ]))
        out.append(r.choice([
            f"When {f} saw {obj_the}, {f} smiled and said, \"Thank you, {n}!\"",
            f"{f} was so {r.choice(['happy', 'excited', 'proud'])} that they danced together until dinner.",
            f"{f} and {n} played with {obj_the} until the sun went down.",
        ]))
        if r.random() < 0.5:
            out.append(r.choice(SAYINGS[1:]) if r.random() < 0.5 else
                       f"From that day on, {n} and {f} were the best of friends.")
        out.append(r.choice([
            "The end.",
            f"And {n} went home {r.choice(['happy', 'tired', 'proud'])}.",
            f"That night, {n} slept very well.",
        ]))
        return out


def story(rng: random.Random) -> str:
    """A short story of 5 to 9 sentences."""
    return " ".join(_Story(rng).sentences())


def rhyme(rng: random.Random) -> str:
    """A classic rhyme or a saying, often followed by the start of a story."""
    key = rng.choice(list(RHYMES))
    options = RHYMES[key]
    line = options[0] if rng.random() < 0.8 else rng.choice(options)
    if rng.random() < 0.5:
        line = line + " " + story(rng)
    return line


def saying(rng: random.Random) -> str:
    """A saying told by a character, the way grandparents do."""
    s = rng.choice(SAYINGS) if rng.random() < 0.5 else SAYINGS[0]
    who = f"{rng.choice(NAMES)} the {rng.choice(ANIMALS)}"
    if rng.random() < 0.5:
        return f"{s} That is what {who} always said, and it was true."
    return f"{who.capitalize()} always said: {s[0].lower() + s[1:]} " + story(rng)


def document(rng: random.Random) -> str:
    """One training document: mostly stories, some rhymes and sayings."""
    x = rng.random()
    if x < 0.6:
        return story(rng)
    if x < 0.88:
        return rhyme(rng)
    return saying(rng)


def corpus(seed: int = 0, n_docs: int = 20_000) -> list[str]:
    """``n_docs`` documents from the seeded generator (seed 0 trains, seed 1 is held out)."""
    rng = random.Random(seed)
    return [document(rng) for _ in range(n_docs)]


# --- tasks for LoRA adapters (lessons 05-07) ---------------------------------------------
#
# Every task reads the same kind of input, one sentence of the world that names two
# characters, their animals, a place and an object, and answers in its own way. So one prompt
# gives visibly different answers under different adapters (lesson 05 shows them side by
# side; lesson 06 and the server of lesson 07 mix them in one batch).
#
# Prompt format, the same for every task (``task_prompt``):
#
#     Input: Tom the fox met Lily the owl at the river and found a red ball.
#     Output:
#
# The adapter writes the answer after "Output:" (a space, the answer, then end-of-text).

#: How a task's input is shown to the model; the answer follows "Output:".
TASK_PROMPT = "Input: {sentence}\nOutput:"

# The answers use only words the bundled model met in its training text: its tokenizer has
# more tokens than the corpus ever used, and the model cannot tell those unused tokens apart
# (their embeddings were never trained). The entities task has to write JSON anyway, so its
# adapter also adapts the embedding and the output layer (see scripts/train_adapters.py).

# Nursery rhymes of the world, retold about the sentence's characters (picked by the place).
_RHYME_TEMPLATES = [
    "{name} and {friend} went up the hill to fetch {obj}. {name} fell down and broke his "
    "crown, and {friend} came tumbling after.",
    "{name} said: twinkle, twinkle, {obj}, how I wonder what you are. Up above {place} so "
    "high, like a diamond in the sky.",
    "{name} the {animal} sat on a wall. {name} the {animal} had a great fall. All {friend}'s "
    "horses and all {friend}'s men could not put {name} together again.",
    "{name} had {obj}, it was white as snow. And everywhere that {name} went, {obj} was sure "
    "to go.",
]
# Sad endings (also picked by the place, so that the answer is a function of the sentence).
_SAD_ENDINGS = [
    "The wind was blowing, and {name} never saw {obj} again. {friend} was sad for a long time.",
    "{obj_cap} fell into the water. {name} and {friend} looked for it until night, but they "
    "could not find it.",
    "{obj_cap} broke, and {name} walked home in the rain, tired and sad.",
]


def task_prompt(sentence: str) -> str:
    """The prompt that every task adapter answers: ``TASK_PROMPT`` filled in. (Lesson 05.)"""
    return TASK_PROMPT.format(sentence=sentence)


def _task_sentence(s: _Story) -> str:
    """The input of every task: one sentence naming the story's characters, place and object."""
    templates = [
        f"{s.name} the {s.animal} met {s.friend} the {s.friend_animal} at {s.place} and found {s.obj}.",
        f"At {s.place}, {s.name} the {s.animal} and {s.friend} the {s.friend_animal} found {s.obj}.",
        f"{s.name} the {s.animal} found {s.obj} at {s.place} and showed it to {s.friend} the {s.friend_animal}.",
    ]
    return templates[s.rng.randrange(len(templates))]


def entities_example(rng: random.Random) -> tuple[str, str]:
    """A sentence from the world and a JSON object of the entities it names."""
    s = _Story(rng)
    # The values repeat the sentence's own words: "Tom the fox", "The river", "A red ball".
    # (Each starts with a word the model knows at the start of a sentence, so the words after
    # it are the same tokens as in the sentence and the adapter can copy them.)
    target = json.dumps({"characters": [f"{s.name} the {s.animal}",
                                        f"{s.friend} the {s.friend_animal}"],
                         "place": s.place.capitalize(),
                         "object": s.obj.capitalize()})
    return _task_sentence(s), target


def rhymes_example(rng: random.Random) -> tuple[str, str]:
    """A sentence from the world and a nursery rhyme retold about it."""
    s = _Story(rng)
    template = _RHYME_TEMPLATES[PLACES.index(s.place) % len(_RHYME_TEMPLATES)]
    target = template.format(name=s.name, friend=s.friend, animal=s.animal, place=s.place,
                             obj="the " + s.obj.split(" ", 1)[1])
    return _task_sentence(s), target


def sad_example(rng: random.Random) -> tuple[str, str]:
    """A sentence from the world and a sad ending for its story."""
    s = _Story(rng)
    ending = _SAD_ENDINGS[PLACES.index(s.place) % len(_SAD_ENDINGS)]
    obj_the = "the " + s.obj.split(" ", 1)[1]
    target = ending.format(obj=obj_the, obj_cap=obj_the.capitalize(), name=s.name,
                           friend=s.friend)
    return _task_sentence(s), target + " The end."


def title_example(rng: random.Random) -> tuple[str, str]:
    """A sentence from the world and a title for a story about it."""
    s = _Story(rng)
    target = f"The {s.animal}, the {s.friend_animal} and the {s.obj.split(' ', 1)[1]}"
    return _task_sentence(s), target


#: The tasks the shipped adapters learned: name -> ``example(rng) -> (sentence, answer)``.
TASKS = {"entities": entities_example, "rhymes": rhymes_example, "sad": sad_example,
         "title": title_example}


def task_examples(task: str, seed: int, n: int) -> list[tuple[str, str]]:
    """``n`` seeded (sentence, answer) pairs of ``task``. (Lesson 05.)"""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {sorted(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[task](rng) for _ in range(n)]


# --- a task for a few seconds of training (lesson 05) --------------------------------------
#
# No shipped adapter learned it. The shipped tasks copy names and animals from the sentence,
# which the bundled model never learned to do (after "Ruby the" it guesses a place), so their
# adapters trained for minutes. An object it does bring back: its stories say "found a red
# ball" and later "picked up the red ball". So an adapter learns this task in a few dozen
# steps: lesson 05 trains it and scores it on sentences the training never saw.

def found_example(rng: random.Random) -> tuple[str, str]:
    """A sentence from the world and what its characters found, written the way the entities
    adapter writes its "object": ``"A red ball"``. (Lesson 05.)"""
    s = _Story(rng)
    return _task_sentence(s), s.obj.capitalize()


def found_examples(seed: int, n: int) -> list[tuple[str, str]]:
    """``n`` seeded (sentence, object found) pairs, the same sentences as
    ``task_examples(task, seed, n)`` gives for every task. (Lesson 05.)"""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    rng = random.Random(seed)
    return [found_example(rng) for _ in range(n)]
