"""Train the shipped LoRA adapters of the bundled model with peft, one per task of the world.

    python scripts/train_adapters.py                      # every task, minutes each on a CPU
    python scripts/train_adapters.py --tasks entities     # just one
    python scripts/train_adapters.py --check              # no training: measure the shipped ones

The tasks are ``helpers.corpus.TASKS``. Every task reads one sentence of the world and answers
in its own way, after the same prompt (``helpers.corpus.TASK_PROMPT``)::

    Input: Tom the fox met Lily the owl at the river and found a red ball.
    Output: <the answer> <|endoftext|>

    entities  a JSON object of the characters, the place and the object the sentence names
    rhymes    a nursery rhyme retold about it
    sad       a sad ending for the story
    title     a title for the story

Only the answer is learned (the prompt's tokens get label -100). Each adapter is LoRA of rank 8
on every projection of the GPT-2 blocks (c_attn, c_proj, c_fc) and of rank 32 on the token
embedding (wte) and the output layer (lm_head, tied to wte), saved with ``save_pretrained``
(safetensors) in helpers/assets/adapters/<task>/ together with training_log.json (time, loss,
held-out checks). Then helpers/assets/adapters/README.md is written from those logs.

Why wte and lm_head too. For entities: JSON is made of characters ({ } [ ] ") and word pieces
("characters" without a space before it) that never occur in the corpus. The tokenizer has
tokens for them, but the bundled model never saw those tokens, so their embeddings were never
trained and all look alike to it. For every task: an answer has to copy words from its sentence
(names, animals, the object), and adapters with LoRA on the blocks only, trained 60-100 steps,
learnt each answer's shape but guessed the names and animals (0-10 % of held-out answers exactly
right). Retrained with wte and lm_head adapted and for 1000-1600 steps, they copy them. Both were
changed at once, so which of the two mattered is not measured; the loss shows the moment a run
starts copying (it drops from a plateau: after about 150 steps for rhymes and sad, about 300
for title). Title was the hardest (its animals follow no name to copy them after): at the
default learning rate its runs stayed on the plateau or were thrown off it, so it trains at
3e-3 (with seed 1, the first seed tried there).

The names inside JSON are harder still. There a name is written without a space before it, and
byte-level BPE makes "Tom" and " Tom" two unrelated tokens; the bundled model saw the bare ones
too rarely to treat them as the same name, so an adapter started the usual way (B = 0) learns
to guess a name instead of copying it. So 16 of the 32 ranks of the wte and lm_head LoRA start
with each bare name reading and writing like its spaced twin (``start_names_as_spaced``); the
other 16 start as peft starts them. Training takes it from there. (The other tasks write names
after a space, as in the sentence; they get the same start, which does them no harm.)

Dropout is off while training (the model is in eval mode): each example is seen once.

Seeded: on one machine with a fixed thread count, a rerun gives the same adapters (each log
records the thread count).
The held-out check generates greedily for ``--eval`` sentences that the training never saw and
reports how many answers match exactly, and how often each part is right: for entities whether
it parses as JSON and each field, for the other tasks the format (the right template) and each
name, animal, place and object copied from the sentence (``answer_part_rates``).
"""

import argparse
import json
import pathlib
import platform
import random
import re
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from helpers.corpus import TASK_PROMPT, TASKS, task_examples, task_prompt  # noqa: E402
from helpers.models import BUNDLED_MODEL_DIR, load_model  # noqa: E402

ADAPTERS = ROOT / "helpers" / "assets" / "adapters"
BLOCK_MODULES = ["c_attn", "c_proj", "c_fc"]
#: Per task: extra target modules with their rank, training steps (batch 16) and, where they
#: differ from the defaults (seed 0, --lr), the seed and learning rate of the run that shipped.
TASK_SETTINGS = {
    "entities": {"extra_modules": {"wte": 32, "lm_head": 32}, "steps": 1200},
    "rhymes": {"extra_modules": {"wte": 32, "lm_head": 32}, "steps": 1000},
    "sad": {"extra_modules": {"wte": 32, "lm_head": 32}, "steps": 1000},
    "title": {"extra_modules": {"wte": 32, "lm_head": 32}, "steps": 1400, "seed": 1, "lr": 3e-3},
}
#: The sentence every adapter answers in the README (and lessons 05-06 show side by side).
DEMO_SENTENCE = "Tom the fox met Lily the owl at the river and found a red ball."
TRAIN_SEED, EVAL_SEED = 100, 999


def encode_examples(tokenizer, pairs):
    """Token ids and labels per example: prompt ids + answer ids + EOS; labels -100 on the
    prompt. The prompt is tokenized alone, exactly as it is when the adapter is used."""
    rows = []
    for sentence, answer in pairs:
        prompt = tokenizer(task_prompt(sentence)).input_ids
        target = tokenizer(" " + answer).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt + target, [-100] * len(prompt) + target))
    return rows


def collate(rows, pad_id):
    """Right-pad a list of (ids, labels) into tensors; padding is masked and not learned."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(row_ids)] = 1
    return ids, labels, mask


@torch.no_grad()
def greedy_answers(model, tokenizer, sentences, max_new_tokens=90):
    """Greedy answers for a batch of sentences (left-padded prompts), stopped at EOS."""
    batch = tokenizer([task_prompt(s) for s in sentences], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    new = out[:, batch.input_ids.shape[1]:]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


def entity_field_rates(answers, wanted) -> dict[str, float]:
    """For the entities task: how often each part of the answers is right -- the characters'
    names, their animals, the place and the object (an answer that does not parse counts as
    wrong everywhere)."""
    right = {"names": 0, "animals": 0, "place": 0, "object": 0}
    for answer, want in zip(answers, wanted):
        want = json.loads(want)
        try:
            got = json.loads(answer)
        except json.JSONDecodeError:
            continue
        if not isinstance(got, dict):
            continue
        characters = got.get("characters") if isinstance(got.get("characters"), list) else []
        for g, w in zip(characters, want["characters"]):
            g_name, _, g_animal = str(g).partition(" the ")
            w_name, _, w_animal = w.partition(" the ")
            right["names"] += g_name == w_name
            right["animals"] += g_animal == w_animal
        right["place"] += got.get("place") == want["place"]
        right["object"] += got.get("object") == want["object"]
    n = len(wanted)
    return {key: value / (2 * n if key in ("names", "animals") else n)
            for key, value in right.items()}


def _part_patterns() -> dict[str, "re.Pattern"]:
    """One regular expression per kind of part a free-text answer copies from its sentence:
    the characters' names, their animals, the place ("river") and the object ("red ball")."""
    from helpers.corpus import ANIMALS, NAMES, OBJECTS, PLACES

    words = {"names": NAMES, "animals": ANIMALS,
             "place": [p.removeprefix("the ") for p in PLACES],
             "object": [o.split(" ", 1)[1] for o in OBJECTS]}
    return {part: re.compile(r"\b(" + "|".join(re.escape(w) for w in sorted(ws, key=len,
                                                                             reverse=True))
                             + r")\b") for part, ws in words.items()}


def answer_part_rates(answers, wanted) -> dict[str, float]:
    """For the free-text tasks (rhymes, sad, title): how often each part of the answers is
    right. "format": the answer is the expected text with any names, animals, places and
    objects in their slots (the right template, words and punctuation); "names", "animals",
    "place", "object": the ones the answer names, in order, are the expected ones (counted
    over the answers whose expected text names any)."""
    patterns = _part_patterns()

    def skeleton(text):
        for part, pattern in patterns.items():
            text = pattern.sub(f"<{part}>", text)
        return text

    right = {"format": 0} | {part: 0 for part in patterns}
    counted = {"format": len(wanted)} | {part: 0 for part in patterns}
    for answer, want in zip(answers, wanted):
        right["format"] += skeleton(answer) == skeleton(want)
        for part, pattern in patterns.items():
            if pattern.search(want):
                counted[part] += 1
                right[part] += pattern.findall(answer) == pattern.findall(want)
    return {part: right[part] / counted[part] for part in right if counted[part]}


def held_out_check(model, tokenizer, task, n, train_sentences):
    """Greedy answers for ``n`` unseen sentences: exact-match rate; for entities how many
    parse as JSON and how often each field is right, for the other tasks how often the format
    and each copied part (names, animals, place, object) are right."""
    pairs = [p for p in task_examples(task, EVAL_SEED, 4 * n) if p[0] not in train_sentences][:n]
    answers = greedy_answers(model, tokenizer, [s for s, _ in pairs])
    exact = sum(a == want for a, (_, want) in zip(answers, pairs)) / len(pairs)
    result = {"sentences": len(pairs), "exact_match": exact}
    if task == "entities":
        parsed = 0
        for a in answers:
            try:
                json.loads(a)
                parsed += 1
            except json.JSONDecodeError:
                pass
        result["json_parses"] = parsed / len(pairs)
        result["fields"] = entity_field_rates(answers, [want for _, want in pairs])
    else:
        result["parts"] = answer_part_rates(answers, [want for _, want in pairs])
    result["examples"] = [{"sentence": s, "answer": a} for (s, _), a in zip(pairs[:3], answers)]
    return result


def spaced_name_pairs(tokenizer) -> list[tuple[int, int]]:
    """(token of a name written without a space before it, token of the same name after a
    space) for every character name of the world, where both are single tokens."""
    from helpers.corpus import NAMES

    pairs = []
    for name in NAMES:
        bare, spaced = tokenizer(name).input_ids, tokenizer(" " + name).input_ids
        if len(bare) == 1 and len(spaced) == 1:
            pairs.append((bare[0], spaced[0]))
    return pairs


@torch.no_grad()
def start_names_as_spaced(model, tokenizer) -> int:
    """Start the entities adapter's wte and lm_head LoRA so that each bare name token
    ("Tom", as it is written inside JSON quotes) reads and writes like the spaced one
    (" Tom", as in the sentence). Byte-level BPE makes them two unrelated tokens, and the
    bundled model saw the bare ones too rarely to learn that they are the same names; with
    them alike from the start, copying a name from the sentence is something training can
    find. Returns how many names were paired. (The other ranks keep peft's start, so that
    training can use them too.)"""
    pairs = spaced_name_pairs(tokenizer)
    base = model.get_base_model()
    table = base.transformer.wte.base_layer.weight
    wte, head = base.transformer.wte, base.lm_head
    rank = wte.lora_embedding_A["default"].shape[0]
    if len(pairs) > rank:
        raise ValueError(f"{len(pairs)} names need a rank of at least {len(pairs)}, not {rank}")
    a_emb, b_emb = wte.lora_embedding_A["default"], wte.lora_embedding_B["default"]
    a_head, b_head = head.lora_A["default"].weight, head.lora_B["default"].weight
    scale_emb, scale_head = wte.scaling["default"], head.scaling["default"]
    for k, (bare, spaced) in enumerate(pairs):
        delta = table[spaced] - table[bare]
        a_emb[k, bare] = 1.0                      # embedding: row "Tom" += delta
        b_emb[:, k] = delta / scale_emb
        a_head[k] = delta / scale_head            # output layer: logit of "Tom" reads like " Tom"
        b_head[bare, k] = 1.0
    return len(pairs)


def train_one(task, args, tokenizer):
    from peft import LoraConfig, get_peft_model

    settings = TASK_SETTINGS[task]
    steps = args.steps or settings["steps"]
    extra = settings["extra_modules"]  # module -> rank; alpha = 2 × rank everywhere
    seed = settings.get("seed", 0) if args.seed is None else args.seed
    lr = settings.get("lr", 5e-3) if args.lr is None else args.lr
    torch.manual_seed(seed)
    model, _ = load_model(BUNDLED_MODEL_DIR, device="cpu")
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                        target_modules=BLOCK_MODULES + list(extra), fan_in_fan_out=True,
                        rank_pattern=dict(extra), alpha_pattern={m: 2 * r for m, r in extra.items()},
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    if "wte" in extra:
        print(f"  {task}: {start_names_as_spaced(model, tokenizer)} names start as spaced tokens")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    pairs = task_examples(task, TRAIN_SEED, steps * args.batch)
    rows = encode_examples(tokenizer, pairs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear decay to a tenth
        opt, lambda step: 1 - 0.9 * step / steps)
    log, start, cpu_start = [], time.perf_counter(), time.process_time()
    model.eval()  # dropout off (LoRA's weights still get their gradients)
    for step in range(steps):
        ids, labels, mask = collate(rows[step * args.batch:(step + 1) * args.batch],
                                    tokenizer.eos_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        log.append(round(loss.item(), 4))
        if step % 25 == 0 or step == steps - 1:
            print(f"  {task:9s} step {step:4d}  loss {loss.item():.3f}  "
                  f"{time.perf_counter() - start:6.1f} s", flush=True)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start  # all threads; less sensitive to other load

    folder = args.out / task
    if folder.exists():
        shutil.rmtree(folder)
    # save_embedding_layers=False: only LoRA's A and B, not a copy of the adapted embedding
    model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
    (folder / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
    # peft records the base model's absolute path; keep the one that holds in every clone.
    config_path = folder / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = str(BUNDLED_MODEL_DIR.relative_to(ROOT))
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    check = held_out_check(model, tokenizer, task, args.eval, {s for s, _ in pairs})
    demo = greedy_answers(model, tokenizer, [DEMO_SENTENCE])[0]
    info = {
        "task": task, "prompt_format": TASK_PROMPT, "rank": args.rank,
        "lora_alpha": 2 * args.rank, "target_modules": BLOCK_MODULES + list(extra),
        "rank_pattern": extra,
        "trainable_parameters": trainable,
        "adapter_bytes": (folder / "adapter_model.safetensors").stat().st_size,
        "steps": steps, "batch": args.batch, "lr": lr, "seed": seed,
        "train_seconds": round(seconds, 1), "train_cpu_seconds": round(cpu_seconds, 1),
        "final_loss": round(sum(log[-10:]) / len(log[-10:]), 4),  # mean of the last 10 steps
        "loss_every_step": log, "held_out": check, "demo": {"sentence": DEMO_SENTENCE,
                                                            "answer": demo},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }
    (folder / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{task}: {seconds:.0f} s, final loss {info['final_loss']:.3f}, held-out exact "
          f"{check['exact_match']:.0%}" + (f", JSON parses {check['json_parses']:.0%}"
                                           if "json_parses" in check else ""))
    print(f"  demo: {demo!r}")
    return info


def check_shipped(task, args, tokenizer):
    """Measure a shipped adapter again on the held-out sentences (no training) and record the
    result in its training_log.json."""
    from peft import PeftModel

    folder = ADAPTERS / task
    info = json.loads((folder / "training_log.json").read_text())
    base, _ = load_model(BUNDLED_MODEL_DIR, device="cpu")
    model = PeftModel.from_pretrained(base, folder).eval()
    trained_on = {s for s, _ in task_examples(task, TRAIN_SEED, info["steps"] * info["batch"])}
    info["held_out"] = held_out_check(model, tokenizer, task, args.eval, trained_on)
    info["demo"] = {"sentence": DEMO_SENTENCE,
                    "answer": greedy_answers(model, tokenizer, [DEMO_SENTENCE])[0]}
    (folder / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
    h = info["held_out"]
    rates = h.get("parts") or h.get("fields")
    print(f"{task}: held-out exact {h['exact_match']:.0%} of {h['sentences']}; "
          + ", ".join(f"{k} {v:.0%}" for k, v in rates.items()))
    return info


def write_readme(base_demo):
    """helpers/assets/adapters/README.md from every adapter's training_log.json."""
    infos = [json.loads(p.read_text()) for p in sorted(ADAPTERS.glob("*/training_log.json"))]
    lines = [
        "# The shipped LoRA adapters", "",
        "LoRA adapters of the bundled model (`helpers/assets/model`), trained with peft by "
        "`scripts/train_adapters.py` (seeded) on the tasks in `helpers.corpus.TASKS`. Lesson 05 "
        "shows them side by side, lesson 06 mixes them in one batch "
        "(`helpers.load_adapters`), and the server of lesson 07 serves them by name.", "",
        "Every adapter answers the same prompt (`helpers.corpus.task_prompt(sentence)`):", "",
        "```", TASK_PROMPT.format(sentence=DEMO_SENTENCE), "```", "",
        "and writes its answer after `Output:`, ending with `<|endoftext|>`. Each folder holds "
        "what peft's `save_pretrained` writes (`adapter_config.json`, "
        "`adapter_model.safetensors`) and `training_log.json` (loss at every step, held-out "
        "checks, machine).", "",
        "| adapter | task | rank (alpha) | target modules | size | training (wall, CPU) | final loss | "
        "held-out exact | held-out, right parts |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    def modules(info):
        extra = info.get("rank_pattern", {})
        return ", ".join(m + (f" (rank {extra[m]})" if m in extra else "")
                         for m in info["target_modules"])

    for i in infos:
        h = i["held_out"]
        rates = h.get("fields") or h.get("parts") or {}
        json_rate = ", ".join(f"{k} {v:.0%}" for k, v in rates.items()) or "–"
        if "json_parses" in h:
            json_rate = f"JSON parses {h['json_parses']:.0%}, " + json_rate
        lines.append(
            f"| `{i['task']}` | {TASKS[i['task']].__doc__.split(' and ', 1)[1].rstrip('.')} | "
            f"{i['rank']} ({i['lora_alpha']}) | {modules(i)} | "
            f"{i['adapter_bytes'] / 1024:.0f} KiB | {i['train_seconds']:.0f} s "
            f"({i['train_cpu_seconds']:.0f} CPU s), "
            f"{i['steps']} steps × {i['batch']} | {i['final_loss']:.3f} | "
            f"{h['exact_match']:.0%} of {h['sentences']} | {json_rate} |")
    arches = sorted({i["machine"].split(",")[0] for i in infos})
    threads = sorted({i["machine"].split(", ")[-1].split()[0] for i in infos})
    machine = (f"{' and '.join(arches)} with {' or '.join(threads)} threads (each "
               "training_log.json says which)")
    lines += [
        "", "Every adapter also adapts the token embedding (`wte`) and the output layer "
        "(`lm_head`, tied to it), at rank 32. The entities adapter needs them for JSON: it is "
        "written with characters and word pieces (`{`, `\"`, `characters` without a space "
        "before it) that never occur in the bundled model's training text, so their embeddings "
        "were never trained and look alike to the model. And every adapter has to copy words "
        "from its sentence: the names, the animals, the place, the object. Adapters with LoRA "
        "on the blocks only, trained 60-100 steps, learnt each answer's format and the object "
        "but guessed the names and animals (0-10 % exactly right on held-out sentences); "
        "retrained with `wte` and `lm_head` adapted and for longer (the training column), they "
        "copy them. Both changed at once, so which one mattered is not measured. In each "
        "training_log.json the loss shows when a run starts copying: it drops from a plateau.",
        "",
        "Half of the `wte` and `lm_head` ranks start by making each name written without a "
        "space (\"Tom\", as inside JSON quotes) read and write like the same name after a "
        "space (\" Tom\", as in the sentence), two tokens that byte-level BPE keeps apart and "
        "the bundled model never learnt to connect; without that start the entities adapter "
        "learnt the format and the object and guessed every name. (The other tasks write names "
        "after a space; they get the same start.)"]
    lines += [
        "", f"Training times were measured on {machine}, on a CPU with other jobs sharing its "
        "cores: the wall time depends on them, the CPU seconds (all threads) much less; final loss is the mean "
        "cross-entropy (nats per answer token) of the last 10 training steps. Held-out: "
        "greedy answers for sentences the training never saw, compared with the task's "
        "answer: exactly, and part by part (for entities: parses as JSON, then each field; "
        "for the others: format = the right template with the right words and punctuation, "
        "then the names, animals, place and object it copies, each counted over the answers "
        "that should name one). `python scripts/train_adapters.py --check` measures them "
        "again.", "",
        "## One prompt, every adapter", "",
        f"Input: `{DEMO_SENTENCE}` (greedy decoding)", "",
        "| adapter | answer |", "|---|---|",
        f"| none (base model) | `{base_demo}` |".replace("\n", "⏎"),
    ]
    for i in infos:
        lines.append(f"| `{i['task']}` | `{i['demo']['answer']}` |".replace("\n", "⏎"))
    if any("\n" in i["demo"]["answer"] for i in infos):
        lines += ["", "(⏎ marks a line break in the answer.)"]
    lines += ["", "## Reproduce", "", "```bash", "python scripts/train_adapters.py", "```", ""]
    (ADAPTERS / "README.md").write_text("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="override every task's steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None,
                    help="override every task's learning rate (TASK_SETTINGS; 5e-3 where it "
                         "names none)")
    ap.add_argument("--eval", type=int, default=50, help="held-out sentences to check")
    ap.add_argument("--seed", type=int, default=None,
                    help="override every task's seed (TASK_SETTINGS; 0 where it names none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check", action="store_true",
                    help="train nothing: measure the shipped adapters on the held-out sentences "
                         "again, record it in their training_log.json and rewrite the README")
    ap.add_argument("--out", type=pathlib.Path, default=ADAPTERS,
                    help="where to write the adapters (another folder leaves the shipped ones "
                         "and their README alone)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(0)
    model, tokenizer = load_model(BUNDLED_MODEL_DIR, device="cpu")
    base_demo = greedy_answers(model, tokenizer, [DEMO_SENTENCE], max_new_tokens=30)[0]
    del model
    if args.check:
        for task in args.tasks:
            check_shipped(task, args, tokenizer)
        write_readme(base_demo)
        return
    results = [train_one(task, args, tokenizer) for task in args.tasks]
    if args.out.resolve() == ADAPTERS.resolve():
        write_readme(base_demo)
    print("\n".join(f"{r['task']:9s} {r['train_seconds']:6.1f} s  loss {r['final_loss']:.3f}"
                    for r in results))


if __name__ == "__main__":
    main()
