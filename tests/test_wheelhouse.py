"""The offline wheelhouses (`make wheelhouse`, scripts/wheelhouse.py): each recorded set in
docs/wheelhouses/ holds, for its platform and Python, a wheel of every package the course
installs, at the version constraints.txt pins, and nothing built for another platform.

The sets themselves are downloaded by `make wheelhouse PLATFORM=...` (hundreds of MB); the
manifests that record them are committed, so this test needs no network."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "docs" / "wheelhouses").glob("*.txt"))
SCRIPT = ROOT / "scripts" / "wheelhouse.py"
#: What sys_platform and platform_machine say on each platform (to read environment markers).
MARKERS = {"linux-x86_64": ("linux", "x86_64", "Linux"),
           "macos-arm64": ("darwin", "arm64", "Darwin"),
           "windows-amd64": ("win32", "AMD64", "Windows")}


def wheelhouse_script():
    spec = importlib.util.spec_from_file_location("wheelhouse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


def course_requirements(platform: str, python: str) -> list[Requirement]:
    """The course's requirements with the lab and quant extras that apply on the platform."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = project["dependencies"] + [r for extra in ("lab", "quant")
                                       for r in project["optional-dependencies"][extra]]
    sys_platform, machine, system = MARKERS[platform]
    env = {**default_environment(), "sys_platform": sys_platform, "platform_machine": machine,
           "platform_system": system, "python_version": ".".join(python.split(".")[:2]),
           "python_full_version": python}
    return [r for r in map(Requirement, names) if r.marker is None or r.marker.evaluate(env)]


def runs_on(tag_platform: str, allowed: set[str]) -> bool:
    """Whether a wheel's platform tag installs on a platform that pip names by ``allowed`` (a
    macOS wheel built for an older macOS, or universal2, runs on a newer one, as pip knows)."""
    if tag_platform in allowed:
        return True
    wheel = re.fullmatch(r"macosx_(\d+)_(\d+)_(\w+)", tag_platform)
    if not wheel:
        return False
    for name in allowed:
        target = re.fullmatch(r"macosx_(\d+)_(\d+)_(\w+)", name)
        if target and wheel.group(3) in (target.group(3), "universal2") and \
                (int(wheel.group(1)), int(wheel.group(2))) <= (int(target.group(1)), int(target.group(2))):
            return True
    return False


def read_manifest(path: Path) -> dict[str, tuple[str, frozenset, int]]:
    wheels = {}
    for line in path.read_text().splitlines():
        size, filename = line.split(" ", 1)
        name, version, _, tags = parse_wheel_filename(filename)
        wheels[name] = (str(version), tags, int(size))
    return wheels


def test_every_platform_has_a_recorded_set():
    recorded = {re.sub(r"-py\d+$", "", p.stem) for p in MANIFESTS}
    assert recorded == set(wheelhouse_script().PLATFORMS) == set(MARKERS)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.stem)
def test_a_recorded_set_installs_the_course_on_its_platform(manifest):
    platform, major_minor = manifest.stem.rsplit("-py", 1)
    python = f"{major_minor[0]}.{major_minor[1:]}.99"
    allowed = set(wheelhouse_script().PLATFORMS[platform]) | {"any"}
    wheels = read_manifest(manifest)
    pinned = pins()
    project_version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

    wrong = []
    for name, (version, tags, _) in wheels.items():
        if name == "efficiently-serving-llms":
            expected = project_version
        elif name == "setuptools":         # to install the course with -e; not pinned
            continue
        elif name not in pinned:           # only on this platform (constraints.txt is Linux's)
            if platform.startswith("linux"):
                wrong.append(f"{name} {version} is not pinned in constraints.txt")
            continue
        else:
            expected = pinned[name]
        if version.split("+")[0] != expected:
            wrong.append(f"{name} {version} (constraints.txt: {expected})")
        if not any(runs_on(t.platform, allowed) for t in tags):
            wrong.append(f"{name}: built for {sorted({t.platform for t in tags})}")
        if not any(t.interpreter in ("py3", f"cp{major_minor}") or
                   (t.abi == "abi3" and int(t.interpreter[3:]) <= int(major_minor[1:]))
                   for t in tags):
            wrong.append(f"{name}: not for Python {major_minor[0]}.{major_minor[1:]}")
    assert not wrong, f"{manifest.name}: " + "; ".join(wrong)

    linux = read_manifest(next(p for p in MANIFESTS if p.stem.startswith("linux")))
    only_here = {n for n in wheels if n not in pinned} - {"setuptools", "efficiently-serving-llms"}
    assert not only_here & set(linux), f"unpinned wheels that Linux needs too: {only_here & set(linux)}"

    needed = [canonicalize_name(r.name) for r in course_requirements(platform, python)]
    needed += ["efficiently-serving-llms", "lorax-client", "setuptools", "jupyterlab", "torch"]
    missing = sorted(set(needed) - set(wheels))
    assert not missing, f"{manifest.name} lacks wheels of {missing}"
    if platform.startswith("linux"):
        assert not [n for n in wheels if n.startswith("nvidia")], "a Linux set with CUDA wheels"
        assert wheels["torch"][0].endswith("+cpu")


def test_the_install_commands_need_no_make():
    commands = wheelhouse_script().install_commands(r".venv\Scripts\python", "wheelhouse/w")
    assert commands[0] == "python -m venv .venv"
    assert all("make" not in c.split() for c in commands)
    assert any("--no-index" in c and '-e ".[lab,quant]"' in c for c in commands)
    assert any("--no-deps lorax-client" in c for c in commands)
    assert commands[-1].endswith("jupyter lab lessons")


def test_runs_on_reads_platform_tags_as_pip_does():
    platforms = wheelhouse_script().PLATFORMS
    mac, linux = set(platforms["macos-arm64"]), set(platforms["linux-x86_64"])
    assert runs_on("macosx_10_15_universal2", mac) and runs_on("macosx_14_0_arm64", mac)
    assert not runs_on("macosx_15_0_arm64", mac)          # needs a newer macOS than planned
    assert not runs_on("macosx_10_15_x86_64", mac)        # Intel only
    assert runs_on("manylinux_2_31_x86_64", linux) and not runs_on("win_amd64", linux)
    assert not runs_on("manylinux_2_28_aarch64", linux)
