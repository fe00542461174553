"""Train the bundled model's byte-level BPE tokenizer on the course corpus.

    python scripts/train_tokenizer.py [--vocab-size 4096] [--out helpers/assets/model]

Deterministic: the corpus is seeded and the BPE trainer is not random.
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from helpers.corpus import EOS, corpus  # noqa: E402


def train_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   unk_token=EOS, model_max_length=256)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", default="helpers/assets/model")
    args = ap.parse_args()
    tokenizer = train_tokenizer(args.vocab_size)
    tokenizer.save_pretrained(args.out)
    # Name the GPT-2 tokenizer class so that transformers 4.x and 5.x both load it.
    cfg_path = pathlib.Path(args.out, "tokenizer_config.json")
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "GPT2TokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    sample = "The quick brown fox jumped over the lazy dog."
    print(f"vocabulary {len(tokenizer)}; {sample!r} -> {tokenizer.tokenize(sample)}")
