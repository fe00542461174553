"""Train the draft model of lesson 09: a much smaller GPT-2 on the bundled model's corpus.

    python scripts/train_draft.py           # train (about 7 minutes on one thread), then measure
    python scripts/train_draft.py --card    # copy the tokenizer again, measure, rewrite the card

Speculative decoding needs a draft that speaks the target's language token for token: the same
tokenizer (its files are copied from helpers/assets/model) and the same text. So this script
runs the very recipe of scripts/train_model.py (same corpus, seed, optimiser and schedule) with
a smaller shape: 2 layers of width 128 instead of 4 of width 256. Then it measures how often
the bundled model accepts the draft's guesses on held-out text (corpus seed 1) and writes the
model card, helpers/assets/draft/README.md.

Seeded; on the same machine and thread count it gives the same weights.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

import train_model  # noqa: E402
from helpers.corpus import corpus  # noqa: E402

DRAFT_DIR = ROOT / "helpers" / "assets" / "draft"
MODEL_DIR = ROOT / "helpers" / "assets" / "model"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]
#: The draft's shape and training run (the rest is train_model.py's recipe).
RECIPE = {"layers": 2, "hidden": 128, "heads": 2, "context": 256, "batch": 16, "steps": 1400,
          "lr": 3e-3, "seed": 0, "threads": 1}
#: The acceptance measurement: held-out stories, the first PROMPT_TOKENS tokens as the prompt.
PROMPTS, PROMPT_TOKENS, NEW_TOKENS, KS = 24, 12, 48, (1, 2, 4, 8)


def copy_tokenizer(out: pathlib.Path) -> None:
    """The bundled model's tokenizer files, copied next to the draft (load_model reads them)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(MODEL_DIR / name, out / name)


def train(out: pathlib.Path) -> None:
    """Run train_model.py's recipe with the draft's shape (the tokenizer must be there), and
    add the CPU seconds it took to its training log (the wall time depends on what else runs
    on the machine; the CPU time much less)."""
    argv = ["--out", str(out)]
    for key, value in RECIPE.items():
        argv += [f"--{key}", str(value)]
    cpu = time.process_time()
    train_model.main(argv)
    log = json.loads((out / "training_log.json").read_text())
    log["cpu_seconds"] = round(time.process_time() - cpu, 1)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def held_out_prompts(tokenizer) -> list[str]:
    """The first PROMPT_TOKENS tokens of held-out stories (corpus seed 1, never trained on)."""
    docs = [d for d in corpus(seed=1, n_docs=400) if len(tokenizer(d)["input_ids"]) > 60]
    return [tokenizer.decode(tokenizer(d)["input_ids"][:PROMPT_TOKENS]) for d in docs[:PROMPTS]]


def measure(out: pathlib.Path) -> dict:
    """Acceptance of the draft's proposals by the bundled model, greedy, for each k in KS; and
    the time of one decode step of each model (batch 1, one thread, median of 200)."""
    from helpers import load_model
    from helpers.speculative import DraftModelProposer, speculative_generate

    torch.set_num_threads(1)
    target, tokenizer = load_model(device="cpu")
    draft, _ = load_model(out, device="cpu")
    prompts = held_out_prompts(tokenizer)
    rows = []
    for k in KS:
        proposed = accepted = verifies = tokens = 0
        for prompt in prompts:
            result = speculative_generate(target, tokenizer, prompt, DraftModelProposer(draft),
                                          k=k, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
            proposed += result.proposed
            accepted += result.accepted
            verifies += result.verify_steps
            tokens += len(result.token_ids)
        rows.append({"k": k, "acceptance": accepted / proposed,
                     "tokens_per_verify": tokens / verifies})
    return {"prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
            "by_k": rows, "step_ms": {"target": step_ms(target), "draft": step_ms(draft)}}


def step_ms(model, context: int = 24, reps: int = 200) -> float:
    """Median milliseconds of one decode step (one token, a cache of ``context`` positions)."""
    ids = torch.arange(1, context + 1, device=model.device)[None]
    times = []
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        for _ in range(reps):
            start = time.perf_counter()
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-1)
    return sorted(times)[len(times) // 2] * 1000


def write_card(out: pathlib.Path, measured: dict) -> str:
    """The model card: shape, size, training, and the acceptance measured above."""
    log = json.loads((out / "training_log.json").read_text())
    config = json.loads((out / "config.json").read_text())
    mib = (out / "model.safetensors").stat().st_size / 2**20
    rows = "\n".join(f"| {r['k']} | {r['acceptance']:.0%} | {r['tokens_per_verify']:.2f} |"
                     for r in measured["by_k"])
    steps = measured["step_ms"]
    text = CARD.format(
        layers=config["n_layer"], hidden=config["n_embd"], heads=config["n_head"],
        context=config["n_positions"], params=log["parameters"], mib=mib,
        vocab=config["vocab_size"], steps=log["args"]["steps"], batch=log["args"]["batch"],
        lr=log["args"]["lr"], tokens=log["tokens_seen"], seconds=log["train_seconds"],
        machine=log["machine"], torch=log["torch"], loss=log["final_loss"], rows=rows,
        cpu_seconds=f"{log['cpu_seconds']:.0f}" if "cpu_seconds" in log else "?",
        prompts=measured["prompts"], prompt_tokens=measured["prompt_tokens"],
        new_tokens=measured["new_tokens"], target_ms=steps["target"], draft_ms=steps["draft"],
        ratio=steps["draft"] / steps["target"], cpu=platform.machine())
    (out / "README.md").write_text(text)
    (out / "acceptance.json").write_text(json.dumps(measured, indent=1) + "\n")
    return text


CARD = """\
# The draft model of lesson 09

A small GPT-2 (`GPT2LMHeadModel`) that proposes tokens for the bundled model
(`helpers/assets/model`) in speculative decoding. It has the bundled model's tokenizer (the
files here are copies of it) and was trained on the same corpus with the same recipe, only
smaller, so that it guesses what the bundled model would write, fast.

| | |
|---|---|
| architecture | GPT-2: {layers} layers, hidden {hidden}, {heads} heads, context {context} tokens |
| parameters | {params:,} (embeddings tied with the output layer) |
| vocabulary | {vocab} tokens, the bundled model's tokenizer |
| weights | `model.safetensors`, float32, {mib:.1f} MiB |
| corpus | `helpers.corpus.corpus(seed=0, n_docs=20000)`, as the bundled model |
| training | {steps} steps × {batch} rows × {context} tokens = {tokens:,} tokens; AdamW, lr {lr}, warm-up then cosine; seed 0 |
| training time | {seconds:.0f} s wall, {cpu_seconds} CPU s, on {machine}, torch {torch} (other jobs shared the machine's 2 cores) |
| final loss | {loss:.3f} nats per token (cross-entropy on training rows; the bundled model: 0.517) |
| one decode step, batch 1, one thread | {draft_ms:.2f} ms (the bundled model: {target_ms:.2f} ms, so {ratio:.2f}x of it; median of 200) |
| licence | MIT, like the rest of the course |

## How often the bundled model accepts its guesses

Greedy speculative decoding (`helpers.speculative_generate` with a `DraftModelProposer`) on
{prompts} held-out stories (`corpus(seed=1)`, never trained on): the first {prompt_tokens}
tokens as the prompt, {new_tokens} new tokens, no stop at end-of-text. Acceptance = accepted
draft tokens / proposed draft tokens; tokens per verify = tokens produced per forward pass of
the bundled model (accepted ones plus the one the model adds itself).

| k (tokens proposed per verify) | acceptance | tokens per verify |
|---:|---:|---:|
{rows}

The step times were measured on {cpu} with one torch thread, on a machine other jobs were
sharing: they vary from run to run, the acceptance does not (greedy, seeded). Whether the
draft makes decoding faster depends on those times as much as on the acceptance: lesson 09
section 5 and `benchmarks/bench_speculative.py` measure it.

## Reproduce

```bash
python scripts/train_draft.py          # train, measure, write this card
python scripts/train_draft.py --card   # copy the tokenizer again, measure, rewrite this card
```
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(DRAFT_DIR))
    ap.add_argument("--card", action="store_true", help="skip training; measure and write the card")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    copy_tokenizer(out)
    if not args.card:
        train(out)
    print(write_card(out, measure(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
