"""Every answer the tests know, through its check: how many wrong ones each workbook's checks
catch, and how many right ones they pass (``tests/answers.py`` lists them).

    python scripts/check_answers.py                  # on the CPU, what `make test` tests too
    python scripts/check_answers.py --device cuda    # the same on a GPU, where a tensor left on
                                                     # the CPU fails for real

One line per workbook (right answers passed, wrong ones flagged, flagged with the hint the tests
expect), then every answer that went the wrong way. Exit status 1 if any did.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import pathlib
import signal
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _Late(BaseException):
    pass


def _alarm(signum, frame):
    raise _Late()


def line_of(check, answer, args, seconds: float = 60) -> str:
    """The line ``check(answer, *args)`` prints (a check that takes fewer arguments, an older
    one, gets fewer)."""
    accepted = len(inspect.signature(check).parameters) - 1
    out = io.StringIO()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            check(answer, *args[:accepted])
    except _Late:
        return f"(still running after {seconds:.0f} s)"
    except Exception as error:                              # noqa: BLE001
        return f"(the check itself raised {type(error).__name__}: {error})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return out.getvalue().strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", help="where the model and the cases go (cpu, cuda)")
    ap.add_argument("--lesson", action="append", default=[], help="LL; repeat (default: all)")
    args = ap.parse_args()

    import torch

    from helpers import load_model
    from tests.answers import exercises

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tokenizer = load_model(device=args.device)
    ctx = {"model": model, "tokenizer": tokenizer, "device": model.device}
    lessons = args.lesson or sorted(p.name[:2] for p in (ROOT / "lessons").glob("*.ipynb"))
    wrong_way = []
    print(f"device: {model.device}; torch {torch.__version__}")
    print(f"{'workbook':9} {'right passed':>13} {'wrong flagged':>14} {'with its cause':>15}")
    for lesson in lessons:
        right = passed = wrong = flagged = named = 0
        for exercise in exercises(lesson):
            call = [ctx[a] for a in exercise.args]
            for answer in exercise.right:
                line = line_of(exercise.check, answer, call)
                right += 1
                passed += line.startswith("✓")
                if not line.startswith("✓"):
                    wrong_way.append(f"{lesson} {exercise.name}: right answer "
                                     f"{getattr(answer, '__name__', answer)}: {line}")
            for answer, symptom in exercise.wrong.items():
                line = line_of(exercise.check, answer, call)
                wrong += 1
                flagged += line.startswith("✗")
                named += line.startswith("✗") and symptom in line
                if not (line.startswith("✗") and symptom in line):
                    wrong_way.append(f"{lesson} {exercise.name}: wrong answer "
                                     f"{getattr(answer, '__name__', answer)} (expected "
                                     f"{symptom!r}): {line}")
        print(f"{lesson:9} {passed:>6} of {right:<4} {flagged:>6} of {wrong:<5} {named:>7} of {wrong:<5}",
              flush=True)
    for entry in wrong_way:
        print("  " + entry[:400])
    return 1 if wrong_way else 0


if __name__ == "__main__":
    sys.exit(main())
