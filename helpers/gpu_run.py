"""The course's record of its last run on a GPU, for lessons to quote. (Lessons 01-11.)

The lessons run on whatever device a learner has, and print what that device measured. Some of
what they teach shows only on a GPU (launch-bound steps, CUDA graphs); a learner on a laptop
can still read what a GPU measured: ``make test-gpu`` (``scripts/run_lessons_gpu.py``) runs
every lesson on a GPU and writes ``docs/gpu-run.md`` for people and ``docs/gpu-run.json`` for
this module. ``gpu_record(topic)`` gives one topic of it as text, with the device, date and
versions it came from.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The record ``make test-gpu`` writes (beside the lessons, in the repository's docs/).
RECORD = Path(__file__).resolve().parents[1] / "docs" / "gpu-run.json"


def gpu_record(topic: str, record: Path | None = None) -> str:
    """The lines the last GPU run recorded under ``topic`` (e.g. "lesson 10, CUDA graphs"),
    headed by the device, the date and the torch version; a sentence saying so when this
    copy of the course has no record, or none for that topic. (Lessons 01-11.)"""
    path = Path(record) if record is not None else RECORD
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return (f"no GPU run is recorded in this copy of the course ({path.name} is missing; "
                f"`make test-gpu` on a machine with a CUDA GPU writes it)")
    lines = data.get("topics", {}).get(topic)
    versions = data.get("versions", {})
    head = (f"{data.get('device', 'a GPU')}, {data.get('date', 'undated')}, torch "
            f"{versions.get('torch', '?')}")
    if not lines:
        return f"the GPU run recorded ({head}) has nothing on {topic!r}"
    return "\n".join([f"recorded on {head}:"] + [f"  {line}" for line in lines])
