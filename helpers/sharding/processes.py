"""Starting a tensor-parallel model's ranks as processes from a notebook, talking to them, and
stopping them. (Lesson 11.)

    from helpers.sharding import start_ranks

    group = start_ranks(world_size=2)              # gloo on a CPU; waits until every rank is ready
    run = group.generate(input_ids, new_tokens=20)
    group.stop()

    with start_ranks(2) as group:                  # or for one block of code
        ...

``start_ranks`` starts one ``python -m helpers.sharding.worker`` per rank. The ranks meet at a
``torch.distributed`` store that is a file in a fresh temporary folder (as vLLM's workers on
one machine do), so there is no port to agree on: two groups, or two notebooks, never fight
over a fixed port, and the connections gloo then opens between the ranks take ports the
operating system picks, on the loopback interface (nothing listens on the network). Each rank
joins the process group and loads its slices of the model. The notebook is not a rank: it
sends every rank the same command and collects their answers.

What can go wrong, and what this module does about it:

- a rank dies (killed, out of memory, a crash): the others would wait in their next all-reduce
  until a timeout. The notebook watches every rank while it waits for answers, so the call
  fails within a fraction of a second with a ``RankDied`` error that names the rank, its exit
  code and its last log lines, and the group's other ranks are stopped;
- a rank hangs, or is stopped (SIGSTOP): every rank says it is alive twice a second,
  even while it waits in an all-reduce, so a rank that stays silent for ``SILENT_SECONDS``
  while the others go on is the one that is stuck: the call fails naming it, and the group is
  stopped. A call that gets no answer within ``timeout`` seconds fails too;
- a cell is interrupted (the notebook's Interrupt button, Ctrl-C): the ranks ignore the
  signal and finish the command they were given. Every command and its answers carry an id,
  so the group's next call drops those late answers and waits for its own;
- a bad argument (an empty batch, a token id the model does not have, ``new_tokens=2.5``): a
  ``ValueError`` naming it, before anything is sent; the group stays as it was;
- the notebook's kernel ends (restart, crash, kill): every rank's standard input closes, and
  every rank also watches its parent's process id (a child the kernel forked may keep standard
  input open); the rank exits at once (``worker``'s lifeline), as lesson 07's server does, and
  removes the group's folder. A folder whose ranks were killed with their kernel (Jupyter
  kills a kernel's whole process group) is removed by the next ``start_ranks``;
- a cell that starts a group runs again: the group started before under the same ``name`` is
  stopped first; a call on a stopped group says so.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .decode import Decoded, check_decode_input

#: Every rank says it is alive this often (seconds), even while it waits in an all-reduce ...
HEARTBEAT_SECONDS = 0.5
#: ... so a rank that says nothing for this long while the other ranks go on is stuck.
SILENT_SECONDS = 20 * HEARTBEAT_SECONDS
#: The groups' folders are named ``helpers-ranks-<the notebook's process id>-<random>``.
_FOLDER_PREFIX = "helpers-ranks-"
#: The groups this process started and has not stopped yet, by name.
_RUNNING: dict[str, "RankGroup"] = {}
_LOCK = threading.Lock()
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]     # the folder that holds helpers/
#: The loopback interface's name, where gloo is told to use it (elsewhere it picks one itself).
_LOOPBACK = {"linux": "lo", "darwin": "lo0"}


class RankDied(RuntimeError):
    """A rank's process ended while its group needed it. (Lesson 11.)"""


def choose_backend(world_size: int) -> str:
    """NCCL when every rank can have a CUDA GPU of its own, else gloo (ranks on the CPU).
    (Lesson 11.)"""
    import torch.distributed as dist

    if (torch.cuda.is_available() and torch.cuda.device_count() >= world_size
            and dist.is_nccl_available()):
        return "nccl"
    return "gloo"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)                             # signal 0: only asks whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:                         # another user's process
        pass
    return True


def _remove_stale_folders() -> None:
    """Remove the folders of groups whose notebook process is gone: ranks killed together with
    their kernel (as Jupyter kills one: its whole process group) had no time to do it."""
    if os.name != "posix":
        return
    for folder in Path(tempfile.gettempdir()).glob(f"{_FOLDER_PREFIX}*-*"):
        pid = folder.name[len(_FOLDER_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RankGroup:
    """The rank processes of one tensor-parallel model (made by ``start_ranks``). (Lesson 11.)

    ``world_size``, ``backend``, ``config`` (the model's sizes), ``pids`` (one a rank),
    ``store`` (the file they met at), ``ready`` (what each rank said when it was ready: its
    weights' bytes, the bytes it read from the checkpoint, its memory, its start-up seconds).
    Methods: ``generate``, ``allreduce_seconds``, ``memory``, ``stop``; ``with group:`` stops
    it at the end.
    """

    def __init__(self, name: str, world_size: int, backend: str, model, config, threads: int,
                 timeout: float):
        self.name, self.world_size, self.backend = name, world_size, backend
        self.config, self.timeout = config, timeout
        _remove_stale_folders()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-"))
        self.store = self.workdir / "store"       # the ranks' meeting point: a file, no port
        self._answers: queue.Queue = queue.Queue()
        self._heard = [time.monotonic()] * world_size   # when each rank last said anything
        self._command_id = 0                      # the last command sent's id (0: "ready")
        self._stopped: str | None = None          # why the group was stopped ("" if asked to)
        self.processes: list[subprocess.Popen] = []
        self.ready: list[dict] = []
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(_PACKAGE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        if sys.platform in _LOOPBACK and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = _LOOPBACK[sys.platform]   # gloo stays on this machine
        for rank in range(world_size):
            command = [sys.executable, "-m", "helpers.sharding.worker", "--rank", str(rank),
                       "--world-size", str(world_size), "--store", str(self.store),
                       "--backend", backend, "--threads", str(threads),
                       "--timeout", str(timeout), "--heartbeat", str(HEARTBEAT_SECONDS),
                       "--parent", str(os.getpid()), "--workdir", str(self.workdir)]
            if model is not None:
                command += ["--model", os.fspath(model)]
            with open(self.log_path(rank), "wb") as log:
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=log, env=env, cwd=str(self.workdir))
            self.processes.append(process)
            threading.Thread(target=self._read, args=(rank, process), daemon=True).start()

    # --- talking to the ranks ---------------------------------------------------------------

    def log_path(self, rank: int) -> Path:
        return self.workdir / f"rank{rank}.log"

    def logs(self, rank: int, lines: int = 8) -> str:
        """The last ``lines`` lines rank ``rank`` wrote to its log (standard error)."""
        try:
            text = self.log_path(rank).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _read(self, rank: int, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._heard[rank] = time.monotonic()  # every line is a sign of life
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "id" in message:                   # an answer (else "alive")
                self._answers.put((rank, message))
        self._answers.put((rank, None))           # its standard output closed: it ended

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    @property
    def running(self) -> bool:
        return (self._stopped is None and bool(self.processes)
                and all(p.poll() is None for p in self.processes))

    def _stop_because(self, why: str) -> str:
        """Stop the group, remembering ``why`` for the calls that come after; the message of
        the error to raise now."""
        self._stopped = why
        self.stop()
        return f"{why}; the group is stopped: start a new one"

    def _died(self, rank: int, doing: str) -> RankDied:
        process = self.processes[rank]
        try:
            process.wait(2)
        except subprocess.TimeoutExpired:
            pass
        code = process.poll()
        how = _exit_reason(code) if code is not None else "its output closed"
        last = self.logs(rank)
        message = self._stop_because(f"rank {rank} of {self.world_size} died ({how}) while "
                                     f"{doing}")
        return RankDied(message + (f". Its last lines:\n{last}" if last else "."))

    def _dead(self) -> int | None:
        """The first rank whose process has ended, if any."""
        return next((r for r, p in enumerate(self.processes) if p.poll() is not None), None)

    def _failed(self, rank: int, answer: dict, doing: str) -> Exception:
        """Rank ``rank``'s error; unless another rank died, which is then the cause (the error
        is often only a connection that the dead rank's end broke): it has a moment to end."""
        for _ in range(20):
            if (dead := self._dead()) is not None:
                return self._died(dead, doing)
            time.sleep(0.05)
        late = answer["id"] != self._command_id
        return RuntimeError(self._stop_because(
            f"rank {rank} failed while {'finishing an interrupted call' if late else doing}: "
            f"{answer.get('error')}"))

    def _silent(self) -> list[int]:
        """The ranks that said nothing for ``SILENT_SECONDS`` while the others went on (a rank
        alone: while the clock went on)."""
        latest = max(self._heard) if self.world_size > 1 else time.monotonic()
        return [rank for rank, heard in enumerate(self._heard)
                if latest - heard > SILENT_SECONDS]

    def _collect(self, doing: str, timeout: float) -> list[dict]:
        """Every rank's answer to the last command, watching all of them while waiting.
        Answers to an earlier command (a call that was interrupted) are dropped, and the wait
        for this one starts again from each."""
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            try:
                rank, answer = self._answers.get(timeout=0.1)
            except queue.Empty:
                rank, answer = None, None
            if rank is not None and answer is None:
                raise self._died(rank, doing)
            if answer is not None:
                if not answer.get("ok"):
                    raise self._failed(rank, answer, doing)
                if answer["id"] == self._command_id:
                    answers[rank] = answer
                else:               # an interrupted call's late answer: dropped; wait anew
                    deadline = time.monotonic() + timeout
            for other, process in enumerate(self.processes):
                if process.poll() is not None and other not in answers:
                    raise self._died(other, doing)
            silent = self._silent() if self.ready else []    # starting up: no watch yet
            if silent:
                for stuck in silent:
                    self.processes[stuck].kill()  # a stopped process does not see stdin close
                raise TimeoutError(self._stop_because(
                    f"{_ranks(silent)} of {self.world_size} stopped answering while {doing}: "
                    f"no sign of life for {SILENT_SECONDS:g} s while the others kept talking "
                    f"(a hang, or a process stopped by a signal)"))
            if time.monotonic() > deadline:
                silent = [r for r in range(self.world_size) if r not in answers]
                raise TimeoutError(self._stop_because(
                    f"{_ranks(silent)} did not answer within {timeout:g} s while {doing}"))
        return [answers[r] for r in range(self.world_size)]

    def _ask(self, command: dict, doing: str, timeout: float | None = None) -> list[dict]:
        if self._stopped is not None:
            raise RuntimeError("this group was stopped"
                               + (f" because {self._stopped}" if self._stopped else "")
                               + ": start a new one (start_ranks)")
        if (dead := self._dead()) is not None:
            raise self._died(dead, doing)
        number = self._command_id + 1
        line = (json.dumps({"id": number, **command}) + "\n").encode()
        try:
            for rank, process in enumerate(self.processes):
                process.stdin.write(line)
                process.stdin.flush()
            self._command_id = number             # every rank has it
        except (BrokenPipeError, OSError):
            raise self._died(rank, doing) from None
        except BaseException:                     # interrupted between two ranks: the ranks
            self._stop_because("a call was interrupted while it handed the ranks a command")
            raise                                 # may be out of step for good
        try:
            return self._collect(doing, timeout or self.timeout)
        except KeyboardInterrupt as interrupt:
            if hasattr(interrupt, "add_note"):    # Python 3.11 and later
                interrupt.add_note("The ranks finish the command they were given; the "
                                   "group's next call waits for that, then for its own.")
            raise

    def wait_ready(self, timeout: float | None = None) -> "RankGroup":
        """Wait until every rank has joined the group and loaded its slices."""
        try:
            self.ready = self._collect("starting", timeout or self.timeout)
        except BaseException:
            self.stop()
            raise
        return self

    # --- what a lesson asks of them ---------------------------------------------------------

    def generate(self, input_ids, new_tokens: int, communicate: bool = True) -> Decoded:
        """Every rank runs the greedy loop on ``input_ids`` ``(batch, length)`` (a tensor or
        nested lists; rows of equal length); rank 0's result, after checking that every rank
        chose the same tokens. ``communicate=False`` skips the all-reduces (each rank keeps its
        partial sums: wrong tokens, but the time of a step without communication). A bad
        argument is a ``ValueError`` here, before anything is sent."""
        input_ids, new_tokens = check_decode_input(input_ids, new_tokens,
                                                   self.config.vocab_size,
                                                   self.config.n_positions)
        if not isinstance(communicate, bool):
            raise ValueError(f"communicate must be True or False, got {communicate!r}")
        runs = [Decoded.from_dict(a) for a in self._ask(
            {"op": "generate", "input_ids": input_ids.tolist(), "new_tokens": new_tokens,
             "communicate": communicate}, "generating")]
        if communicate:
            for rank, run in enumerate(runs[1:], 1):
                if run.tokens != runs[0].tokens:
                    raise RuntimeError(f"rank {rank} chose other tokens than rank 0")
        return runs[0]

    def allreduce_seconds(self, numel: int, repeats: int = 20) -> list[float]:
        """Rank 0's time of each of ``repeats`` all-reduces of ``numel`` float32 numbers."""
        return self._ask({"op": "allreduce", "numel": numel, "repeats": repeats},
                         "timing all-reduces")[0]["seconds"]

    def memory(self) -> list[dict]:
        """Per rank: ``rss_bytes`` (its process's resident memory now) and ``weight_bytes``."""
        return [{"rss_bytes": a["rss_bytes"], "weight_bytes": a["weight_bytes"]}
                for a in self._ask({"op": "memory"}, "reading memory")]

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every rank: close its standard input (it exits at once), then kill it if it
        lingers. Safe to call twice."""
        if self._stopped is None:
            self._stopped = ""
        with _LOCK:
            if _RUNNING.get(self.name) is self:
                del _RUNNING[self.name]
        for process in self.processes:
            try:
                if process.stdin is not None and not process.stdin.closed:
                    process.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (f"RankGroup(name={self.name!r}, world_size={self.world_size}, "
                f"backend={self.backend!r}, pids={self.pids}, {state})")


def start_ranks(world_size: int = 2, *, backend: str = "auto", model=None, threads: int = 1,
                name: str = "default", timeout: float = 120.0, wait: bool = True) -> RankGroup:
    """Start ``world_size`` rank processes of a tensor-parallel model and wait until each has
    joined the group and loaded its slices of the model. (Lesson 11.)

    backend: "gloo" (CPU), "nccl" (a CUDA GPU per rank) or "auto" (``choose_backend``).
    model:   a checkpoint folder or a hub id in the local cache (GPT-2 only); None is the
             bundled model (or $COURSE_MODEL).
    threads: torch threads per rank.
    name:    a group started under a name replaces the one started before under that name.
    timeout: seconds to wait for the ranks to start, and for any one answer.
    ``ValueError`` for a world size the model cannot be split into (checked before anything
    starts); ``RankDied`` or ``TimeoutError`` if a rank does not come up.
    """
    from ..models import resolve_model_name
    from .model import _read_config, model_folder
    from .plan import check_world_size

    model = model_folder(resolve_model_name(model))
    config = _read_config(model)
    if config.model_type != "gpt2":
        raise ValueError(f"the split plan is written for GPT-2 models; {model} holds a "
                         f"{config.model_type!r} model")
    check_world_size(config, world_size)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if backend == "auto":
        backend = choose_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'auto', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"NCCL needs a CUDA GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs")
    with _LOCK:
        previous = _RUNNING.pop(name, None)
    if previous is not None:
        previous.stop()
    group = RankGroup(name, world_size, backend, model, config, threads, timeout)
    with _LOCK:
        _RUNNING[name] = group
    return group.wait_ready() if wait else group


def stop_all() -> None:
    """Stop every group this process started (also run when the process exits)."""
    with _LOCK:
        groups = list(_RUNNING.values())
    for group in groups:
        group.stop()


atexit.register(stop_all)

