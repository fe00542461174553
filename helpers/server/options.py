"""The server's options, declared once. (Lesson 07.)

Each option is one row of ``OPTIONS`` (name, type, default, help); from it come the command's
flags (``max_batch_size`` becomes ``--max-batch-size``), ``serve_in_background``'s keyword
arguments (turned back into flags by ``command_line``) and ``Engine``'s defaults (``DEFAULTS``).
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
    """Add one flag per option to ``parser``."""
    for option in OPTIONS:
        parser.add_argument(option.flag, type=option.type, default=option.default,
                            choices=option.choices or None, help=_help(option))


def _help(option: Option) -> str:
    """The option's help, with its default when it has one (the others say in words)."""
    if option.default is None:
        return option.help
    return f"{option.help} (default: {option.default})"


def check(values: dict) -> None:
    """``ValueError`` naming the first key of ``values`` that is not an option."""
    unknown = sorted(set(values) - set(_BY_NAME))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a server option; the options are: "
                         f"{', '.join(_BY_NAME)}")


def command_line(values: dict) -> list[str]:
    """The flags that give the server ``values`` (``{name: value}``; None: the default).
    ``ValueError`` for a name that is not an option, or a value its option does not take."""
    check(values)
    flags = []
    for name, value in values.items():
        if value is None:
            continue
        option = _BY_NAME[name]
        if option.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if option.type is str and isinstance(value, (list, tuple)):   # cuda_graph_sizes=[1, 2]
            value = ",".join(str(v) for v in value)
        elif option.type is str:
            value = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
        if option.choices and value not in option.choices:
            raise ValueError(f"{name} must be one of {', '.join(option.choices)}; got {value!r}")
        flags += [option.flag, str(value)]
    return flags


def describe(indent: str = "    ", width: int = 96) -> str:
    """The options as text, one paragraph each (for docstrings)."""
    return "\n".join(textwrap.fill(f"{option.name}: {_help(option)}", width,
                                   initial_indent=indent, subsequent_indent=indent + "    ")
                     for option in OPTIONS)
