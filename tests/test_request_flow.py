"""docs/request-flow.md lists the files one request crosses: the list is what
scripts/request_path.py records for a real request (plus the engine process's pipe)."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_request_flow_page_lists_the_files_a_request_crosses():
    spec = importlib.util.spec_from_file_location("request_path",
                                                  ROOT / "scripts" / "request_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    crossed = module.crossed()
    measured = {f for f in crossed if f.startswith("helpers/server/")}
    measured.add("helpers/server/engine_process.py")          # the pipe, in the default server
    page = (ROOT / "docs" / "request-flow.md").read_text()
    listed = re.findall(r"^\d+\. `(helpers/server/[a-z_]+\.py)`", page, re.M)
    assert len(listed) == len(set(listed))
    assert set(listed) == measured, (sorted(set(listed) - measured), sorted(measured - set(listed)))
    outside = {f for f in crossed if not f.startswith("helpers/server/")}
    assert outside == set(re.findall(r"`(helpers/(?!server/)[a-z_/]+\.py)`", page))
