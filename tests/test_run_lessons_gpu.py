"""`make test-gpu`'s script (scripts/run_lessons_gpu.py) and its figure table
(scripts/gpu_figures.py), on this CPU: the headline figures are found in the committed lessons,
the report and its JSON are written from a made-up GPU run, --report-from rebuilds them from
executed copies (a folder or an archive), a missing package gives one pip line and status 3,
and helpers.gpu_record reads the JSON the script writes. No GPU is needed: nothing here times
anything."""

import json
import re
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_figures  # noqa: E402
import run_lessons_gpu  # noqa: E402

from helpers.gpu_run import gpu_record  # noqa: E402

LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
BY_NUMBER = {gpu_figures.lesson_number(p): p for p in LESSONS}


def _committed(number):
    return gpu_figures.read_notebook(BY_NUMBER[number])


# --- the figure table against the committed lessons ------------------------------------------

@pytest.mark.parametrize("figure", gpu_figures.FIGURES,
                         ids=lambda f: f.lesson + "-" + re.sub(r"[^A-Za-z0-9]+", "-", f.label)[:40])
def test_every_figure_is_printed_by_exactly_one_cell_of_its_committed_lesson(figure):
    nb = _committed(figure.lesson)
    assert len(gpu_figures.cells_with(nb, figure.marker)) == 1, (
        f"lesson {figure.lesson}: the marker {figure.marker!r} must be in exactly one code cell")
    value = gpu_figures.read_figure(nb, figure)
    if figure.gpu_only:
        # on a CPU the cell says there is nothing to count; its GPU line is tested below
        assert value == gpu_figures.NOT_FOUND
    else:
        assert value != gpu_figures.NOT_FOUND, (
            f"lesson {figure.lesson}: {figure.label!r} is not in what its cell printed")


def test_every_lesson_has_headline_figures_with_distinct_labels():
    for number in BY_NUMBER:
        labels = [f.label for f in gpu_figures.FIGURES if f.lesson == number]
        assert labels, f"lesson {number} has no headline figure in gpu_figures.FIGURES"
        assert len(labels) == len(set(labels)), f"lesson {number}: two figures share a label"
    assert {f.lesson for f in gpu_figures.FIGURES} <= set(BY_NUMBER)


def test_the_figures_the_lessons_printed_on_this_cpu():
    """A few values read from the committed outputs, as the lessons print them."""
    seen = {n: gpu_figures.headlines(_committed(n), n) for n in ("01", "02", "08", "10")}
    gpu_only = {f.label for f in gpu_figures.FIGURES if f.gpu_only}
    for number, values in seen.items():
        assert all(v != gpu_figures.NOT_FOUND for k, v in values.items() if k not in gpu_only), (
            number, values)
    assert seen["01"]["KV cache speed-up, 200 tokens"].endswith("x")
    assert seen["02"]["throughput, batch 1 → 128"].startswith("×")
    assert " → " in seen["08"]["chunked prefill, worst gap between tokens, whole prompt → chunks"]
    assert seen["10"]["the profiler's first row, one eager step"].startswith("aten::")


@pytest.mark.parametrize("topic", list(gpu_figures.TOPICS))
def test_every_quoted_topic_is_found_in_its_committed_lesson(topic):
    number, markers = gpu_figures.TOPICS[topic]
    nb = _committed(number)
    for marker in markers:
        assert len(gpu_figures.cells_with(nb, marker)) == 1, (topic, marker)
    lines = gpu_figures.topic_lines(nb, markers)
    assert lines and all(line.strip() for line in lines)


def _code_cell(source, *texts, name="stdout"):
    return {"cell_type": "code", "source": source, "metadata": {}, "execution_count": 1,
            "outputs": [{"output_type": "stream", "name": name, "text": t} for t in texts]}


def _figure(label):
    return next(f for f in gpu_figures.FIGURES if f.label == label)


def test_a_figure_reads_not_found_when_its_cell_is_missing_or_prints_something_else():
    figure = _figure("KV cache speed-up, 200 tokens")
    assert gpu_figures.read_figure(None, figure) == gpu_figures.NOT_FOUND
    assert gpu_figures.read_figure({"cells": []}, figure) == gpu_figures.NOT_FOUND
    other = {"cells": [_code_cell(figure.marker, "the KV cache made 100 tokens 2.0x faster\n")]}
    assert gpu_figures.read_figure(other, figure) == gpu_figures.NOT_FOUND
    failed = {"cells": [_code_cell(figure.marker)]}
    assert gpu_figures.read_figure(failed, figure) == gpu_figures.NOT_FOUND
    right = {"cells": [_code_cell(figure.marker, "the KV cache made 200 tokens 1.3x faster\n")]}
    assert gpu_figures.read_figure(right, figure) == "1.3x"


def test_colour_codes_and_progress_bars_do_not_hide_a_figure():
    figure = _figure("TTFT beside a long request: 100-token / 10-token request")
    nb = {"cells": [_code_cell(figure.marker, "\x1b[34m100 tokens\x1b[0m: TTFT  68.0 ms, done\n",
                               "\x1b[33m 10 tokens\x1b[0m: TTFT  13.2 ms, done\n")]}
    assert gpu_figures.read_figure(nb, figure) == "68.0 / 13.2 ms"
    bar = _figure("continuous / static batching, wall time")
    nb = {"cells": [_code_cell(bar.marker, "static:  50%|#####     | 1/2\rstatic: 100%|##| 2/2\n",
                               name="stderr"),
                    ]}
    nb["cells"][0]["outputs"].append({"output_type": "stream", "name": "stdout",
                                      "text": "static 4.1 s, continuous 1.9 s: continuous "
                                              "batching is 2.2x faster\n"})
    assert gpu_figures.read_figure(nb, bar) == "2.2x"
    assert gpu_figures.printed(nb["cells"][0]).splitlines()[0] == "static: 100%|##| 2/2"


def test_the_gpu_only_launch_count_and_the_graph_table_read_a_gpu_output():
    launches = _figure("kernel launches, one eager step → one replay")
    nb = {"cells": [_code_cell(launches.marker, "one eager step: 115 launches {'cudaLaunchKernel': "
                               "115}\none replayed step: 1 launches {'cudaGraphLaunch': 1}\n")]}
    assert gpu_figures.read_figure(nb, launches) == "115 → 1"
    graphs = _figure("CUDA graph: eager → eager replayed, batch 64")
    table = ("ms per step         batch 1   batch 8  batch 64\n"
             "eager                  2.90      3.00      3.40\n"
             "eager, graphed         0.20      0.25      0.68\n"
             "same tokens in all four ways: True\n")
    nb = {"cells": [_code_cell(graphs.marker, table)]}
    assert gpu_figures.read_figure(nb, graphs) == "5.00x (3.40 → 0.68 ms)"
    missing_row = _figure("CUDA graph: eager → compiled and replayed, batch 1")
    assert gpu_figures.read_figure(nb, missing_row) == gpu_figures.NOT_FOUND


def test_lesson_01s_step_growth_and_lesson_02s_bounds_read_a_gpu_output():
    growth = _figure("decode step without the cache, start → after 200 tokens")
    nb = {"cells": [_code_cell(growth.marker,
                               "no cache: a decode step took   2.90 ms at the start and   2.95 ms "
                               "after 200 tokens (x1.0)\nKV cache: a decode step took   2.20 ms at "
                               "the start and   2.21 ms after 200 tokens (x1.0)\n")]}
    assert gpu_figures.read_figure(nb, growth) == "x1.0 (2.90 → 2.95 ms)"
    bound = _figure("what bounds the step, batch 1 / batch 128")
    nb = {"cells": [_code_cell(bound.marker,
                               "batch   1: the measured decode step (TPOT) 2.90 ms; the three costs: "
                               "reading 0.00 ms, arithmetic 0.00 ms, overhead 2.80 ms: bound by "
                               "overhead\nbatch 128: the measured decode step (TPOT) 3.10 ms; the "
                               "three costs: reading 0.00 ms, arithmetic 0.01 ms, overhead 2.80 ms: "
                               "bound by overhead\n")]}
    assert gpu_figures.read_figure(nb, bound) == "overhead / overhead"


# --- the report, from a made-up GPU run ------------------------------------------------------

GPU_LINES = {
    "01": ("speedup = no_cache.latency / kv.latency",
           "            TTFT ms  TPOT ms  latency s  tokens/s\nno cache       3.10     2.90"
           "      0.580       345\nKV cache       2.80     2.20      0.440       454\n\nthe KV "
           "cache made 200 tokens 1.3x faster\n"),
    "10a": ("time_graphed(", "ms per step         batch 1   batch 8  batch 64\n"
            "eager                  2.90      3.00      3.40\n"
            "eager, graphed         0.20      0.25      0.68\n"
            "compiled               1.10      1.20      1.50\n"
            "compiled, graphed      0.15      0.18      0.40\n"
            "same tokens in all four ways: True\n"),
    "10b": ("kernel_launches(", "one eager step: 115 launches {'cudaLaunchKernel': 115}\n"
            "one replayed step: 1 launches {'cudaGraphLaunch': 1}\n"),
}


def _copy(cells, record):
    return {"cells": cells, "metadata": {"course": {"gpu_run": record}}, "nbformat": 4,
            "nbformat_minor": 5}


def _fake_run(folder: Path, with_run_json=True):
    """A results folder as a GPU run leaves it: lesson 01 ran, lesson 02 failed, lesson 10
    ran (its CUDA-graph cells only), workbook 01 ran, the rest were cut by the budget."""
    lessons, workbooks = folder / "lessons", folder / "workbooks"
    lessons.mkdir(parents=True)
    workbooks.mkdir()
    ok01 = {"status": "ok", "detail": "", "seconds": 12.3}
    (lessons / BY_NUMBER["01"].name).write_text(json.dumps(_copy(
        [_code_cell(*GPU_LINES["01"])], ok01)))
    failed02 = {"status": "failed", "detail": "cell 5: ValueError: boom", "seconds": 3.0}
    (lessons / BY_NUMBER["02"].name).write_text(json.dumps(_copy([], failed02)))
    ok10 = {"status": "ok", "detail": "", "seconds": 40.0}
    (lessons / BY_NUMBER["10"].name).write_text(json.dumps(_copy(
        [_code_cell(*GPU_LINES["10b"]), _code_cell(*GPU_LINES["10a"])], ok10)))
    (workbooks / BY_NUMBER["01"].name).write_text(json.dumps(_copy([], {
        "status": "ok", "detail": "", "seconds": 20.0})))
    if with_run_json:
        notebooks = {f"lessons/{BY_NUMBER['01'].name}": ok01,
                     f"lessons/{BY_NUMBER['02'].name}": failed02,
                     f"lessons/{BY_NUMBER['10'].name}": ok10,
                     f"lessons/{BY_NUMBER['03'].name}": {"status": "not run",
                                                         "detail": "time budget"}}
        run = {"device": "NVIDIA H200 (139 GiB)", "cpu_only": False, "date": "2026-11-26",
               "versions": {"python": "3.12.3", "torch": "2.11.0+cu130", "CUDA": "13.0",
                            "transformers": "5.17.0", "peft": "0.18.0", "torchao": "0.18.0"},
               "command": "python scripts/run_lessons_gpu.py --budget 540", "jobs": 4,
               "budget_seconds": 540, "wall_seconds": 530.5, "notebooks": notebooks,
               "server": {"result": {"lines": ["device: NVIDIA H200", "1 client: gap p50 0.6 ms"],
                                     "checks": {"same tokens": True}},
                          "seconds": 200.0, "budget_seconds": 240}}
        (folder / "run.json").write_text(json.dumps(run))
    return folder


def test_the_report_and_its_json_from_a_made_up_gpu_run(tmp_path):
    results = _fake_run(tmp_path / "gpu")
    report, record = tmp_path / "gpu-run.md", tmp_path / "gpu-run.json"
    run_lessons_gpu.write_report(results, report, record)
    text, data = report.read_text(encoding="utf-8"), json.loads(record.read_text())
    assert record.read_bytes().isascii()        # gpu_record reads it in any locale

    assert "- device: NVIDIA H200 (139 GiB)" in text and "torch 2.11.0+cu130" in text
    assert "peft 0.18.0" in text and "Not a GPU run" not in text
    rows = {row["name"]: row for row in data["notebooks"] if row["kind"] == "lessons"}
    assert rows[BY_NUMBER["01"].name]["seconds"] == 12.3
    assert rows[BY_NUMBER["01"].name]["cpu_seconds"] == \
        _committed("01")["metadata"]["course"]["execution_seconds"]
    assert f"| lessons/{BY_NUMBER['02'].name} | FAILED: cell 5: ValueError: boom | 3.0 |" in text
    assert f"| lessons/{BY_NUMBER['03'].name} | not run: time budget |  |" in text
    workbook = next(r for r in data["notebooks"] if r["kind"] == "workbooks")
    assert workbook["status"] == "ok" and workbook["seconds"] is None   # not reported

    cpu01 = gpu_figures.headlines(_committed("01"), "01")
    assert (f"| KV cache speed-up, 200 tokens | {cpu01['KV cache speed-up, 200 tokens']} "
            f"| 1.3x |") in text
    fig02 = data["figures"]["02"]["rows"]
    assert all(row["gpu"] == gpu_figures.NOT_FOUND for row in fig02)    # it failed early
    assert all(row["gpu"] == "not run" for row in data["figures"]["03"]["rows"])
    launches = next(r for r in data["figures"]["10"]["rows"] if r["gpu_only"])
    assert launches == {"label": launches["label"], "gpu_only": True, "cpu": "GPU only",
                        "gpu": "115 → 1"}

    topics = data["topics"]
    assert topics["lesson 10, CUDA graphs"] == [
        line for key in ("10a", "10b") for line in GPU_LINES[key][1].splitlines()]
    assert "KV cache speed-up, 200 tokens: 1.3x (laptop CPU: " in topics["lesson 01"][0]
    assert "lesson 03" not in topics                                     # it did not run
    assert topics["server"] == ["device: NVIDIA H200", "1 client: gap p50 0.6 ms"]
    assert "1 client: gap p50 0.6 ms" in text and "same tokens: True" in text
    assert data["device"] == "NVIDIA H200 (139 GiB)" and data["versions"]["torch"] == \
        "2.11.0+cu130"


def test_the_report_judges_the_course_claims_on_the_run_and_names_its_commit(tmp_path):
    """A fresh run judges every GPU claim on its own figures (scripts/claims.py): lesson 01's
    made-up 1.3x holds "the ratio stays far below a CPU's", lesson 10's one replay launch
    holds "a launch or two", lesson 02's failure leaves its claims without evidence; nothing is
    stale, and every verdict keeps the hash of the sentence it judged."""
    results = _fake_run(tmp_path / "gpu")
    run = json.loads((results / "run.json").read_text())
    (results / "run.json").write_text(json.dumps({**run, "commit": "abc1234"}))
    report, record = tmp_path / "gpu-run.md", tmp_path / "gpu-run.json"
    run_lessons_gpu.write_report(results, report, record, fresh=True)
    text, data = report.read_text(encoding="utf-8"), json.loads(record.read_text())
    assert "- commit: abc1234" in text and data["commit"] == "abc1234"
    verdicts = {e["id"]: e for e in data["claims"]}
    assert verdicts["01-exercise-1-gpu"]["verdict"] == "holds"
    assert verdicts["10-summary-launches"]["verdict"] == "holds"
    assert verdicts["02-gpu-extra-row-free"]["verdict"] == "no evidence"
    assert not any(e["stale"] for e in data["claims"])
    assert all(e["sentence"] for e in data["claims"])
    assert "| 10-summary-launches | lessons/10_compilation.ipynb, cell 1f5c14f6 | holds |" in text
    # the same copies reported later, from an old commit: the sentences changed since are stale
    run_lessons_gpu.write_report(results, report, record)
    stale = json.loads(record.read_text())["claims"]
    assert all(e["stale"] and e["sentence"] is None for e in stale)
    assert "holds (stale)" in report.read_text(encoding="utf-8")


def test_a_server_check_that_failed_or_did_not_run_is_reported(tmp_path):
    results = _fake_run(tmp_path / "gpu")
    run = json.loads((results / "run.json").read_text())
    for server, expected in (({"error": "benchmarks/gpu_server.py is not in this copy of the "
                                        "course", "seconds": 0.4},
                               "The check did not run to its end: benchmarks/gpu_server.py is "
                               "not in this copy of the course."),
                              ({"error": "the check ended without a result (status -9, killed "
                                         "120 s past its budget)",
                                "log_tail": ["[gpu_server 9.0 s] graphed engine ready"]},
                               "budget).\n\nIts last lines:\n\n```text\n[gpu_server 9.0 s] "
                               "graphed engine ready\n```"),
                              ({"skipped": "--no-server"}, "Not run: --no-server.")):
        run["server"] = server
        (results / "run.json").write_text(json.dumps(run))
        run_lessons_gpu.write_report(results, tmp_path / "r.md", tmp_path / "r.json")
        assert expected in (tmp_path / "r.md").read_text()
        assert "server" not in json.loads((tmp_path / "r.json").read_text())["topics"]


def test_gpu_record_reads_the_json_the_script_writes(tmp_path):
    results = _fake_run(tmp_path / "gpu")
    record = tmp_path / "gpu-run.json"
    run_lessons_gpu.write_report(results, tmp_path / "gpu-run.md", record)
    quoted = gpu_record("lesson 10, CUDA graphs", record=record)
    lines = quoted.splitlines()
    assert lines[0] == "recorded on NVIDIA H200 (139 GiB), 2026-11-26, torch 2.11.0+cu130:"
    assert lines[1:] == [f"  {line}" for key in ("10a", "10b")
                         for line in GPU_LINES[key][1].splitlines()]
    assert "1.3x" in gpu_record("lesson 01", record=record)
    assert "has nothing on 'lesson 03'" in gpu_record("lesson 03", record=record)


def test_report_from_a_folder_and_from_its_archive(tmp_path):
    """Executed copies alone (no run.json): each copy's own record of its run is used; an
    archive of the folder gives the same report. A failed copy makes the status 1."""
    results = _fake_run(tmp_path / "sent-back" / "gpu", with_run_json=False)
    out = {}
    for name, source in (("folder", results), ("archive", tmp_path / "run.tar.gz")):
        if name == "archive":
            with tarfile.open(source, "w:gz") as archive:
                archive.add(results, arcname="gpu")
        md, js = tmp_path / f"{name}.md", tmp_path / f"{name}.json"
        status = run_lessons_gpu.main(["--report-from", str(source), "--report", str(md),
                                       "--json", str(js)])
        assert status == 1                                   # lesson 02 failed
        out[name] = md.read_text()
    assert out["folder"] == out["archive"]
    data = json.loads((tmp_path / "folder.json").read_text())
    assert data["device"] == "unknown device"
    names = [(r["kind"], r["name"], r["status"]) for r in data["notebooks"]]
    assert names == [("lessons", BY_NUMBER["01"].name, "ok"),
                     ("lessons", BY_NUMBER["02"].name, "failed"),
                     ("lessons", BY_NUMBER["10"].name, "ok"),
                     ("workbooks", BY_NUMBER["01"].name, "ok")]
    assert "| KV cache speed-up, 200 tokens |" in out["folder"]


def test_report_from_refuses_a_folder_without_executed_notebooks(tmp_path):
    with pytest.raises(SystemExit, match="no executed notebooks"):
        run_lessons_gpu.main(["--report-from", str(tmp_path), "--report",
                              str(tmp_path / "r.md"), "--json", str(tmp_path / "r.json")])


# --- before anything runs --------------------------------------------------------------------

def test_a_missing_package_gives_one_pip_line_and_status_3(monkeypatch, capsys):
    monkeypatch.setattr(run_lessons_gpu, "REQUIRED",
                        [("json", "json"), ("surely_not_a_module_here", "nbclient"),
                         ("another_missing_module", "some-tool")])
    assert run_lessons_gpu.main(["--no-server"]) == 3
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    assert out.startswith("missing: nbclient, some-tool; install with: ")
    assert "python3 -m pip install --no-deps -r requirements-gpu.txt" in out
    assert "&& python3 -m pip install some-tool" in out          # not in requirements-gpu.txt
    assert "pip install nbclient" not in out                      # it is, with its pins


def test_a_package_that_needs_a_missing_module_names_it(tmp_path, monkeypatch):
    (tmp_path / "half_installed.py").write_text("import surely_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = run_lessons_gpu.missing_packages([("half_installed", "half-installed"),
                                                ("json", "json")])
    assert missing == ["half-installed (needs surely_absent_dependency)"]


def test_requirements_gpu_pins_what_constraints_pin_and_covers_the_imports():
    def pins(path):
        found = {}
        for line in (ROOT / path).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, version = line.split("==")
                key = run_lessons_gpu._canonical(name)
                assert key not in found, f"{path}: {name} twice"
                found[key] = version.strip()
        return found

    gpu, tested = pins("requirements-gpu.txt"), pins("constraints.txt")
    assert gpu and all(tested.get(name) == version for name, version in gpu.items()), {
        name: (version, tested.get(name)) for name, version in gpu.items()
        if tested.get(name) != version}
    # what the script imports, less what a GPU image with torch brings
    image = {"torch", "transformers", "peft", "matplotlib", "tqdm", "httpx", "h11"}
    needed = {run_lessons_gpu._canonical(p) for _, p in run_lessons_gpu.REQUIRED} - image
    assert needed <= set(gpu), needed - set(gpu)
    assert "torch" not in gpu and "transformers" not in gpu


def test_no_notebook_starts_once_the_budget_is_spent(tmp_path):
    runner = run_lessons_gpu.Runner(tmp_path, timeout=300, budget=10,
                                    started=time.monotonic() - 11)
    records = run_lessons_gpu.run_notebooks(runner, "lessons", LESSONS[:3], jobs=1)
    assert [r["status"] for r in records.values()] == ["not run"] * 3
    assert list(tmp_path.iterdir()) == []                         # no worker was started


def test_only_picks_notebooks_by_part_of_their_path():
    assert [p.name for p in run_lessons_gpu.notebooks("lessons", ["02"])] == [BY_NUMBER["02"].name]
    assert run_lessons_gpu.notebooks("workbooks", ["lessons/"]) == []
    assert len(run_lessons_gpu.notebooks("lessons", [])) == len(LESSONS)


def test_a_notebook_runs_from_a_copy_and_its_failure_is_recorded(tmp_path):
    """One real kernel: the copy is written with the outputs up to the cell that raised (a
    cell not reached shows none, not the saved ones), the source is left as it was, and the
    record names the cell."""
    import nbformat

    source = tmp_path / "lessons" / "99_check.ipynb"
    source.parent.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint(os.getcwd())"),
                nbformat.v4.new_markdown_cell("text"),
                nbformat.v4.new_code_cell("raise ValueError('boom')"),
                nbformat.v4.new_code_cell("print('not reached')", execution_count=4, outputs=[
                    nbformat.v4.new_output("stream", name="stdout", text="saved on a CPU\n")])]
    nbformat.write(nb, source)
    before = source.read_bytes()
    target = tmp_path / "results" / "lessons" / source.name
    record = run_lessons_gpu.execute_copy(source, target, timeout=120)
    assert record["status"] == "failed" and record["detail"] == "cell 2: ValueError: boom"
    assert source.read_bytes() == before
    copy = nbformat.read(target, as_version=4)
    assert copy.cells[0].outputs[0]["text"].strip() == str(source.parent)
    assert copy.cells[3].outputs == [] and copy.cells[3].execution_count is None   # not reached
    assert copy.metadata["course"]["gpu_run"] == record


def test_the_server_check_is_called_and_its_failures_are_caught(tmp_path, monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "benchmarks.gpu_server", None)       # not there
    assert run_lessons_gpu.server_check(tmp_path, 10, False) == {
        "error": "benchmarks/gpu_server.py is not in this copy of the course"}

    calls = []

    def run(out_dir, budget_seconds, allow_cpu=False):
        calls.append((out_dir, budget_seconds, allow_cpu))
        return {"lines": ["device: cpu"], "checks": {}}

    module = types.ModuleType("benchmarks.gpu_server")
    module.run = run
    monkeypatch.setitem(sys.modules, "benchmarks.gpu_server", module)
    assert run_lessons_gpu.server_check(tmp_path, 10, True) == {
        "result": {"lines": ["device: cpu"], "checks": {}}}
    assert calls == [(tmp_path, 10, True)]

    def broken(out_dir, budget_seconds):                 # no allow_cpu: none is passed
        raise RuntimeError("the GPU server check needs a CUDA device")

    module.run = broken
    failed = run_lessons_gpu.server_check(tmp_path, 10, True)
    assert failed["error"] == ("benchmarks.gpu_server.run raised RuntimeError: the GPU server "
                               "check needs a CUDA device")
    assert "Traceback" in failed["traceback"]


def test_workbooks_run_several_at_a_time_each_in_its_own_worker(tmp_path):
    """Two real kernels at once (--jobs 2): each notebook gets its record and its copy."""
    import nbformat

    sources = []
    for name, code in (("01_a.ipynb", "print(sum(range(10)))"), ("02_b.ipynb", "1 / 0")):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(code)]
        sources.append(tmp_path / "workbooks" / name)
        sources[-1].parent.mkdir(exist_ok=True)
        nbformat.write(nb, sources[-1])
    runner = run_lessons_gpu.Runner(tmp_path / "out", timeout=120, budget=None,
                                    started=time.monotonic())
    records = run_lessons_gpu.run_notebooks(runner, "workbooks", sources, jobs=2)
    assert records["workbooks/01_a.ipynb"]["status"] == "ok"
    assert records["workbooks/02_b.ipynb"]["detail"] == "cell 0: ZeroDivisionError: division by zero"
    copy = nbformat.read(tmp_path / "out" / "workbooks" / "01_a.ipynb", as_version=4)
    assert copy.cells[0].outputs[0]["text"] == "45\n"


def test_the_readme_quotes_the_gpu_records_server_table():
    """The README's table of the server with CUDA graphs off and on is the one the record's
    server lines give (after a new GPU run, paste `server_table`'s lines into the README)."""
    record = json.loads(run_lessons_gpu.RECORD.read_text())
    table = run_lessons_gpu.server_table(record["server"]["lines"])
    assert len(table) == 5, table
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "\n".join(table) in readme, "README.md's GPU server table should read:\n" + \
        "\n".join(table)
    doctored = [line.replace("      1  on           966", "      1  on           900")
                for line in record["server"]["lines"]]
    assert "| 1 | 362 → 900 |" in "\n".join(run_lessons_gpu.server_table(doctored))
