"""Train the bundled model: a small GPT-2 (GPT2LMHeadModel) on the course corpus.

    python scripts/train_tokenizer.py      # first, writes the tokenizer
    python scripts/train_model.py          # then this, writes model.safetensors + config

Seeded and deterministic on one machine (CPU, fixed thread count). Writes the weights,
config, generation config and a training log (loss per logged step, wall time, machine)
into helpers/assets/model/, where helpers.load_model() finds them.
"""

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402

from helpers.corpus import EOS, corpus  # noqa: E402

MODEL_DIR = pathlib.Path(__file__).resolve().parents[1] / "helpers" / "assets" / "model"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def token_blocks(tokenizer, seed: int, n_docs: int, block: int) -> torch.Tensor:
    """Every document followed by EOS, concatenated, cut into rows of ``block`` tokens."""
    ids = []
    for enc in tokenizer(corpus(seed, n_docs)).input_ids:
        ids.extend(enc)
        ids.append(tokenizer.convert_tokens_to_ids(EOS))
    n = len(ids) // block
    return torch.tensor(ids[: n * block]).view(n, block)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="helpers/assets/model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    data = token_blocks(tokenizer, args.seed, args.docs, args.context)
    print(f"{data.numel():,} training tokens in {len(data):,} rows of {args.context}")

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.context, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params:,} parameters")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step):  # linear warm-up, then cosine decay to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(args.seed)
    log, start = [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        rows = torch.randint(len(data), (args.batch,), generator=gen)
        batch = data[rows].to(args.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            log.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(elapsed, 1)})
            print(f"step {step:5d}  loss {loss.item():.3f}  {elapsed:7.1f} s", flush=True)
    seconds = time.perf_counter() - start

    model = model.cpu().eval()
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    # Loss on the last 256 rows (the model saw them only by chance) for the card.
    with torch.no_grad():
        final = model(input_ids=data[-256:][:64], labels=data[-256:][:64]).loss.item()
    machine = (f"{platform.processor() or platform.machine()}, {args.threads} threads"
               if args.device == "cpu" else torch.cuda.get_device_name())
    info = {"parameters": n_params, "train_seconds": round(seconds, 1), "device": args.device,
            "machine": machine, "tokens_seen": args.steps * args.batch * args.context,
            "final_loss": round(final, 4), "args": vars(args), "log": log,
            "torch": torch.__version__, "cpus": os.cpu_count()}
    pathlib.Path(args.out, "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"done in {seconds:.0f} s, final loss {final:.3f}")
    if pathlib.Path(args.out).resolve() == MODEL_DIR:
        import model_card

        model_card.main()


if __name__ == "__main__":
    main()
