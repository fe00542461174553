"""What a decode step costs, measured on this device: reading the weights, doing the
arithmetic, and a fixed overhead per step. (Lesson 02; lessons 03-11 read their results with
it.)

A decode step of B rows (one new token each, with the KV cache) must at least

* **read the weights** once: every weight is used by every row, but read from memory once per
  step: weight bytes / memory bandwidth, the same for 1 row as for 1,000;
* **do the arithmetic**: about 2 FLOPs per weight per row (a multiply and an add):
  B x 2 x parameters / arithmetic rate, growing with the batch;
* **pay its fixed overhead**: every operation of the step is started by the CPU (Python,
  PyTorch's dispatcher, and on a GPU a kernel launch), a few microseconds each, a couple of
  hundred operations per step for a small model, whatever the batch and the width.

On a GPU the three happen largely at the same time, so the step takes about the largest of
them: that one is the step's *bound*, and it decides what makes the step faster. A big model
at a small batch reads weights (memory-bound: an extra row is nearly free, quantizing the
weights helps); a big batch does arithmetic (compute-bound); a small model whose weights take
microseconds to read waits for the CPU to start its kernels (overhead-bound: fusing operations
and CUDA graphs help, lesson 10). On a CPU the same cores do all three one after another, so
they add up, and every extra row adds its arithmetic (lesson 02 measures both).

``measure_rates`` measures this device's bandwidth and arithmetic rate; ``step_overhead``
measures the overhead by timing the same model shrunk to a width of a few numbers, whose
weights and arithmetic cost nothing: what is left is the cost of starting its operations.
``step_cost`` puts the three together for a batch size.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device, repeats: int) -> float:
    fn()                                         # warm-up: allocations, library set-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class DeviceRates:
    """What this device moves and computes per second, measured: ``bandwidth`` in bytes/s
    (a large copy: bytes read + bytes written), ``compute`` in FLOP/s (a large matrix product
    in ``dtype``). (Lesson 02.)"""

    device: str
    dtype: torch.dtype
    bandwidth: float
    compute: float


def measure_rates(device="cpu", dtype=torch.float32, repeats: int = 5) -> DeviceRates:
    """Measure this device's memory bandwidth and arithmetic rate (the best of ``repeats``
    runs of each, so a busy moment does not count): a copy of 128 MB (1 GB on a GPU) and a
    matrix product of 1024 x 1024 (8192 x 8192 on a GPU). A second or two. (Lesson 02.)"""
    device = torch.device(device)
    gpu = device.type == "cuda"
    nbytes = 2**30 if gpu else 2**27
    source = torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype,
                        device=device)
    target = torch.empty_like(source)
    copy_seconds = _best_seconds(lambda: target.copy_(source), device, repeats)
    bandwidth = 2 * source.numel() * source.element_size() / copy_seconds
    del source, target
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    matmul_seconds = _best_seconds(lambda: a @ b, device, repeats)
    return DeviceRates(str(device), dtype, bandwidth, 2 * n**3 / matmul_seconds)


def shrunk_copy(model, width_per_head: int = 4):
    """The same architecture as ``model`` (layers, heads, vocabulary, every operation of its
    step) with ``width_per_head`` numbers per attention head instead of dozens: its weights and
    arithmetic cost next to nothing, its operations are the same. Random weights; on the
    model's device and dtype. (Lesson 02.)"""
    config = copy.deepcopy(model.config)
    heads = config.num_attention_heads
    config.hidden_size = heads * width_per_head
    if getattr(config, "head_dim", None):
        config.head_dim = width_per_head
    for name in ("intermediate_size", "n_inner"):
        if getattr(config, name, None):
            setattr(config, name, 4 * config.hidden_size)
    torch.manual_seed(0)
    return type(model)(config).to(device=model.device, dtype=model.dtype).eval()


def step_overhead(model, steps: int = 20) -> float:
    """The fixed cost of one decode step of ``model``, in seconds: the fastest of ``steps``
    decode steps (batch 1, with the KV cache, after a prompt of 4 tokens) of
    ``shrunk_copy(model)``, which runs the same operations on almost no data. The fastest, as
    the lessons' timings take it: the one least disturbed by other work. (Lesson 02.)"""
    tiny = shrunk_copy(model)
    token = torch.zeros(1, 4, dtype=torch.long, device=model.device)
    times = []
    with torch.no_grad():
        out = tiny(input_ids=token, use_cache=True)
        past, token = out.past_key_values, token[:, -1:]
        for _ in range(steps + 3):
            _sync(model.device)
            start = time.perf_counter()
            out = tiny(input_ids=token, past_key_values=past, use_cache=True)
            _sync(model.device)
            times.append(time.perf_counter() - start)
            past = out.past_key_values
    return min(times[3:])                         # the first steps set things up


@dataclass
class StepCost:
    """The three costs of one decode step of ``batch`` rows, in seconds; ``step`` is the
    largest, and ``bound`` names it ("reading weights", "arithmetic", "overhead"). (Lesson
    02.)"""

    batch: int
    read: float
    arithmetic: float
    overhead: float

    @property
    def step(self) -> float:
        return max(self.read, self.arithmetic, self.overhead)

    @property
    def bound(self) -> str:
        costs = {"reading weights": self.read, "arithmetic": self.arithmetic,
                 "overhead": self.overhead}
        return max(costs, key=costs.get)


def weight_bytes(model) -> int:
    """Bytes of the model's weights (each shared tensor once, e.g. GPT-2's tied embedding and
    output layer)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def step_cost(model, batch: int, rates: DeviceRates, overhead: float) -> StepCost:
    """The cost model for one decode step of ``batch`` rows of ``model`` on a device with
    ``rates`` and a measured ``overhead`` per step (``step_overhead``): weight bytes /
    bandwidth, batch x 2 FLOPs per weight / compute rate, and the overhead. It leaves out
    attention over the KV cache, which adds to reading as the sequences grow. (Lesson 02.)"""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    size = weight_bytes(model)
    weights = size // next(model.parameters()).element_size()
    return StepCost(batch, size / rates.bandwidth, batch * 2 * weights / rates.compute,
                    overhead)
