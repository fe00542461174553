"""Each lesson as a slide deck that opens with no network (`make slides`).

    python scripts/slides.py                  # slides/NN_*.slides.html, one per lesson
    python scripts/slides.py lessons/02_batching.ipynb
    python scripts/slides.py --fetch-only     # only download reveal.js and MathJax

Which cells make the deck is stored in the lessons themselves, in each cell's
`metadata.slideshow.slide_type`: the field RISE (jupyterlab-rise, "Render as slideshow" in
JupyterLab) and nbconvert's reveal.js exporter both read. `slide_types()` below writes it when
`scripts/sync_notebooks.py` runs, from the lesson's own structure, so an edited lesson gets a
deck without anyone placing slides by hand:

- the title and every `##` section open a slide; a `###` heading (a *Your turn* exercise) opens
  a sub-slide below it;
- a plot gets a sub-slide of its own, and so does a cell that would not fit on the slide so far;
- the Colab cell, the Setup section, the checks under the exercises and the live widgets
  (which need a running kernel: present those in JupyterLab) are skipped.

A deck is one HTML file with everything inside it: reveal.js, its notes plugin, MathJax where
the lesson has formulas, the notebook's styles and every image. It opens from a USB stick in
any browser with no network. reveal.js and MathJax come from the npm registry once, checked
against the registry's sha512, and are kept in wheelhouse/npm/ (which `make wheelhouse` fills
too, for a room with no network).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import pathlib
import re
import sys
import tarfile
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
NPM_DIR = ROOT / "wheelhouse" / "npm"
OUT_DIR = ROOT / "slides"
TEMPLATE_DIR = pathlib.Path(__file__).resolve().parent / "slides_template"

# name, version, the registry's sha512 of the tarball, and the files a deck takes from it
PACKAGES = {
    "reveal.js": ("5.2.1", "r7//6mIM5p34hFiDMvYfXgyjXqGRta+/psd9YtytsgRlrpRzFv4RbH76TXd2qD+7ZPZEbp"
                           "BDhdRhJaFgfQ7zNQ==",
                  ["dist/reveal.js", "dist/reveal.css", "dist/theme/white.css",
                   "plugin/notes/notes.js"]),
    "mathjax": ("3.2.2", "Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtR"
                         "ZM1vO+geW0OhGw==",
                ["es5/tex-svg.js"]),
}

# --------------------------------------------------------------------------------------------
# Which cells are slides
# --------------------------------------------------------------------------------------------

# About how many lines of text fit on one slide at the deck's font size (1280 x 800).
SLIDE_LINES = 24
# A markdown line wraps at about this many characters; a plot takes this many lines.
WRAP = 95
PLOT_LINES = 14
# Outputs longer than this scroll on their slide rather than spill onto the next.
MAX_OUTPUT_LINES = 16

WIDGET = "application/vnd.jupyter.widget-view+json"
CHECK = re.compile(r"\bcheck_\w+\(|from helpers\.checks import")


def _text(value) -> str:
    """A notebook text field: a string, or a list of lines."""
    return "".join(value) if isinstance(value, list) else value


def _source(cell) -> str:
    return _text(cell.get("source", ""))


def _is_plot(data: dict) -> bool:
    return "image/png" in data or "image/svg+xml" in data


def _has_plot(cell) -> bool:
    return any(_is_plot(o.get("data", {})) for o in cell.get("outputs", []))


def _only_widgets(cell) -> bool:
    """Output that is nothing but widget views (blank in a static deck)."""
    outs = cell.get("outputs", [])
    return bool(outs) and all(WIDGET in o.get("data", {}) for o in outs
                              if o.get("output_type") in ("display_data", "execute_result")) \
        and not any(o.get("output_type") == "stream" for o in outs)


def _lines(cell) -> int:
    """Roughly how many slide lines a cell fills, input and output together."""
    text = _source(cell)
    if cell["cell_type"] == "markdown":
        return sum(max(1, -(-len(line) // WRAP)) for line in text.splitlines()) or 1
    n = len(text.splitlines())
    out = 0
    for o in cell.get("outputs", []):
        if "text" in o:
            out += len(_text(o["text"]).splitlines())
        data = o.get("data", {})
        if _is_plot(data):
            out += PLOT_LINES
        elif "text/plain" in data and WIDGET not in data:
            out += len(_text(data["text/plain"]).splitlines())
    return n + min(out, MAX_OUTPUT_LINES)


def _heading(cell) -> int:
    """1, 2 or 3 for a markdown cell that starts with that heading level, else 0."""
    if cell["cell_type"] != "markdown":
        return 0
    first = _source(cell).lstrip().split("\n", 1)[0]
    match = re.match(r"(#{1,3}) ", first)
    return len(match.group(1)) if match else 0


def slide_types(cells) -> list[str]:
    """The slide type of every cell: "slide", "subslide", "-" (same slide) or "skip"."""
    types, filled, section = [], 0, ""
    for i, cell in enumerate(cells):
        level = _heading(cell)
        source = _source(cell)
        if level in (1, 2):
            section = source.lstrip().split("\n", 1)[0].lstrip("# ").strip().lower()
        if i == 0:
            kind = "slide"
        elif section == "setup" or "google.colab" in source:
            kind = "skip"
        elif cell["cell_type"] == "code" and (CHECK.search(source) or _only_widgets(cell)):
            kind = "skip"
        elif level in (1, 2):
            kind = "slide"
        elif level == 3 or _has_plot(cell) or filled + _lines(cell) > SLIDE_LINES:
            kind = "subslide"
        else:
            kind = "-"
        if kind in ("slide", "subslide"):
            filled = 0
        if kind != "skip":
            filled += _lines(cell)
        types.append(kind)
    return types


def mark(nb: dict) -> dict:
    """Write `slide_types()` into the cells' metadata (what RISE and nbconvert read)."""
    for cell, kind in zip(nb["cells"], slide_types(nb["cells"])):
        cell.setdefault("metadata", {})["slideshow"] = {"slide_type": kind}
    return nb


# --------------------------------------------------------------------------------------------
# reveal.js and MathJax, once, from the npm registry
# --------------------------------------------------------------------------------------------

def tarball(name: str) -> pathlib.Path:
    """The package's tarball in wheelhouse/npm/, downloaded and checked when missing."""
    version, sha512, _ = PACKAGES[name]
    path = NPM_DIR / f"{name}-{version}.tgz"
    if not path.exists():
        url = f"https://registry.npmjs.org/{name}/-/{name}-{version}.tgz"
        print(f"downloading {url}")
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        except OSError as exc:
            raise SystemExit(f"cannot download {url} ({exc}). With no network, copy "
                             f"{path.name} into {NPM_DIR} (make wheelhouse puts it there).")
        got = base64.b64encode(hashlib.sha512(data).digest()).decode()
        if got != sha512:
            raise SystemExit(f"{url}: sha512 {got} is not the expected {sha512}")
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return path


def assets() -> dict[str, str]:
    """{"reveal.js/dist/reveal.js": text, ...}: the files a deck inlines."""
    out = {}
    for name, (_, _, files) in PACKAGES.items():
        with tarfile.open(tarball(name)) as tar:
            for file in files:
                out[f"{name}/{file}"] = tar.extractfile(f"package/{file}").read().decode()
    # The theme's web font is a file beside it; a deck uses the system's sans-serif instead.
    theme = "reveal.js/dist/theme/white.css"
    out[theme] = re.sub(r"@import url\([^)]*\);?", "", out[theme])
    return out


# --------------------------------------------------------------------------------------------
# The deck
# --------------------------------------------------------------------------------------------

PREFIX = "course-reveal"   # stands for reveal.js's location in the template, inlined afterwards


def _inline_css(html: str, href: str, css: str) -> str:
    pattern = re.compile(r'<link[^>]*href="' + re.escape(href) + r'"[^>]*>')
    if not pattern.search(html):
        raise RuntimeError(f"the reveal template no longer links {href}: update scripts/slides.py")
    return pattern.sub(lambda _: f"<style>\n{css}\n</style>", html, count=1)


def export(path: pathlib.Path, files: dict[str, str]) -> str:
    """One lesson as a self-contained reveal.js deck (HTML text)."""
    import nbformat
    from nbconvert import SlidesExporter

    nb = mark(nbformat.read(path, as_version=4))
    # The Colab badge is an image on the web; the deck is for a room with no network.
    title = nb.cells[0]
    title.source = "\n".join(ln for ln in title.source.splitlines() if "colab-badge.svg" not in ln)
    maths = any(c.cell_type == "markdown" and re.search(r"\$[^$\n]+\$", c.source)
                for c in nb.cells)
    exporter = SlidesExporter(template_name="slides_template",
                              extra_template_basedirs=[str(TEMPLATE_DIR.parent)],
                              reveal_url_prefix=PREFIX, reveal_theme="white",
                              reveal_width="1280", reveal_height="800", embed_images=True,
                              exclude_input_prompt=True, exclude_output_prompt=True)
    resources = {"metadata": {"name": path.stem, "path": str(path.parent)},
                 "course": {"reveal_js": files["reveal.js/dist/reveal.js"],
                            "notes_js": files["reveal.js/plugin/notes/notes.js"],
                            "mathjax": files["mathjax/es5/tex-svg.js"] if maths else ""}}
    html, _ = exporter.from_notebook_node(nb, resources=resources)
    html = _inline_css(html, f"{PREFIX}/dist/reveal.css", files["reveal.js/dist/reveal.css"])
    html = _inline_css(html, f"{PREFIX}/dist/theme/white.css",
                       files["reveal.js/dist/theme/white.css"])
    left = re.findall(r'<(?:img|script|iframe)[^>]* src="(https?:[^"]+)"'
                      r'|<link[^>]* href="(https?:[^"]+)"', html)
    if left:
        raise RuntimeError(f"{path.name}: the deck still loads {left[:3]} from the network")
    return html


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=pathlib.Path)
    ap.add_argument("--fetch-only", action="store_true",
                    help="download reveal.js and MathJax into wheelhouse/npm/ and stop")
    ap.add_argument("--out", type=pathlib.Path, default=OUT_DIR)
    args = ap.parse_args()
    files = assets()
    if args.fetch_only:
        names = ", ".join(p.name for p in NPM_DIR.glob("*.tgz"))
        print(f"in {NPM_DIR.relative_to(ROOT)}: {names}")
        return 0
    paths = args.notebooks or sorted((ROOT / "lessons").glob("[0-9]*.ipynb"))
    args.out.mkdir(parents=True, exist_ok=True)
    for path in paths:
        html = export(path, files)
        target = args.out / f"{path.stem}.slides.html"
        target.write_text(html)
        kinds = slide_types(json.loads(path.read_text())["cells"])
        print(f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}: "
              f"{kinds.count('slide')} slides and {kinds.count('subslide')} sub-slides, "
              f"{len(html) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
