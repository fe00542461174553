"""Compiling the decode step: what eager PyTorch spends on a small model, what ``torch.compile``
removes, and what compiling costs. (Lesson 10.)

A decode step of the bundled model runs a couple of hundred PyTorch operations on matrices 256
wide. Each operation goes through Python (transformers' modules), the dispatcher and a kernel
launch; at batch 1 that bookkeeping, not the arithmetic, fills most of the step. A compiler
traces the step once into a graph, fuses the element-wise operations between the matrix
products into a few generated kernels, and from then on runs the graph with no Python between
the operations. The price is paid up front (the compile) and again whenever an input's shape
changes (a recompilation), so a decode step that is compiled needs shapes that stay put:

- a **static KV cache** (transformers' ``StaticCache``): every layer's keys and values are
  allocated once at their full length, and each step writes its token at its position, so the
  cache's shapes do not grow from step to step (``static_prefill``, ``static_decode_step``,
  ``generate_static_cache``);
- a batch size from a short list: a batch is padded with extra rows up to the next **capture
  size** (``CAPTURE_SIZES``, ``capture_size``, ``pad_batch``), or the batch dimension is marked
  dynamic so that one graph serves every size (``mark_batch_dynamic``).

``CountingBackend`` is a ``torch.compile`` backend that compiles nothing: it records each graph
it is handed, so that a lesson can count recompilations for the price of tracing alone.

The lesson's measurements: ``step_profile`` (the profiler's view of one step), ``time_decode``
(the fastest decode step at each batch size, eager or compiled), ``break_even_tokens`` (how
many tokens pay for a compile) and the two figures, ``decode_speed_figure`` and
``break_even_figure``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from matplotlib.figure import Figure

from .plots import PALETTE
from .quiet import quiet_stderr

#: The batch sizes a compiled decode step is prepared for in this course: powers of two up to
#: 64. A batch of any other size is padded up to the next one (``capture_size``). vLLM's
#: default list is denser (1, 2, 4, then steps of 8), so that less of a batch is padding.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


# --- capture sizes and padding ----------------------------------------------------------------

def _check_count(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def capture_size(batch: int, sizes=CAPTURE_SIZES) -> int | None:
    """The smallest of ``sizes`` that holds ``batch`` rows, or None when the batch is larger
    than every size (it then runs without a compiled graph). ``sizes`` may come in any order.
    (Lesson 10.)"""
    _check_count("batch", batch)
    sizes = list(sizes)
    if not sizes:
        raise ValueError("sizes must hold at least one batch size")
    for size in sizes:
        _check_count("every capture size", size)
    fitting = [size for size in sizes if size >= batch]
    return min(fitting) if fitting else None


def pad_batch(input_ids: torch.Tensor, size: int, pad_token_id: int) -> torch.Tensor:
    """``input_ids`` (batch, sequence) with rows of ``pad_token_id`` added below it up to
    ``size`` rows, on its device and in its dtype. The real rows come first, so row i of the
    result is row i of the input and a step's output for them is ``out[:batch]``. The extra
    rows are thrown away after every step: rows of a batch do not attend to each other, so
    they change nothing for the real ones. (Lesson 10.)"""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a tensor of shape (batch, sequence)")
    _check_count("size", size)
    batch = input_ids.shape[0]
    if size < batch:
        raise ValueError(f"cannot pad {batch} rows down to {size}: size must be >= the batch")
    padding = input_ids.new_full((size - batch, input_ids.shape[1]), pad_token_id)
    return torch.cat([input_ids, padding])


# --- a backend that counts ----------------------------------------------------------------------

class CountingBackend:
    """A ``torch.compile`` backend that compiles nothing: TorchDynamo hands it each graph it
    traced (a ``torch.fx.GraphModule``) with example inputs, it keeps the graph in ``graphs``
    and returns ``gm.forward``, which runs the graph's operations one by one (what
    ``backend="eager"`` does). ``len(backend.graphs)`` is the number of compilations: a
    recompilation after a guard failed (a new shape, say) adds one; a call that reuses a
    graph adds none. (Lesson 10.)

        backend = CountingBackend()
        step = torch.compile(decode_step, backend=backend, dynamic=False)
    """

    def __init__(self):
        self.graphs: list = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def graph_ops(gm) -> int:
    """The tensor operations in a graph that TorchDynamo traced: its calls of functions and
    methods that make a tensor (not its inputs, its output, and the arithmetic on sizes and
    other Python values that Dynamo records too). (Lesson 10.)"""
    def makes_tensor(node):
        value = node.meta.get("example_value")
        values = value if isinstance(value, (tuple, list)) else [value]
        return any(isinstance(v, torch.Tensor) for v in values)

    return sum(1 for node in gm.graph.nodes
               if node.op in ("call_function", "call_method") and makes_tensor(node))


def guard_failure_reasons(fn=None) -> list[str]:
    """Why TorchDynamo recompiled ``fn`` (the function given to ``torch.compile``; default:
    every function) since the last ``torch._dynamo.reset()``: one line per recompilation, the
    guard of the most recent graph that failed ("tensor 'token' size mismatch at index 0.
    expected 5, actual 6"). ``torch._logging.set_logs(recompiles=True)`` (or the environment
    variable ``TORCH_LOGS=recompiles``) prints the same as it happens, with every graph's failed
    guard and where in the code it was made. (Lesson 10.)"""
    import re

    from torch._dynamo.utils import guard_failures

    code = getattr(fn, "__code__", None)
    reasons = []
    for key, entries in guard_failures.items():
        if code is not None and key is not code:
            continue
        for entry in entries:
            text = str(entry).strip()
            first = text.splitlines()[0] if text else ""
            first = re.sub(r"^\d+/\d+: ", "", first).split("  #")[0].strip()
            if first:
                reasons.append(first)
    return reasons


def graphs_compiled() -> int:
    """How many graphs TorchDynamo has compiled in this process, with any backend: take the
    difference before and after a run to count its compilations. (Lesson 10.)"""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# --- the decode step on a static cache ----------------------------------------------------------

def static_prefill(model, input_ids: torch.Tensor, max_cache_len: int, cache=None):
    """Read the prompts ``input_ids`` (batch, sequence; all rows the same length, no padding)
    into a fresh ``StaticCache`` of ``max_cache_len`` positions (or into ``cache``, emptied
    first: a CUDA graph keeps the addresses of the cache it recorded); return the cache and
    each row's first greedy token, shape (batch, 1). Runs eager: a prompt's length changes from
    request to request, so the prefill is not what one compiles. (Lesson 10.)"""
    from transformers import StaticCache

    _check_count("max_cache_len", max_cache_len)
    if max_cache_len < input_ids.shape[1]:
        raise ValueError(f"max_cache_len ({max_cache_len}) must hold the prompt "
                         f"({input_ids.shape[1]} tokens)")
    if cache is None:
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    else:
        cache.reset()                           # zeros, in place: the same tensors
    position = torch.arange(input_ids.shape[1], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(model.device), past_key_values=cache,
                       cache_position=position, use_cache=True).logits
    return cache, logits[:, -1].argmax(dim=-1, keepdim=True)


def static_decode_step(model):
    """The decode step of ``model`` as a function of tensors and the cache only,
    ``step(token, cache, position) -> next token``: token (batch, 1) in, each row's greedy next
    token (batch, 1) out, written into the static cache at ``position`` (shape (1,)). The
    function to hand to ``torch.compile``. (Lesson 10.)"""

    def step(token, cache, position):
        logits = model(input_ids=token, past_key_values=cache, cache_position=position,
                       use_cache=True).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    return step


#: The first torch whose inductor compiles the static-cache decode step with an unbacked batch
#: dimension into one graph. Before it, ``mark_unbacked`` fails there: torch 2.11's inductor
#: stops at the cache write (``Broadcast failed in ExpandView``), 2.12 breaks the graph at the
#: attention and compiles again for every batch size.
UNBACKED_FROM = "2.13"


def batch_marker(version: str | None = None):
    """``(mark, line)``: the function that marks a tensor's dimension dynamic on this torch
    (or on ``version``), and one line that says which one and why. ``mark_unbacked`` where
    torch compiles the decode step with it (``UNBACKED_FROM`` on), ``torch._dynamo.mark_dynamic``
    before: the same single graph for every batch size of 2 and more, and a graph of its own
    for a batch of 1. (Lesson 10.)"""
    from torch.torch_version import TorchVersion

    installed = TorchVersion((version or torch.__version__).split("+")[0])   # 2.11.0+cu128
    if installed >= UNBACKED_FROM:
        from torch._dynamo.decorators import mark_unbacked
        return mark_unbacked, (f"torch {installed}: the batch dimension is marked with "
                               f"mark_unbacked, one graph for every batch size")
    return torch._dynamo.mark_dynamic, (
        f"torch {installed}: the batch dimension is marked with mark_dynamic, since "
        f"mark_unbacked compiles this step from torch {UNBACKED_FROM} on (older inductors fail "
        f"at the cache write or split the graph); a batch of 1 gets a graph of its own")


def mark_batch_dynamic(token: torch.Tensor, cache) -> None:
    """Tell TorchDynamo that dimension 0 (the batch) of the step's inputs, the token and every
    layer's keys and values, may have any size: one graph then serves every batch size.
    ``mark_unbacked`` makes no assumption about the size at all; ``torch._dynamo.mark_dynamic``
    (what ``batch_marker`` gives on torch before 2.13) still compiles a batch of 1 apart (a
    dimension of size 1 broadcasts, so the compiler treats it as a case of its own).
    (Lesson 10.)"""
    mark, _ = batch_marker()
    for tensor in [token] + [layer.keys for layer in cache.layers] + [layer.values
                                                                      for layer in cache.layers]:
        mark(tensor, 0)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def generate_static_cache(model, input_ids: torch.Tensor, new_tokens: int, step=None,
                          prepare=None, max_cache_len: int | None = None) -> torch.Tensor:
    """Greedy generation of ``new_tokens`` tokens per row on a ``StaticCache``: the prefill
    (eager) gives the first, then ``new_tokens - 1`` calls of ``step`` (default: the eager
    ``static_decode_step(model)``; give a compiled one to compare). ``prepare(token, cache)``
    runs after the prefill (``mark_batch_dynamic``, say). The cache holds ``max_cache_len``
    positions (default: the prompt and the new tokens). Returns the tokens, shape (batch,
    new_tokens). (Lesson 10.)"""
    _check_count("new_tokens", new_tokens)
    step = step or static_decode_step(model)
    prompt = input_ids.shape[1]
    if max_cache_len is not None and max_cache_len < prompt + new_tokens - 1:
        raise ValueError(f"max_cache_len ({max_cache_len}) must hold the prompt and every new "
                         f"token but the last ({prompt} + {new_tokens - 1})")
    cache, token = static_prefill(model, input_ids, max_cache_len or prompt + new_tokens)
    if prepare is not None:
        prepare(token, cache)
    tokens = [token]
    with torch.no_grad():
        for i in range(new_tokens - 1):
            position = torch.tensor([prompt + i], device=model.device)
            token = step(token, cache, position).clone()   # a CUDA graph reuses its output
            tokens.append(token)
    return torch.cat(tokens, dim=1)


def course_prompts(tokenizer, n: int = 64, length: int = 16, seed: int = 1) -> torch.Tensor:
    """``n`` prompts of exactly ``length`` tokens each, shape (n, length): the first tokens of
    held-out documents of the course's corpus (``corpus(seed=1)``, which the model never saw),
    so that a batch of any size needs no padding. On the CPU: move them to the model's
    device. (Lesson 10.)"""
    from .corpus import corpus

    _check_count("n", n)
    _check_count("length", length)
    rows = []
    for document in corpus(seed=seed, n_docs=4 * n + 50):
        ids = tokenizer(document)["input_ids"]
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == n:
            return torch.tensor(rows)
    raise ValueError(f"the corpus gave fewer than {n} documents of {length} tokens")


# --- the profiler's view of one step -------------------------------------------------------------

@dataclass
class StepProfile:
    """What ``torch.profiler`` saw in one call: ``ops`` (PyTorch operations called from Python
    or from a compiled graph, not counting the operations they call inside), ``matmuls``
    (matrix products among them: linear layers and the output layer), ``seconds`` (the wall
    time of the call, profiler included) and ``table`` (the profiler's table, the operations
    that took the most time first). (Lesson 10.)"""

    ops: int
    matmuls: int
    matmul_seconds: float
    seconds: float
    table: str = field(repr=False)


#: The profiler's names of matrix products (linear layers are addmm; the output layer mm).
MATMULS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear")


def outer_ops(prof) -> list:
    """The PyTorch operations a profiled piece of code called itself (from Python, or from a
    compiled graph), not those they call inside: ``aten::linear`` counts once, not again for
    the ``aten::addmm`` it runs. ``prof`` is a finished ``torch.profiler.profile``. (Lesson
    10.)"""
    return [e for e in prof.events() if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def step_profile(fn, *args, rows: int = 8) -> StepProfile:
    """Run ``fn(*args)`` once under ``torch.profiler`` (CPU activity, and CUDA on a GPU) and
    count what it launched. The profiler's own messages on stderr are hidden. (Lesson 10.)"""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with quiet_stderr(), torch.no_grad(), profile(activities=activities) as prof:
        start = time.perf_counter()
        fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    outer = outer_ops(prof)
    matmuls = [e for e in outer if e.name in MATMULS]
    matmul_seconds = sum(e.cpu_time_total for e in matmuls) / 1e6
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return StepProfile(ops=len(outer), matmuls=len(matmuls), matmul_seconds=matmul_seconds,
                       seconds=seconds, table=table)


# --- timing -------------------------------------------------------------------------------------

@dataclass
class DecodeTiming:
    """One batch size's decode steps: the fastest step in seconds, tokens per second at that
    pace (batch / seconds), and the greedy tokens (batch, steps + 1) of the last run. (Lesson
    10.)"""

    batch: int
    seconds_per_step: float
    token_ids: torch.Tensor = field(repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.batch / self.seconds_per_step


def time_decode(model, prompt_ids: torch.Tensor, batch_sizes, step=None, steps: int = 6,
                repeats: int = 3, prepare=None, max_cache_len: int | None = None,
                progress: bool = True, description: str = "decode steps"
                ) -> dict[int, DecodeTiming]:
    """For each batch size b: the first b rows of ``prompt_ids`` are prefilled (eager) into a
    static cache, then ``steps`` decode steps run with ``step`` (default the eager
    ``static_decode_step(model)``), each timed alone. The rounds go over every batch size in
    turn ``repeats`` times and each size keeps its fastest step, so that a busy moment of the
    machine spoils no size alone. ``prepare(token, cache)`` runs after each prefill
    (``mark_batch_dynamic``). The cache holds ``max_cache_len`` positions (default: just
    enough); give the length a compiled step was traced with, or its shapes change. Returns
    {batch: DecodeTiming}. (Lesson 10.)"""
    from tqdm.auto import tqdm

    batch_sizes = list(batch_sizes)
    _check_count("steps", steps)
    _check_count("repeats", repeats)
    if not batch_sizes:
        raise ValueError("batch_sizes must hold at least one batch size")
    for b in batch_sizes:
        _check_count("every batch size", b)
        if b > prompt_ids.shape[0]:
            raise ValueError(f"batch size {b} needs {b} prompts; prompt_ids has "
                             f"{prompt_ids.shape[0]}")
    step = step or static_decode_step(model)
    prompt_ids = prompt_ids.to(model.device)
    length = prompt_ids.shape[1]
    max_cache_len = max_cache_len or length + steps + 1
    if max_cache_len < length + steps + 1:
        raise ValueError(f"max_cache_len ({max_cache_len}) must hold the prompt and the steps "
                         f"({length} + {steps} + 1)")
    best = {b: math.inf for b in batch_sizes}
    tokens = {}
    with tqdm(total=repeats * len(batch_sizes), desc=description, disable=not progress) as bar:
        for _ in range(repeats):
            for b in batch_sizes:
                cache, token = static_prefill(model, prompt_ids[:b], max_cache_len)
                if prepare is not None:
                    prepare(token, cache)
                row = [token]
                with torch.no_grad():
                    for i in range(steps):
                        position = torch.tensor([length + i], device=model.device)
                        _sync(model.device)
                        start = time.perf_counter()
                        token = step(token, cache, position).clone()
                        _sync(model.device)
                        best[b] = min(best[b], time.perf_counter() - start)
                        row.append(token)
                tokens[b] = torch.cat(row, dim=1).cpu()
                bar.update()
    return {b: DecodeTiming(b, best[b], tokens[b]) for b in batch_sizes}


# --- CUDA graphs ---------------------------------------------------------------------------------

def warm_up_on_side_stream(fn, device, runs: int = 2) -> None:
    """Call ``fn`` ``runs`` times on a CUDA stream of its own before a capture (the handshake
    ``torch.cuda.graph`` asks for): the first calls of a step allocate (cuBLAS workspaces,
    lazy initialisations), which must not happen while a graph records. The side stream
    starts after the work already queued on the current stream, and the current stream's next
    work waits for it. (Lesson 10.)"""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(runs):
            fn()
    current.wait_stream(side)


def rerun_each_replay(body):
    """A stand-in for a CUDA graph where there is none (a CPU): each "replay" runs ``body``
    again and writes its result into the same output tensor, as a replay would. Returns
    ``(replay, output)``."""
    output = body()
    return (lambda: output.copy_(body())), output


def record(body, device, pool=None):
    """Record ``body()`` as a CUDA graph: ``(replay, output, pool)``. The one capture of the
    course: lesson 10's ``StepGraph`` and the server's decode steps (``helpers/server/
    graphs.py``) both use it. (Lesson 10.)

    ``replay()`` runs the recorded kernels again on whatever the input buffers hold, and
    overwrites ``output``. ``pool``: the memory pool of graphs captured before, to share
    (only one graph replays at a time, so they may share their intermediate tensors); the
    graph's own pool is returned. Without CUDA there is no graph and no launch to save:
    ``rerun_each_replay`` stands in."""
    if device.type != "cuda":
        return (*rerun_each_replay(body), None)
    warm_up_on_side_stream(body, device)             # the first calls allocate
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):         # launches recorded, not run
        output = body()                              # the graph's output buffer
    return graph.replay, output, graph.pool()


class StepGraph:
    """A decode step recorded once for ``size`` rows and replayed with a launch or two. (Lesson 10.)

    ``token`` (size, 1) and ``position`` (1,) are the inputs the graph reads, ``cache`` the
    ``StaticCache`` it reads and writes, ``output`` (size, 1) what it writes: the graph
    recorded their addresses, so each step copies its inputs into them (``copy_``) and reads
    the output from there, overwritten at the next replay. ``replay()`` runs the step.
    ``record`` does the recording (on a CPU, its stand-in calls the step again on the same
    buffers: the same code runs, with the same tokens, at no gain). ``pool``: a memory pool
    to share with other graphs (``capture_steps`` captures the largest first and shares its
    pool).
    """

    def __init__(self, step, model, size: int, max_cache_len: int, pool=None):
        _check_count("size", size)
        device = model.device
        self.step, self.size, self.max_cache_len = step, size, max_cache_len
        self.token = torch.zeros(size, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        # The cache's tensors exist once a prompt has been read into it.
        self.cache, _ = static_prefill(model, self.token, max_cache_len)
        with torch.no_grad():
            self._replay, self.output, self.pool = record(self.run, device, pool)

    def run(self) -> torch.Tensor:
        """The step, on the buffers the graph reads and writes."""
        return self.step(self.token, self.cache, self.position)

    def replay(self) -> torch.Tensor:
        """Run the recorded step on what the buffers hold now; returns ``output``."""
        with torch.no_grad():
            self._replay()
        return self.output


def capture_steps(step, model, sizes=CAPTURE_SIZES, max_cache_len: int = 64
                  ) -> dict[int, StepGraph]:
    """One ``StepGraph`` per capture size, {size: graph}, largest first so that the others
    reuse its memory pool, as engines do. (Lesson 10.)"""
    graphs, pool = {}, None
    for size in sorted(sizes, reverse=True):
        graphs[size] = StepGraph(step, model, size, max_cache_len, pool=pool)
        pool = pool or graphs[size].pool
    return dict(sorted(graphs.items()))


def replay_step(graphs: dict, token: torch.Tensor, position: torch.Tensor,
                pad_token_id: int) -> torch.Tensor:
    """One decode step by replaying a graph: the graph of the smallest capture size that
    holds the batch; the batch's tokens copied into its token buffer (padding rows below
    them), the position into its position buffer; the replay; the batch's rows of its
    output. (Lesson 10: the learner writes ``replay``.)"""
    graph = graphs[capture_size(token.shape[0], list(graphs))]
    graph.token.copy_(pad_batch(token, graph.size, pad_token_id))
    graph.position.copy_(position)
    return graph.replay()[:token.shape[0]]


def generate_graphed(model, graphs: dict, input_ids: torch.Tensor, new_tokens: int,
                     pad_token_id: int, replay=replay_step) -> torch.Tensor:
    """Greedy generation whose decode steps replay ``graphs`` (``capture_steps``): the prompts
    are padded to the capture size and prefilled (eager) into that graph's own cache, then
    ``new_tokens - 1`` steps of ``replay(graphs, token, position, pad_token_id)``. Returns the
    tokens, shape (batch, new_tokens). (Lesson 10.)"""
    _check_count("new_tokens", new_tokens)
    batch, length = input_ids.shape
    size = capture_size(batch, list(graphs))
    if size is None:
        raise ValueError(f"a batch of {batch} rows is larger than every captured size "
                         f"{sorted(graphs)}")
    graph = graphs[size]
    padded = pad_batch(input_ids.to(model.device), size, pad_token_id)
    _, token = static_prefill(model, padded, graph.max_cache_len, cache=graph.cache)
    token = token[:batch]
    tokens = [token]
    for i in range(new_tokens - 1):
        position = torch.tensor([length + i], device=model.device)
        token = replay(graphs, token, position, pad_token_id).clone()
        tokens.append(token)
    return torch.cat(tokens, dim=1)


def time_graphed(model, graphs: dict, prompt_ids: torch.Tensor, batch_sizes, pad_token_id: int,
                 steps: int = 6, repeats: int = 3) -> dict[int, DecodeTiming]:
    """``time_decode`` for steps that replay ``graphs``: each batch size's fastest step (copy
    in, replay, read the output), and its tokens. (Lesson 10.)"""
    batch_sizes = list(batch_sizes)
    prompt_ids = prompt_ids.to(model.device)
    best = {b: math.inf for b in batch_sizes}
    tokens = {}
    for _ in range(repeats):
        for b in batch_sizes:
            ids = prompt_ids[:b]
            graph = graphs[capture_size(b, list(graphs))]
            padded = pad_batch(ids, graph.size, pad_token_id)
            _, token = static_prefill(model, padded, graph.max_cache_len,
                                      cache=graph.cache)
            token, row = token[:b], [token[:b]]
            for i in range(steps):
                position = torch.tensor([ids.shape[1] + i], device=model.device)
                _sync(model.device)
                start = time.perf_counter()
                token = replay_step(graphs, token, position, pad_token_id).clone()
                _sync(model.device)
                best[b] = min(best[b], time.perf_counter() - start)
                row.append(token)
            tokens[b] = torch.cat(row, dim=1).cpu()
    return {b: DecodeTiming(b, best[b], tokens[b]) for b in batch_sizes}


def kernel_launches(fn, *args) -> dict[str, int]:
    """How many times ``fn(*args)`` asked the CUDA driver to launch something, by call
    (``cudaLaunchKernel`` and its kin, ``cudaGraphLaunch``), from ``torch.profiler``; {} on a
    machine without CUDA, which launches nothing. (Lesson 10.)"""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), torch.no_grad(), profile(activities=[ProfilerActivity.CPU,
                                                              ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch")):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


# --- does compiling pay? ------------------------------------------------------------------------

def break_even_tokens(compile_seconds: float, eager_step: float, compiled_step: float,
                      batch: int = 1) -> float:
    """How many tokens must be generated before a compile has paid for itself: each decode
    step saves ``eager_step - compiled_step`` seconds and writes ``batch`` tokens, so it takes
    ``ceil(compile_seconds / saving)`` whole steps, times ``batch`` tokens. ``math.inf`` when
    the compiled step saves nothing. (Lesson 10.)"""
    saving = eager_step - compiled_step
    if saving <= 0:
        return math.inf
    return math.ceil(compile_seconds / saving) * batch


# --- figures ------------------------------------------------------------------------------------

EAGER_COLOUR, COMPILED_COLOUR = PALETTE[1], PALETTE[0]


def decode_speed_figure(eager: dict, compiled: dict, title: str | None = None) -> Figure:
    """Tokens per second against batch size, eager and compiled (left), and the compiled
    step's speed-up at each batch size (right). ``eager`` and ``compiled`` map a batch size to
    a ``DecodeTiming`` (``time_decode``) or to seconds per step. (Lesson 10.)"""
    def seconds(value):
        return value.seconds_per_step if isinstance(value, DecodeTiming) else float(value)

    if not eager or not compiled or set(eager) != set(compiled):
        raise ValueError("eager and compiled must time the same batch sizes, e.g. "
                         "{1: 0.005, 8: 0.009} each")
    sizes = sorted(eager)
    fig = Figure(figsize=(10, 3.6), dpi=90, layout="constrained")
    left, right = fig.subplots(1, 2)
    for name, timings, colour in (("eager", eager, EAGER_COLOUR),
                                  ("compiled", compiled, COMPILED_COLOUR)):
        left.plot(sizes, [b / seconds(timings[b]) for b in sizes], marker="o", color=colour,
                  label=name)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(sizes, [str(b) for b in sizes])
    left.set_xlabel("batch size")
    left.set_ylabel("tokens/s (decode)")
    left.legend()
    left.grid(alpha=0.3, which="both")
    ratios = [seconds(eager[b]) / seconds(compiled[b]) for b in sizes]
    right.bar(range(len(sizes)), ratios, color=COMPILED_COLOUR)
    for i, ratio in enumerate(ratios):
        right.text(i, ratio, f"{ratio:.2f}×", ha="center", va="bottom")
    right.axhline(1, color=PALETTE[7], lw=1, ls="--")
    right.set_xticks(range(len(sizes)), [str(b) for b in sizes])
    right.set_xlabel("batch size")
    right.set_ylabel("speed-up (eager step / compiled step)")
    right.margins(y=0.15)
    if title:
        fig.suptitle(title)
    return fig


def break_even_figure(compile_seconds: float, eager_step: float, compiled_step: float,
                      batch: int = 1, tokens: int | None = None) -> Figure:
    """Seconds spent against tokens generated at one batch size: eager from zero, compiled
    from the compile time with a gentler slope; the lines cross at ``break_even_tokens``.
    ``tokens`` sets the x range (default: twice the break-even point). (Lesson 10.)"""
    even = break_even_tokens(compile_seconds, eager_step, compiled_step, batch)
    if tokens is None:
        tokens = 2 * even if math.isfinite(even) else 100_000
    xs = [0, tokens]
    fig = Figure(figsize=(7, 3.4), dpi=90, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(xs, [x / batch * eager_step for x in xs], color=EAGER_COLOUR, label="eager")
    ax.plot(xs, [compile_seconds + x / batch * compiled_step for x in xs], color=COMPILED_COLOUR,
            label="compiled (compile time first)")
    if math.isfinite(even) and even <= tokens:
        ax.axvline(even, color=PALETTE[7], lw=1, ls="--")
        ax.annotate(f"break-even: {even:,} tokens", (even, even / batch * eager_step),
                    xytext=(8, -16), textcoords="offset points")
    ax.set_xlabel(f"tokens generated (batch {batch})")
    ax.set_ylabel("seconds")
    ax.set_xlim(0, tokens)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return fig
