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


#: The chat template (tokenizer.apply_chat_template, the server's /v1/chat/completions): the
#: model continues text, so a user message starts a passage and the answer continues it; the
#: end-of-text token closes each answered passage; system messages are left out (model card).
CHAT_TEMPLATE = (
    "{#- The bundled story model continues text and cannot follow instructions: a user message "
    "is the start of a passage, the assistant's answer its continuation, and the end-of-text "
    "token closes each passage. System messages are left out (see the model card). -#}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'user' -%}{{ message['content'] }}\n"
    "{%- elif message['role'] == 'assistant' -%}{{ message['content'] }}{{ eos_token }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}")


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
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    sample = "The quick brown fox jumped over the lazy dog."
    print(f"vocabulary {len(tokenizer)}; {sample!r} -> {tokenizer.tokenize(sample)}")
