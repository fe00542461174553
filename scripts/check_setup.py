"""Is this laptop ready for the course? (`make check`, or `python scripts/check_setup.py`)

Meant for the morning of a workshop, on every laptop, in about half a minute: it checks what
the lessons need, one line per item, and ends with a verdict a non-expert can read.

    ✓ Python 3.11.9
    ✓ the course's packages import (torch 2.13.0, transformers 5.23.0, ...)
    ...
    READY: all 7 checks passed. Open the lessons with `make lab`.

Each check runs even when an earlier one failed (unless it needs what failed), and the exit
status is 0 only when every check passed. Nothing here needs a network.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

#: The packages the lessons import, by import name.
PACKAGES = ("torch", "transformers", "peft", "matplotlib", "ipywidgets", "IPython", "fastapi",
            "uvicorn", "openai", "httpx", "lorax", "llguidance")
OLDEST_PYTHON = (3, 10)


class Failed(Exception):
    """A check's failure, with the one line to show."""


def check_python() -> str:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < OLDEST_PYTHON:
        raise Failed(f"Python {version} is too old: the course needs 3.10 or newer "
                     f"(macOS ships 3.9: install a newer one, see docs/instructors.md)")
    return f"Python {version}"


def check_imports() -> str:
    from helpers.quiet import quiet_stderr   # torchao's notes about GPU kernels it lacks

    missing, versions = [], []
    for name in PACKAGES:
        try:
            with quiet_stderr():
                module = importlib.import_module(name)
        except Exception as error:   # ImportError, or a broken install raising anything
            missing.append(f"{name} ({type(error).__name__}: {error})")
            continue
        if name in ("torch", "transformers"):
            versions.append(f"{name} {module.__version__}")
    if missing:
        raise Failed("cannot import " + "; ".join(missing) + ": install the course again "
                     "(`make lab`, or the commands in the README)")
    return f"the course's packages import ({', '.join(versions)}, and {len(PACKAGES) - 2} more)"


def check_model() -> str:
    import torch

    from helpers import generate_with_cache, load_model

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tokenizer = load_model("bundled", device="cpu")
    first = generate_with_cache(model, tokenizer, "Jack and Jill", 8).text
    again = generate_with_cache(model, tokenizer, "Jack and Jill", 8).text
    if not first.strip():
        raise Failed("the bundled model wrote nothing after 'Jack and Jill'")
    if first != again:
        raise Failed("the bundled model continued the same prompt differently twice: "
                     f"{first!r} vs {again!r}")
    return f"the bundled model loads and continues a prompt: 'Jack and Jill' →{first!r}"


def check_widget() -> str:
    import ipywidgets

    from helpers import LivePlot, rerun_controls

    plot = LivePlot("check", xlabel="token", ylabel="ms", show=False)
    for i in range(5):
        plot.add("series", i, i * i)
    png = plot.png()
    if not png.startswith(b"\x89PNG") or len(png) < 2000:
        raise Failed(f"the live plot rendered {len(png)} bytes, not a picture")
    controls = rerun_controls(lambda steps: None, steps=(1, 8, 1, 4))
    if not isinstance(controls, ipywidgets.Widget):
        raise Failed("the controls are not ipywidgets")
    return f"a live plot renders without a screen ({len(png) // 1024} KiB PNG), controls build"


def check_kernel() -> str:
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        reply = client.execute_interactive("import helpers", timeout=60,
                                           output_hook=lambda message: None)
        if reply["content"]["status"] != "ok":
            raise Failed(f"a notebook kernel started but could not import helpers: "
                         f"{reply['content'].get('evalue', '')}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return "a notebook kernel starts and imports helpers"


def check_server() -> tuple[str, int]:
    import httpx

    from helpers import serve_in_background

    start = time.perf_counter()
    # Its defaults, compiling included (lesson 10): tens of seconds on a slow laptop. The wait
    # follows the start-up's stages (180 s at most for one of them).
    server = serve_in_background(threads=1, name="check-setup", timeout=180)
    started = time.perf_counter() - start
    try:
        port = int(server.url.rsplit(":", 1)[1])
        reply = httpx.post(server.url + "/v1/completions", timeout=60, trust_env=False,
                           json={"prompt": "Jack and Jill", "max_tokens": 4})
        if reply.status_code != 200:
            raise Failed(f"the course server answered {reply.status_code}: {reply.text[:200]}")
        text = reply.json()["choices"][0]["text"]
        compiled = httpx.get(server.url + "/info", timeout=10, trust_env=False).json().get(
            "compiled")
    finally:
        server.stop()
    seconds = time.perf_counter() - start
    step = ("its model step compiled" if compiled else
            "its model step eager: torch.compile failed here (a C++ compiler missing?), "
            "lesson 10's compiled runs will fail too")
    return (f"the course server starts in {started:.0f} s, answers ('Jack and Jill' →"
            f"{text!r}) and stops ({seconds:.0f} s in all; {step})"), port


def check_port(port: int) -> str:
    from helpers.server.background import port_is_free

    if not port_is_free("127.0.0.1", port):
        raise Failed(f"port {port} is still taken after the server stopped: a server process "
                     f"was left behind (see docs/instructors.md, Pitfalls)")
    return f"the server's port ({port}) is free again"


def run(name: str, check, *args):
    """Run one check, print its line, return (passed, its value)."""
    try:
        value = check(*args)
    except Failed as failure:
        print(f"✗ {name}: {failure}", flush=True)
        return False, None
    except Exception as error:   # an unexpected failure still gets one readable line
        where = traceback.extract_tb(error.__traceback__)[-1]
        print(f"✗ {name}: {type(error).__name__}: {error} "
              f"({Path(where.filename).name}, line {where.lineno})", flush=True)
        return False, None
    line = value[0] if isinstance(value, tuple) else value
    print(f"✓ {line}", flush=True)
    return True, value


def main() -> int:
    start = time.perf_counter()
    results = []
    results.append(run("Python", check_python)[0])
    imported, _ = run("imports", check_imports)
    results.append(imported)
    if imported:
        results.append(run("model", check_model)[0])
        results.append(run("widgets", check_widget)[0])
        results.append(run("notebook kernel", check_kernel)[0])
        served, value = run("server", check_server)
        results.append(served)
        if served:
            results.append(run("port", check_port, value[1])[0])
        else:
            print("✗ port: not checked, the server did not run", flush=True)
            results.append(False)
    total, passed = 7, sum(results)
    seconds = time.perf_counter() - start
    if passed == total and len(results) == total:
        print(f"READY: all {total} checks passed in {seconds:.0f} s. Open the lessons with "
              f"`make lab` (or `jupyter lab lessons`).")
        return 0
    print(f"NOT READY: {total - passed} of {total} checks failed (the lines marked ✗ above). "
          f"Show them to the instructor; docs/instructors.md, 'Pitfalls', says what to do.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
