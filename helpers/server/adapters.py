"""Which adapters a request may name, and loading them into the running model. (Lesson 07.)

Two sources, as in LoRAX: ``local``, a folder's NAME in the server's adapters folder (no
paths), and ``hub``, a Hugging Face Hub repository id. Adapters load on first use into one
``MultiLora`` (lesson 06) and stay loaded. An adapter is first checked from its config and
its safetensors header alone (never a pickle). Errors hold no path on the server's disk.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path

from ..lora import MultiLora
from .errors import GenerationFailed, InvalidRequest, NotFound, Unavailable

log = logging.getLogger("helpers.server")

#: A local adapter's name: letters, digits, "_", "-", "." (not first), at most 100 characters.
LOCAL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$")
#: A hub repository id: "name" or "owner/name".
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}(/[A-Za-z0-9_.\-]{1,96})?$")
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
#: Largest LoRA rank accepted (the shipped adapters use 8, and 32 on the embeddings).
MAX_RANK = 128
#: Largest adapter weights file: twice the model's weights, but at least this many bytes.
MIN_ADAPTER_LIMIT = 64 << 20
#: Largest adapter_config.json, in bytes.
MAX_CONFIG_BYTES = 1 << 20
#: Hub adapters one server keeps loaded (they are never unloaded).
MAX_HUB_ADAPTERS = 8
#: The tensor names of a peft LoRA adapter (see helpers.lora._read_adapter).
_LORA_TENSOR = re.compile(r"\.lora_(A|B)\.weight$|\.lora_embedding_(A|B)$")


class BrokenAdapter(Exception):
    """An adapter's files are unreadable or no LoRA adapter (the message holds no path)."""


def local_adapters(folder: str | os.PathLike) -> list[str]:
    """Names of the adapters in ``folder``: sub-folders holding safetensors weights."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if p.is_dir() and p.resolve().parent == folder and (p / WEIGHTS).is_file()
                  and LOCAL_NAME.fullmatch(p.name))


def check_adapter_files(folder: Path, max_bytes: int = MIN_ADAPTER_LIMIT) -> None:
    """``BrokenAdapter`` unless ``folder`` holds a LoRA config and at most ``max_bytes`` of
    safetensors LoRA matrices of rank up to ``MAX_RANK`` (only its header is read)."""
    from safetensors import safe_open

    config_file, weights_file = folder / CONFIG, folder / WEIGHTS
    if not config_file.is_file():
        raise BrokenAdapter(f"it has no {CONFIG}")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise BrokenAdapter(f"its {CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_file.read_bytes())
    except (ValueError, RecursionError):
        raise BrokenAdapter(f"its {CONFIG} is not valid JSON") from None
    if not isinstance(config, dict):
        raise BrokenAdapter(f"its {CONFIG} is not a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise BrokenAdapter(f"its {CONFIG} gives r={rank!r}, not a rank from 1 to {MAX_RANK}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise BrokenAdapter(f"its {CONFIG} gives lora_alpha={alpha!r}, not a number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise BrokenAdapter(f"its {CONFIG} has a {key} that is not an object")
    size = weights_file.stat().st_size
    if size > max_bytes:
        raise BrokenAdapter(f"its {WEIGHTS} is {size} bytes, more than an adapter of this "
                            f"model can be (at most {max_bytes})")
    try:
        with safe_open(str(weights_file), "pt") as weights:
            shapes = {key: weights.get_slice(key).get_shape() for key in weights.keys()}
    except Exception as err:          # safetensors' own error type differs across versions
        log.warning("adapter weights %s cannot be read: %s", weights_file, err)
        raise BrokenAdapter(f"its {WEIGHTS} is not a readable safetensors file (truncated or "
                            f"corrupt)") from None
    if not shapes:
        raise BrokenAdapter(f"its {WEIGHTS} holds no tensors")
    for key, shape in shapes.items():
        if not _LORA_TENSOR.search(key):
            raise BrokenAdapter(f"its {WEIGHTS} holds {key[:80]!r}: no LoRA A or B matrix")
        if len(shape) != 2 or min(shape) < 1:
            raise BrokenAdapter(f"its tensor {key[:80]!r} has shape {list(shape)}, not 2-D")
        if min(shape) > MAX_RANK:
            raise BrokenAdapter(f"its tensor {key[:80]!r} has rank {min(shape)} > {MAX_RANK}")


class AdapterStore:
    """Resolves a request's adapter to a name loaded in ``lora``, loading it if needed.
    ``lock``: the engine's lock around a step."""

    def __init__(self, model, folder: str | os.PathLike | None, lock: threading.RLock):
        self.folder = Path(folder).resolve() if folder is not None else None
        self.lora = MultiLora(model)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.max_adapter_bytes = max(MIN_ADAPTER_LIMIT, 2 * model_bytes)
        self.lock = lock
        self._loading = threading.Lock()
        self._fetching: set[str] = set()       # hub adapters being downloaded right now

    @property
    def loaded(self) -> list[str]:
        return list(self.lora.names)

    @property
    def folder_name(self) -> str | None:
        """The adapters folder's name (what /info shows: never its path)."""
        return self.folder.name if self.folder is not None else None

    def available(self) -> list[str]:
        return local_adapters(self.folder) if self.folder is not None else []

    def resolve(self, adapter_id: str | None, source: str | None = None,
                api_token: str | None = None) -> str:
        """The MultiLora name of the request's adapter."""
        if source is None:              # a local name never holds a "/"
            source = "hub" if "/" in adapter_id else "local"
        if source == "local":
            return self._local(adapter_id)
        return self._hub(adapter_id, api_token)

    def _local(self, name: str) -> str:
        if ".." in name or not LOCAL_NAME.fullmatch(name):
            raise InvalidRequest(f"adapter_id {name[:100]!r} is not a folder's name in the "
                                 f"adapters folder (letters, digits, '_', '-', '.'; no '..')")
        if self.folder is None:
            raise NotFound(f"unknown adapter {name!r}: this server has no adapters folder")
        folder = (self.folder / name).resolve()
        if folder.parent != self.folder:
            raise InvalidRequest(f"adapter {name!r} resolves outside the adapters folder")
        if not folder.is_dir():
            raise NotFound(f"unknown adapter {name!r}: there is no such adapter in the "
                           f"adapters folder (available: {self.available()})")
        if not (folder / WEIGHTS).is_file():
            pickled = " (it has adapter_model.bin: pickles are never loaded)" if (
                folder / "adapter_model.bin").exists() else ""
            raise InvalidRequest(f"adapter {name!r} has no {WEIGHTS}{pickled}; only "
                                 f"safetensors weights are loaded")
        return self._load(name, folder, operator=True)

    def _hub(self, repo_id: str, api_token: str | None) -> str:
        if ".." in repo_id or "--" in repo_id or not HUB_ID.fullmatch(repo_id):
            raise InvalidRequest(f"adapter_id {repo_id[:100]!r} is not a Hugging Face Hub "
                                 f"repository id (owner/name)")
        name = f"hub:{repo_id}"
        if name in self.lora.names:
            return name
        with self._loading:
            held = sum(n.startswith("hub:") for n in self.lora.names) + len(self._fetching)
            if name not in self._fetching and held >= MAX_HUB_ADAPTERS:
                raise Unavailable(f"adapter {repo_id!r}: this server holds its limit of "
                                  f"{MAX_HUB_ADAPTERS} hub adapters until it restarts; use one "
                                  f"of those or a local adapter")
            self._fetching.add(name)
        try:
            folder = _fetch_from_hub(repo_id, api_token)
            return self._load(name, folder, operator=False)
        finally:
            with self._loading:
                self._fetching.discard(name)

    def _load(self, name: str, folder: Path, operator: bool) -> str:
        """Load ``folder`` as ``name``. operator: the folder is the server's (broken: a 500 for
        the operator), else the client's choice (a 422)."""
        shown = name.removeprefix("hub:")
        with self._loading:             # one load at a time; a second asker finds it loaded
            if name in self.lora.names:
                return name
            try:
                check_adapter_files(folder, self.max_adapter_bytes)
            except BrokenAdapter as err:
                if operator:
                    log.error("adapter %r in %s is broken: %s", name, folder, err)
                    raise GenerationFailed(f"adapter {shown!r} is broken on this server "
                                           f"({err}); the server's log says more") from None
                raise InvalidRequest(f"adapter {shown!r} cannot be loaded: {err}") from None
            with self.lock:             # between two steps of the engine
                try:
                    self.lora.add(name, folder)
                except ValueError as err:
                    # A mismatch with this model (its layers or shapes): the client's choice.
                    reason = str(err).replace(str(folder), "its folder")
                    raise InvalidRequest(f"adapter {shown!r} cannot be used with this model: "
                                         f"{reason}") from None
                except Exception:
                    log.exception("adapter %r in %s failed to load", name, folder)
                    raise GenerationFailed(f"adapter {shown!r} could not be loaded; the "
                                           f"server's log says why") from None
        return name


def _fetch_from_hub(repo_id: str, api_token: str | None) -> Path:
    """Download a peft adapter from the hub: the folder holding its two files."""
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError
        from peft import PeftConfig
    except ImportError as err:
        raise Unavailable(f"adapter {repo_id!r} comes from the hub, which needs peft and "
                          f"huggingface_hub ({err.name} is missing on this server)") from None
    offline = constants.HF_HUB_OFFLINE
    try:
        PeftConfig.from_pretrained(repo_id, token=api_token)
        config = hf_hub_download(repo_id, CONFIG, token=api_token)
        weights = hf_hub_download(repo_id, WEIGHTS, token=api_token)
    except RepositoryNotFoundError:
        raise NotFound(f"unknown adapter {repo_id!r}: no such repository on the Hugging Face "
                       f"Hub (or it is private: pass api_token)") from None
    except EntryNotFoundError:
        raise InvalidRequest(f"adapter {repo_id!r} has no {WEIGHTS} on the hub; only "
                             f"safetensors weights are loaded (never pickles)") from None
    except Exception as err:        # offline, no network, timeouts, a repo that is no adapter
        log.warning("adapter %r could not be fetched: %s: %s", repo_id, type(err).__name__, err)
        reason = ("this server is offline (HF_HUB_OFFLINE=1) and the adapter is not in its "
                  "cache" if offline else f"{type(err).__name__} (the server's log says more)")
        raise Unavailable(f"adapter {repo_id!r} could not be fetched from the Hugging Face "
                          f"Hub: {reason}. Use a local adapter (adapter_source='local') or "
                          f"give the server a network.") from None
    folder = Path(weights).parent
    if Path(config).parent != folder:
        raise Unavailable(f"adapter {repo_id!r}: its files were not downloaded together")
    return folder
