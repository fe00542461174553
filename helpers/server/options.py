"""The server's options, declared once and judged in one place. (Lesson 07.)

Each option is one row of ``OPTIONS`` (name, type, default, help); from it come the command's
flags (``max_batch_size`` becomes ``--max-batch-size``), ``serve_in_background``'s keyword
arguments (turned back into flags by ``command_line``) and ``Engine``'s defaults (``DEFAULTS``).
``check`` is the only place a setting is judged, whoever gives it.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One server option. ``default`` None: decided when the server starts (the help says how)."""

    name: str
    type: type
    default: object
    help: str
    choices: tuple = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "127.0.0.1", "address to listen on; 127.0.0.1 is this machine only (the "
           "server has no authentication: think twice before 0.0.0.0)"),
    Option("port", int, 8080, "port to listen on; 0 picks any free port"),
    Option("model", str, None, "'bundled' (the default, or $COURSE_MODEL), a hub id such as "
           "'gpt2', or a local folder"),
    Option("adapters", str, None, "folder of LoRA adapters, one sub-folder per adapter "
           "(default: the course's shipped adapters)"),
    # 64: sixty-four streams run as one batch (vLLM's CPU build takes up to 128). A larger batch
    # costs nothing while fewer requests come, since it only ever holds the requests there are.
    Option("max_batch_size", int, 64, "requests generated together (the slots of lesson 03)"),
    Option("max_input_tokens", int, None, "longest prompt in tokens (default: half of "
           "max_total_tokens)"),
    Option("max_total_tokens", int, None, "prompt + new tokens of one request (default: the "
           "model's context)"),
    Option("max_queue", int, 64, "requests that may wait for a slot; one more gets 429"),
    Option("default_max_new_tokens", int, 64, "new tokens for a request that does not say"),
    Option("kv_cache", str, "paged", "the KV cache: 'paged' (blocks, prefix caching and chunked "
           "prefill, lesson 08) or 'contiguous' (one tensor per layer, lessons 03 and 07)",
           choices=("paged", "contiguous")),
    Option("admission", str, "fcfs", "the order in which waiting requests are admitted: "
           "'fcfs' (first come, first served) or 'shortest' (the shortest prompt first)",
           choices=("fcfs", "shortest")),
    Option("compile", str, "auto", "compile the paged cache's model step with torch.compile at "
           "start-up (lesson 10): 'auto' (with --kv-cache paged; eager, with a warning, where "
           "compiling fails, e.g. no C++ compiler), 'on' (fail instead) or 'off'",
           choices=("auto", "on", "off")),
    Option("cuda_graphs", str, "auto", "replay each decode step as a CUDA graph, one per "
           "capture size, all captured at start-up (lesson 10; --kv-cache paged): 'auto' (on "
           "with a CUDA device, off elsewhere, and off with a warning where capturing fails), "
           "'on' (fail instead) or 'off'", choices=("auto", "on", "off")),
    Option("cuda_graph_sizes", str, "1,2,4,8,16,32,64", "the capture sizes, comma-separated: "
           "a decode batch is padded up to the next one (those above --max-batch-size are "
           "left out; a larger batch runs without a graph)"),
    Option("engine", str, "process", "where the model runs: 'process' (a process of its own, "
           "so that the HTTP side never holds up a step) or 'thread' (a thread of the server's "
           "process: simpler to debug, slower)", choices=("process", "thread")),
    Option("device", str, None, "cpu, cuda, ... (default: CUDA if there is a GPU)"),
    Option("dtype", str, None, "float32 (the default), float16, bfloat16 or auto"),
    Option("threads", int, None, "torch CPU threads (default: on the CPU, every core but one, "
           "at least one, so that the HTTP side and the clients keep a core; on a GPU, one: "
           "the CPU then only builds small index tensors and launches kernels)"),
    # A few seconds: `docker stop` kills after 10 s, and a stream cut without a word is worse
    # than one told why.
    Option("drain_seconds", float, 5.0, "on SIGTERM or Ctrl-C, the seconds the requests already "
           "running may take to finish (new ones get 503) before the rest are ended with an "
           "error and the server exits"),
    Option("log_level", str, "warning", "how much the server logs",
           choices=("critical", "error", "warning", "info", "debug")),
)

#: The options that are ``Engine``'s own keyword arguments (the others are the process's).
ENGINE_OPTIONS = ("max_batch_size", "max_input_tokens", "max_total_tokens", "max_queue",
                  "default_max_new_tokens", "admission", "kv_cache")

DEFAULTS: dict[str, object] = {option.name: option.default for option in OPTIONS}
_BY_NAME = {option.name: option for option in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for option in OPTIONS:
        parser.add_argument(option.flag, type=option.type, default=option.default,
                            choices=option.choices or None, help=_help(option))


def _help(option: Option) -> str:
    return option.help if option.default is None else f"{option.help} (default: {option.default})"


def check(values: dict, model=None, device=None) -> dict:
    """Every setting, judged (``ValueError`` naming the first that is wrong), a missing one
    taking its default. ``model``'s context bounds the limits and fills in their defaults;
    ``device``: where the model is or will be. ``compile`` and ``cuda_graphs`` come back as
    "auto", "on" or "off", ``cuda_graph_sizes`` as a sorted tuple."""
    unknown = sorted(set(values) - set(_BY_NAME))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a server option; the options are: "
                         f"{', '.join(_BY_NAME)}")
    s = {**DEFAULTS, **{name: value for name, value in values.items() if value is not None}}
    for name in ("compile", "cuda_graphs"):          # True and False stand for on and off
        s[name] = {True: "on", False: "off"}.get(s[name], s[name])
    for option in OPTIONS:
        value = s[option.name]          # None only for options without choices
        if option.type is int and value is not None and (isinstance(value, bool)
                                                         or not isinstance(value, int)):
            raise ValueError(f"{option.name} must be an integer, got {value!r}")
        if option.choices and value not in option.choices:
            raise ValueError(f"{option.name} must be one of {', '.join(option.choices)}, got "
                             f"{value!r}")
    if model is not None:
        from ..batching import model_context

        context = model_context(model)
        if s["max_total_tokens"] is None:
            s["max_total_tokens"] = context or 2048
        if context is not None and s["max_total_tokens"] > context:
            raise ValueError(f"max_total_tokens={s['max_total_tokens']} is beyond the model's "
                             f"context of {context} tokens")
        if s["max_input_tokens"] is None:
            s["max_input_tokens"] = max(1, s["max_total_tokens"] // 2)
    for name in ("max_batch_size", "max_queue", "max_input_tokens", "max_total_tokens",
                 "default_max_new_tokens"):
        if s[name] is not None and s[name] < 1:
            raise ValueError(f"{name} must be a positive integer, got {s[name]!r}")
    if None not in (s["max_input_tokens"], s["max_total_tokens"]) and \
            not s["max_input_tokens"] < s["max_total_tokens"]:
        raise ValueError(f"max_input_tokens ({s['max_input_tokens']}) must be smaller than "
                         f"max_total_tokens ({s['max_total_tokens']})")
    if s["threads"] is not None:
        torch_threads(s["threads"], "cpu")
    for name, needs in (("compile", "the compiled step runs on lesson 08's pool of KV blocks, "
                         "whose shape never changes"),
                        ("cuda_graphs", "a graph replays on lesson 08's pool of KV blocks, "
                         "whose address never changes")):
        if s[name] == "on" and s["kv_cache"] != "paged":
            raise ValueError(f"--{name.replace('_', '-')} on needs --kv-cache paged: {needs}")
    s["cuda_graph_sizes"] = _sizes(s["cuda_graph_sizes"], s["max_batch_size"])
    if s["cuda_graphs"] == "on" and device is not None and getattr(device, "type",
                                                                   device) != "cuda":
        raise ValueError(f"--cuda-graphs on needs a CUDA device; the model is on {device}: "
                         f"use --cuda-graphs auto (on with CUDA, off elsewhere)")
    return s


def _sizes(value, max_batch_size: int) -> tuple[int, ...]:
    """The capture sizes (``"1,2,4"`` or ints) that can occur, sorted."""
    pieces = value.split(",") if isinstance(value, str) else list(value)
    sizes = []
    for piece in pieces:
        text = str(piece).strip()
        if isinstance(piece, bool) or not (text.isascii() and text.isdigit() and int(text) > 0):
            raise ValueError(f"--cuda-graph-sizes takes positive whole numbers separated by "
                             f"commas (e.g. 1,2,4,8); {piece!r} is not one")
        sizes.append(int(text))
    usable = tuple(sorted({size for size in sizes if size <= max_batch_size}))
    if not usable:
        raise ValueError(f"no capture size in {tuple(sizes)} is at most the largest batch, "
                         f"{max_batch_size} (--max-batch-size)")
    return usable


def torch_threads(requested: int | None, device) -> int:
    """The torch threads to use: ``requested`` if given; on the CPU every core but one, left to
    the HTTP side and the clients; one on a GPU, where the CPU only builds small index tensors
    and launches kernels (a 64-row step's inputs took 8 ms on 16 threads, 0.3 ms on one)."""
    cores = os.cpu_count() or 1
    if requested is not None:
        if not 1 <= requested <= cores:
            raise ValueError(f"--threads {requested}: must be between 1 and this machine's "
                             f"{cores} cores")
        return requested
    return max(1, cores - 1) if str(device).startswith("cpu") else 1


def device(name):
    """The device ``--device`` names (None: CUDA when there is one), judged before anything
    loads. Imports torch: the engine's process calls it."""
    import torch

    from ..models import default_device

    if name is None:
        return default_device()
    try:
        found = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device torch knows (cpu, cuda, cuda:1, "
                         f"mps, ...)") from None
    if found.type == "meta":
        raise ValueError(f"--device {name}: a meta tensor has a shape and no values, so a "
                         f"model there cannot generate; use cpu or cuda")
    backend = torch.backends.mps if found.type == "mps" else getattr(torch, found.type, None)
    count = getattr(backend, "device_count", lambda: 1)
    if found.type != "cpu" and not (getattr(backend, "is_available", lambda: False)()
                                    and (found.index or 0) < count()):
        raise ValueError(f"--device {name}: this machine's torch ({torch.__version__}) has no "
                         f"such device; leave --device out to use {default_device().type}")
    return found


def command_line(values: dict) -> list[str]:
    """The flags that give the server ``values`` (None: the default), judged first."""
    check(values)
    flags = []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):                     # cuda_graph_sizes=[1, 2]
            value = ",".join(str(v) for v in value)
        flags += [_BY_NAME[name].flag, str(os.fspath(value) if isinstance(value, os.PathLike)
                                             else value)]
    return flags


def describe(indent: str = "    ", width: int = 96) -> str:
    """The options as text, one paragraph each (for docstrings)."""
    return "\n".join(textwrap.fill(f"{option.name}: {_help(option)}", width,
                                   initial_indent=indent, subsequent_indent=indent + "    ")
                     for option in OPTIONS)
