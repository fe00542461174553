"""Which adapters a request may name, and loading them into the running model. (Lesson 07.)

Two sources, as in LoRAX:

* ``local``: a NAME of a folder inside the server's adapters folder (``--adapters``; by
  default the adapters that ship with the course). Names only: no "/", no "..", nothing that
  resolves outside that folder. The folder must hold ``adapter_config.json`` and
  ``adapter_model.safetensors``: weights are read from safetensors only, never from a pickle.
* ``hub``: a Hugging Face Hub repository id ("user/adapter"), fetched through the real
  ``from_pretrained`` path (peft's ``PeftConfig.from_pretrained``, then the safetensors file).
  Offline (no network, or ``HF_HUB_OFFLINE=1``) that fails, and the request gets a clear 424.

With no ``adapter_source`` a name that is a local adapter is local; a name with a "/" is a hub
repository. Adapters are loaded on first use (LoRAX does the same) into one ``MultiLora``
(lesson 06), which gives every row of the batch its own adapter.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from ..lora import NO_ADAPTER, MultiLora
from .protocol import ApiError, invalid

#: A local adapter's name: letters, digits, "_", "-", "." (not first), at most 100 characters.
LOCAL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$")
#: A hub repository id: "name" or "owner/name".
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}(/[A-Za-z0-9_.\-]{1,96})?$")
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def local_adapters(folder: str | os.PathLike) -> list[str]:
    """Names of the adapters in ``folder``: sub-folders holding safetensors weights."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if p.is_dir() and p.resolve().parent == folder and (p / WEIGHTS).is_file()
                  and LOCAL_NAME.match(p.name))


class AdapterStore:
    """Resolves a request's adapter to a name loaded in ``lora``, loading it if needed.

    lock: the lock the engine holds while it runs the model; adding an adapter changes the
    model's layers, so it happens only between two steps.
    """

    def __init__(self, model, folder: str | os.PathLike | None, lock: threading.RLock):
        self.folder = Path(folder).resolve() if folder is not None else None
        self.lora = MultiLora(model)
        self.lock = lock
        self._loading = threading.Lock()

    @property
    def loaded(self) -> list[str]:
        return list(self.lora.names)

    def available(self) -> list[str]:
        return local_adapters(self.folder) if self.folder is not None else []

    def resolve(self, adapter_id: str | None, source: str | None = None,
                api_token: str | None = None) -> str | None:
        """The MultiLora name of the request's adapter (None: the base model)."""
        if adapter_id is None or adapter_id in ("", NO_ADAPTER):
            return None
        if source is None:
            local = (self.folder is not None and LOCAL_NAME.match(adapter_id)
                     and adapter_id in self.available())
            source = "local" if local or "/" not in adapter_id else "hub"
        if source == "local":
            return self._local(adapter_id)
        return self._hub(adapter_id, api_token)

    # --- local ------------------------------------------------------------------------

    def _local(self, name: str) -> str:
        if "/" in name or "\\" in name or ".." in name or not LOCAL_NAME.match(name):
            raise invalid(f"adapter_id {name!r} is not an adapter name: local adapters are named "
                          f"by their folder's name inside the adapters folder (letters, digits, "
                          f"'_', '-', '.'; no paths, no '..')")
        if self.folder is None:
            raise ApiError(404, f"unknown adapter {name!r}: this server has no adapters folder",
                           "validation")
        folder = (self.folder / name).resolve()
        if folder.parent != self.folder:
            raise invalid(f"adapter {name!r} resolves outside the adapters folder; refused")
        if not folder.is_dir():
            raise ApiError(404, f"unknown adapter {name!r}: there is no such adapter in the "
                           f"adapters folder (available: {self.available()})", "validation")
        if not (folder / WEIGHTS).is_file():
            pickled = " (it has adapter_model.bin: pickles are never loaded)" if (
                folder / "adapter_model.bin").exists() else ""
            raise invalid(f"adapter {name!r} has no {WEIGHTS}{pickled}; only safetensors "
                          f"weights are loaded")
        return self._load(name, folder)

    # --- hub --------------------------------------------------------------------------

    def _hub(self, repo_id: str, api_token: str | None) -> str:
        if ".." in repo_id or "--" in repo_id or not HUB_ID.match(repo_id):
            raise invalid(f"adapter_id {repo_id!r} is not a Hugging Face Hub repository id "
                          f"(owner/name)")
        name = f"hub:{repo_id}"
        if name in self.lora.names:
            return name
        folder = _fetch_from_hub(repo_id, api_token)
        return self._load(name, folder)

    def _load(self, name: str, folder: Path) -> str:
        with self._loading:             # one load at a time; a second asker finds it loaded
            if name in self.lora.names:
                return name
            with self.lock:             # between two steps of the engine
                try:
                    self.lora.add(name, folder)
                except ValueError as err:
                    raise invalid(f"adapter {name!r} cannot be used with this model: {err}") \
                        from None
        return name


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _fetch_from_hub(repo_id: str, api_token: str | None) -> Path:
    """Download a peft adapter from the hub through ``PeftConfig.from_pretrained`` and
    ``hf_hub_download``; the folder holding its two files. ``ApiError`` when it cannot."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError
        from peft import PeftConfig
    except ImportError as err:
        raise ApiError(424, f"adapter {repo_id!r} comes from the hub, which needs peft and "
                       f"huggingface_hub: {err}", "generation") from None
    offline = _hub_offline()
    try:
        PeftConfig.from_pretrained(repo_id, token=api_token)
        config = hf_hub_download(repo_id, CONFIG, token=api_token)
        weights = hf_hub_download(repo_id, WEIGHTS, token=api_token)
    except RepositoryNotFoundError:
        raise ApiError(404, f"unknown adapter {repo_id!r}: no such repository on the Hugging Face "
                       f"Hub (or it is private: pass api_token)", "validation") from None
    except EntryNotFoundError:
        raise invalid(f"adapter {repo_id!r} has no {WEIGHTS} on the hub; only safetensors "
                      f"weights are loaded (never pickles)") from None
    except Exception as err:        # offline, no network, timeouts, a repo that is no adapter
        reason = ("this server is offline (HF_HUB_OFFLINE=1) and the adapter is not in its "
                  "cache" if offline else f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        raise ApiError(424, f"adapter {repo_id!r} could not be fetched from the Hugging Face "
                       f"Hub: {reason}. Use a local adapter (adapter_source='local') or give "
                       f"the server a network.", "generation") from None
    folder = Path(weights).parent
    if Path(config).parent != folder:
        raise ApiError(424, f"adapter {repo_id!r}: its files were not downloaded together",
                       "generation")
    return folder
