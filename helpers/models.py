"""Loading a causal language model and its tokenizer, ready for the lessons; ``Needs``, what
some cells need that only the bundled model comes with.

Introduced in lesson 01; every lesson starts with ``model, tokenizer = load_model()``.

With no name, ``load_model`` returns the small GPT-2-architecture model that ships inside this
package (``helpers/assets/model``), so the course runs with no network. Set the environment
variable ``COURSE_MODEL`` to a hub id (``gpt2``, ``Qwen/Qwen2.5-0.5B``) or a local folder to
switch every lesson to another model; that goes through the real ``from_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .quiet import import_torchao

#: Environment variable that selects the model every lesson loads by default.
MODEL_ENV_VAR = "COURSE_MODEL"
#: Folder of the bundled model and tokenizer (safetensors, tokenizer.json, model card).
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "model"
#: The name ``load_model`` understands as "the bundled model".
BUNDLED = "bundled"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def default_device() -> torch.device:
    """CUDA when a GPU is present, else CPU: where ``load_model`` puts the model by default."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_model_name(name: str | os.PathLike | None = None) -> str:
    """The model ``load_model(name)`` will load: ``name``, else $COURSE_MODEL, else bundled."""
    if name is None:
        name = os.environ.get(MODEL_ENV_VAR) or BUNDLED
    name = os.fspath(name)
    return str(BUNDLED_MODEL_DIR) if name == BUNDLED else name


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    if isinstance(dtype, str) and dtype.lower() == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    raise ValueError(f"dtype must be a torch.dtype, 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")


def load_tokenizer(name: str | os.PathLike | None = None):
    """The tokenizer of ``name`` (see ``load_model``), set up for batching:
    pad token = EOS token, left padding. (Lesson 01; padding is explained in lesson 02.)"""
    from transformers import AutoTokenizer

    path = resolve_model_name(name)
    tokenizer = _from_pretrained(AutoTokenizer, path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(name: str | os.PathLike | None = None, device=None, dtype=None):
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``. (Lesson 01.)

    name:   None for the bundled model (or whatever $COURSE_MODEL names), ``"bundled"``,
            a hub id such as ``"gpt2"``, or a local folder saved with ``save_pretrained``.
    device: None picks CUDA when present, else CPU.
    dtype:  None (float32), a ``torch.dtype``, ``"float16"``/``"bfloat16"``/``"float32"``,
            or ``"auto"`` (float16 on CUDA, float32 on CPU).

    The model is in eval mode; the tokenizer pads on the left with EOS.
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device) if device is not None else default_device()
    torch_dtype = _resolve_dtype(dtype, device)
    path = resolve_model_name(name)
    tokenizer = load_tokenizer(path)
    model = _from_pretrained(AutoModelForCausalLM, path, dtype=torch_dtype)
    model.to(device).eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _quiet_torchao() -> None:
    """When torchao is installed, transformers imports it while loading a model, and on a
    machine without its CUDA extensions that import prints warnings on stderr. Import it once,
    quietly, first (lesson 04 uses torchao; the other lessons should not hear about it)."""
    import importlib.util
    import sys

    if "torchao" not in sys.modules and importlib.util.find_spec("torchao") is not None:
        import_torchao(missing_ok=True)


def _from_pretrained(cls, path: str, **kwargs):
    """``cls.from_pretrained(path)`` with an error that says what to do when offline.

    transformers' "Loading weights" progress bar is switched off while loading: it is noise in a
    lesson, and its timings would differ on every run of a saved notebook.
    """
    from transformers.utils import logging as hf_logging

    _quiet_torchao()
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as err:
        if Path(path).exists():
            raise
        raise OSError(
            f"Could not load {path!r}: it is not a local folder and the model hub could not "
            f"provide it (no network, HF_HUB_OFFLINE=1, or a wrong id). Original error: {err}\n"
            f"To use the course's bundled model instead, call load_model() with no name and "
            f"unset {MODEL_ENV_VAR} (it is currently {os.environ.get(MODEL_ENV_VAR)!r})."
        ) from err
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class Needs:
    """What some of a lesson's cells need that only the bundled model comes with (the shipped
    LoRA adapters, the course's draft), and why this model lacks it, if it does.

    Made by ``helpers.lora.shipped_adapters_fit`` and ``helpers.speculative.course_draft``; a
    cell that needs the thing starts with ``if not needs.missing("Section 6"):``, which prints
    one line and returns True when the cell must skip. (Lessons 05-09.)
    """

    def __init__(self, what: str, problem: str | None = None):
        self.what = what
        self.problem = problem

    @property
    def ok(self) -> bool:
        """True when the model has what these cells need."""
        return self.problem is None

    def missing(self, part: str) -> bool:
        """True, after printing why, when ``part`` of the lesson must be skipped."""
        if self.problem is not None:
            print(f"{part}: skipped, {self.what} {self.problem}.")
        return self.problem is not None

    def __repr__(self) -> str:
        return f"Needs({self.what!r}, {'ok' if self.ok else self.problem!r})"
