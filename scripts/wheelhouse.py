"""Download every wheel a learner's laptop needs, for a room with no network (`make wheelhouse`).

    python scripts/wheelhouse.py linux-x86_64            # -> wheelhouse/linux-x86_64-py311/
    python scripts/wheelhouse.py macos-arm64 --python 3.12.8
    python scripts/wheelhouse.py windows-amd64

It downloads, for the named platform and Python, the wheels of what `make lab` installs (the
course with its `lab` and `quant` extras, at the versions of constraints.txt, plus lorax-client)
and the course itself as a wheel; binaries only, so that nothing is compiled on the laptops.
It then writes `MANIFEST.txt` in the folder (file names and sizes; tests/test_wheelhouse.py
checks the manifests recorded in `docs/wheelhouses/` with `--record` against constraints.txt) and prints
the set's size and the commands that install from it (on Windows `.venv\\Scripts\\python`):

    python -m venv .venv
    .venv/bin/python -m pip install --no-index --find-links wheelhouse/linux-x86_64-py311 -e ".[lab,quant]"
    .venv/bin/python -m pip install --no-index --find-links wheelhouse/linux-x86_64-py311 --no-deps lorax-client
    .venv/bin/python scripts/check_setup.py
    .venv/bin/python -m jupyter lab lessons

Torch on Linux: PyPI's Linux wheel is the CUDA build (with about 3 GB of nvidia-* wheels). The
course needs the CPU build, which PyTorch publishes on its own index; pass it with
`--torch-index https://download.pytorch.org/whl/cpu` (the Makefile's TORCH_INDEX), or have the
wheel in a folder pip already looks in (pip's `find-links`). The script refuses a Linux set that
holds nvidia-* wheels. macOS and Windows wheels of torch on PyPI are CPU builds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "wheelhouses"

#: Our names for the platforms, and pip's platform tags for each (newest first).
PLATFORMS = {
    # glibc 2.35 (Ubuntu 22.04) and older
    "linux-x86_64": [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)]
                    + ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"],
    # macOS 14 (Sonoma) and older, Apple silicon
    "macos-arm64": [f"macosx_{major}_0_{arch}" for major in range(14, 10, -1)
                    for arch in ("arm64", "universal2")] + ["macosx_10_9_universal2"],
    "windows-amd64": ["win_amd64"],
}
EXTRAS = "lab,quant"


def folder_name(platform: str, python: str) -> str:
    """wheelhouse/linux-x86_64-py311 for Python 3.11.x."""
    return f"{platform}-py{''.join(python.split('.')[:2])}"


def pip(*args: str) -> None:
    """Run pip; on failure show its explanation (a conflict, a missing wheel), not its progress."""
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check",
                           "--progress-bar", "off"], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines()
                 if not line.startswith("WARNING: Location")]
        raise SystemExit("pip failed:\n" + "\n".join(lines[-25:]))


#: uv's names for the non-Linux targets, and the macOS version torch's wheels need (2.13: 14).
UV_TARGETS = {"macos-arm64": "aarch64-apple-darwin", "windows-amd64": "x86_64-pc-windows-msvc"}
MACOS_TARGET = "14.0"


def resolve_for(platform: str, python: str, out: Path) -> Path:
    """The full list of pinned requirements on ``platform``, resolved by uv. (pip evaluates a
    package's environment markers for the machine it runs on, not for ``--platform``: on Linux
    it would ask for torch's Linux-only CUDA packages in a macOS or Windows set.)"""
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        raise SystemExit("a macOS or Windows set needs uv to resolve its requirements: "
                         "pip install uv (make wheelhouse does)")
    requirements = out / "requirements.txt"
    done = subprocess.run(
        [uv, "pip", "compile", "--quiet", "--no-config", "--no-header", "--no-annotate",
         "--python-platform", UV_TARGETS[platform], "--python-version", python,
         "--only-binary", ":all:", "-c", str(ROOT / "constraints.txt"),
         *[arg for extra in EXTRAS.split(",") for arg in ("--extra", extra)],
         str(ROOT / "pyproject.toml"), "-o", str(requirements)],
        capture_output=True, text=True, env={**os.environ, "MACOSX_DEPLOYMENT_TARGET": MACOS_TARGET})
    if done.returncode != 0:
        raise SystemExit("uv could not resolve the course's requirements for "
                         f"{platform}:\n{done.stderr[-2000:]}")
    return requirements


def download(platform: str, python: str, out: Path, torch_index: str | None) -> None:
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}: choose one of {', '.join(PLATFORMS)}")
    if not re.fullmatch(r"3\.\d+\.\d+", python):
        raise ValueError(f"python must look like 3.11.9 (the patch level matters: some pinned "
                         f"packages need 3.11.5 or newer), got {python!r}")
    out.mkdir(parents=True, exist_ok=True)
    pip("wheel", "--no-deps", "-w", str(out), str(ROOT))       # the course itself
    course = next(out.glob("efficiently_serving_llms-*.whl"))
    target = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for tag in PLATFORMS[platform]:
        target += ["--platform", tag]
    constraints = ["-c", str(ROOT / "constraints.txt")]
    if platform in UV_TARGETS:
        pip("download", *target, "--no-deps", *constraints, "-d", str(out),
            "-r", str(resolve_for(platform, python, out)), "setuptools>=77")
    else:
        index = ["--extra-index-url", torch_index] if torch_index else []
        pip("download", *target, *index, *constraints, "-d", str(out),
            f"{course}[{EXTRAS}]", "setuptools>=77")     # setuptools: to install with -e
    # lorax-client's declared pins would downgrade transformers: its own wheel only (see Makefile)
    pip("download", *target, "--no-deps", *constraints, "-d", str(out), "lorax-client")
    nvidia = sorted(p.name for p in out.glob("nvidia_*"))
    if nvidia:
        raise SystemExit(f"{out} holds CUDA wheels ({', '.join(nvidia[:3])}, ...): PyPI's Linux "
                         f"torch is the CUDA build. Delete the folder and run again with "
                         f"--torch-index https://download.pytorch.org/whl/cpu")


def manifest(out: Path) -> str:
    """One line per wheel, `size_in_bytes file_name`, sorted by name."""
    return "".join(f"{p.stat().st_size} {p.name}\n" for p in sorted(out.glob("*.whl")))


def install_commands(venv_python: str, wheels: str) -> list[str]:
    """What `make lab` does, as plain commands (Windows has no make)."""
    pip_offline = f"{venv_python} -m pip install --no-index --find-links {wheels}"
    return ["python -m venv .venv",
            f"{pip_offline} -e \".[{EXTRAS}]\"",
            f"{pip_offline} --no-deps lorax-client",
            f"{venv_python} scripts/check_setup.py",
            f"{venv_python} -m jupyter lab lessons"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("platform", choices=sorted(PLATFORMS))
    ap.add_argument("--python", default="{0}.{1}.{2}".format(*sys.version_info),
                    help="the laptops' Python, e.g. 3.11.9 (default: this one)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder (default: wheelhouse/<platform>-py<version>)")
    ap.add_argument("--torch-index", default=None,
                    help="an extra index for torch's CPU wheels (Linux)")
    ap.add_argument("--record", action="store_true",
                    help="also copy the manifest to docs/wheelhouses/ (committed, tested)")
    args = ap.parse_args(argv)
    out = args.out or ROOT / "wheelhouse" / folder_name(args.platform, args.python)
    download(args.platform, args.python, out, args.torch_index)
    text = manifest(out)
    (out / "MANIFEST.txt").write_text(text)
    if args.record:
        RECORDS.mkdir(exist_ok=True)
        (RECORDS / f"{folder_name(args.platform, args.python)}.txt").write_text(text)
    total = sum(int(line.split()[0]) for line in text.splitlines())
    print(f"{out}: {len(text.splitlines())} wheels, {total / 2**20:.0f} MiB")
    venv_python = r".venv\Scripts\python" if args.platform.startswith("windows") else ".venv/bin/python"
    where = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    print("On each laptop, in the course's folder, with this folder copied into it:")
    for line in install_commands(venv_python, str(where)):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
