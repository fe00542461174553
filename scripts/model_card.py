"""Write the bundled model's card (helpers/assets/model/README.md) from its training log.

    python scripts/model_card.py

train_model.py calls this at the end; run it alone after editing the text below.
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ROOT / "helpers" / "assets" / "model"
sys.path.insert(0, str(ROOT))



def cpu_note(log: dict) -> str:
    """How fast training ran at its quickest stretch: the honest figure for a quiet machine."""
    points = log["log"]
    rates = [(b["seconds"] - a["seconds"]) / (b["step"] - a["step"])
             for a, b in zip(points, points[1:]) if b["step"] > a["step"]]
    best = sorted(rates)[len(rates) // 4] if rates else float("nan")  # a quiet-machine rate
    steps = log["args"]["steps"]
    return (f"The wall time above is what this run took on the course's reference machine (2 CPU "
            f"cores, no GPU), part of it while other work shared the cores. Its quieter stretches "
            f"ran at {best:.2f} s per step, so the same run alone on such a machine takes about "
            f"{best * steps / 60:.0f} minutes. No GPU run has been recorded yet.")


def sample_continuations() -> str:
    import torch

    from helpers import generate_with_cache, load_model

    torch.set_num_threads(2)
    model, tokenizer = load_model(str(MODEL), device="cpu")
    prompts = ["The quick brown fox jumped over the", "The rain in Spain falls",
               "What comes up must", "Jack and Jill", "Humpty Dumpty sat"]
    rows = []
    for p in prompts:
        g = generate_with_cache(model, tokenizer, p, max_new_tokens=20, stop_at_eos=False)
        text = g.text.replace(tokenizer.eos_token, " ⏎ ").strip()  # ⏎ = end of a document
        rows.append(f"| {p} | {text} |".replace("\n", " "))
    return "\n".join(["| prompt | greedy continuation, 20 tokens (⏎ marks the end-of-text token) |", "|---|---|", *rows])


def chat_section() -> str:
    """The chat template shipped in tokenizer_config.json, and what it makes of a chat."""
    from helpers import generate_with_cache, load_model

    model, tokenizer = load_model(str(MODEL), device="cpu")
    messages = [{"role": "user", "content": "Jack and Jill"},
                {"role": "assistant", "content": " went up the hill to fetch a pail of water."},
                {"role": "user", "content": "Once upon a time, there was a fox"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    answer = generate_with_cache(model, tokenizer, prompt, max_new_tokens=30).text
    return f"""
## Chat template

The model continues text; it was never trained to follow instructions or to take turns. Its
chat template (`chat_template` in `tokenizer_config.json`, written by
`scripts/train_tokenizer.py`, applied by `tokenizer.apply_chat_template` and by the course
server's `/v1/chat/completions`) therefore writes a conversation the way its training text
looks: a user message is the beginning of a passage, the assistant's answer is the model's
continuation of it, and the end-of-text token closes each answered passage, as it closes each
document of the corpus. System messages are left out: the model cannot use them, and text it
has never seen before a passage only pulls its continuation off course. Chat with it as with a
completion: give the beginning of a rhyme or a story.

The messages `{json.dumps([m["content"] for m in messages])}`
(user, assistant, user) become the prompt `{json.dumps(prompt)}`,
and the model answers (greedy, 30 tokens at most): `{json.dumps(answer)}`.
"""


def adapters_section() -> str:
    """The shipped LoRA adapters (scripts/train_adapters.py), from their training logs."""
    folder = MODEL.parent / "adapters"
    rows = []
    for log_path in sorted(folder.glob("*/training_log.json")):
        log = json.loads(log_path.read_text())
        rows.append(f"| {log_path.parent.name} | {log.get('steps', '?')} | "
                    f"{log.get('train_seconds', float('nan')):.0f} s | "
                    f"{log.get('final_loss', float('nan')):.3f} |")
    if not rows:
        return ""
    return ("\n## LoRA adapters trained on this model\n\n"
            "Trained with peft by `python scripts/train_adapters.py` (seeded) on tasks from the same "
            "world; details, prompt formats and examples in "
            "[helpers/assets/adapters/README.md](../adapters/README.md). Training time is wall "
            "time on the same 2-core machine, shared with other jobs at the time.\n\n"
            "| adapter | steps | training time | final loss |\n|---|---:|---:|---:|\n"
            + "\n".join(rows) + "\n")


def main():
    log = json.loads((MODEL / "training_log.json").read_text())
    config = json.loads((MODEL / "config.json").read_text())
    a = log["args"]
    size = sum(p.stat().st_size for p in MODEL.iterdir() if p.is_file())
    weights = (MODEL / "model.safetensors").stat().st_size
    card = f"""# The course's bundled model

A small language model of the GPT-2 architecture (`GPT2LMHeadModel`), trained from scratch for
this course so that every lesson runs offline. It knows one small world: short stories about
animals and children, a handful of nursery rhymes and sayings. Inside that world its greedy
continuations are fluent English; outside it, it falls back on the phrases it knows.

| | |
|---|---|
| architecture | GPT-2: {config['n_layer']} layers, hidden {config['n_embd']}, {config['n_head']} heads, context {config['n_positions']} tokens |
| parameters | {log['parameters']:,} (embeddings tied with the output layer) |
| vocabulary | {config['vocab_size']} byte-level BPE tokens, trained with `tokenizers`; `<|endoftext|>` is EOS and padding |
| weights | `model.safetensors`, float32, {weights / 2**20:.1f} MiB (this folder: {size / 2**20:.1f} MiB) |
| corpus | `helpers.corpus.corpus(seed=0, n_docs={a['docs']})`, a seeded generator (stories 60 %, rhymes 28 %, sayings 12 %) |
| training | {a['steps']} steps × {a['batch']} rows × {a['context']} tokens = {log['tokens_seen']:,} tokens; AdamW, lr {a['lr']}, warm-up then cosine; seed {a['seed']} |
| training time | {log['train_seconds'] / 60:.1f} min on {log['machine']} ({log['device']}), torch {log['torch']} |
| final loss | {log['final_loss']:.3f} nats per token (cross-entropy on training rows) |
| licence | MIT, like the rest of the course |

{cpu_note(log)}

## Reproduce

```bash
make model            # = python scripts/train_tokenizer.py && python scripts/train_model.py
```

Both scripts are seeded; on the same machine and thread count they give the same weights.
`python scripts/train_model.py --device cuda` trains on a GPU (not needed; same recipe).

## What it says

{sample_continuations()}

## Loss during training

| step | loss | seconds |
|---:|---:|---:|
""" + "\n".join(f"| {r['step']} | {r['loss']:.3f} | {r['seconds']:.0f} |" for r in log["log"][::2]) + "\n"
    card += chat_section()
    card += adapters_section()
    (MODEL / "README.md").write_text(card)
    print(f"wrote {MODEL / 'README.md'}")


if __name__ == "__main__":
    main()
