"""Write the shared pieces into every lesson: the Colab badge under the title, the Colab setup
cell first among the code cells (collapsed in Colab and JupyterLab), kernel and Colab
metadata (GPU runtime). Also two rules of form: a heading (#, ## or ###) always begins its
markdown cell (text before it is left in a cell of its own), and every cell carries its slide
type, from scripts/slides.py (what RISE and `make slides` present).

    python scripts/sync_notebooks.py            # rewrite lessons/*.ipynb in place
    python scripts/sync_notebooks.py --check    # exit 1 if a lesson is out of step

Run it after changing the Repository address in pyproject.toml, then `make execute`.
"""

import argparse
import json
import pathlib
import re
import sys

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from notebook_setup import (COLAB_CELL_METADATA, ROOT, binder_badge, colab_badge,  # noqa: E402
                            colab_cell, repo_url)
from slides import mark as mark_slides  # noqa: E402

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def lines(text: str) -> list[str]:
    out = text.splitlines(keepends=True)
    return out


def split_at_headings(cells: list) -> list:
    """Markdown cells cut so that a heading line (outside a fenced code block) starts a cell.

    The piece after a cut gets the cell's id with `-` and the heading's line number, so the
    same lesson always gives the same ids."""
    out = []
    for cell in cells:
        if cell["cell_type"] != "markdown":
            out.append(cell)
            continue
        text = "".join(cell["source"]).split("\n")
        cuts, fenced = [], False
        for number, line in enumerate(text):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif number and not fenced and re.match(r"#{1,3} ", line):
                cuts.append(number)
        for start, stop in zip([0] + cuts, cuts + [len(text)]):
            piece = "\n".join(text[start:stop]).strip("\n")
            if start == 0:
                new = dict(cell, source=lines(piece))
            else:
                new = nbformat.v4.new_markdown_cell(piece, id=f"{cell.get('id', 'md')}-{start}")
            out.append(new)
    return out


def sync(nb: dict, name: str) -> dict:
    cells = nb["cells"]
    if not cells or cells[0]["cell_type"] != "markdown":
        raise ValueError(f"{name}: the first cell must be the markdown title")
    title = [ln for ln in "".join(cells[0]["source"]).splitlines() if "colab-badge.svg" not in ln]
    head, rest = title[:1], title[1:]
    while rest and not rest[0].strip():
        rest.pop(0)
    cells[0]["source"] = lines("\n".join(head + ["", colab_badge(name), ""] + rest))
    code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), None)
    source = lines(colab_cell())
    if code is not None and "google.colab" in "".join(cells[code]["source"]):
        cells[code]["source"] = source
    else:
        code = 1
        cells.insert(code, nbformat.v4.new_code_cell(source))
    cells[code].setdefault("metadata", {}).update(COLAB_CELL_METADATA)
    nb["cells"] = split_at_headings(cells)
    mark_slides(nb)
    md = nb.setdefault("metadata", {})
    md["kernelspec"] = KERNELSPEC
    md["accelerator"] = "GPU"
    md["colab"] = {"provenance": [], "gpuType": "T4"}
    md.setdefault("language_info", {"name": "python"})
    return nb


def sync_readme(text: str) -> str:
    """The README's badges and the address quoted in it, from pyproject.toml."""
    out = []
    for line in text.splitlines():
        if line.startswith("[![Open In Colab]"):
            line = colab_badge("01_text_generation.ipynb")
        elif line.startswith("[![Binder]"):
            line = binder_badge()
        elif line.startswith("(https://github.com/") and line.endswith(")."):
            line = f"({repo_url()})."
        out.append(line)
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("notebooks", nargs="*")
    args = ap.parse_args()
    paths = [pathlib.Path(p) for p in args.notebooks] or sorted((ROOT / "lessons").glob("*.ipynb"))
    stale = []
    for path in paths:
        before = path.read_text()
        nb = sync(json.loads(before), path.name)
        after = nbformat.writes(nbformat.from_dict(nb)) + "\n"
        if after != before:
            stale.append(path.name)
            if not args.check:
                path.write_text(after)
    readme = ROOT / "README.md"
    before = readme.read_text()
    after = sync_readme(before)
    if after != before:
        stale.append("README.md")
        if not args.check:
            readme.write_text(after)
    if args.check and stale:
        print("out of step:", ", ".join(stale))
        return 1
    print(("out of step: " if args.check else "updated: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
