"""Lesson 11's tensor parallelism (helpers.sharding): the splits equal the whole, the sharded
model writes lesson 01's tokens in threads and in processes, the all-reduces and the bytes are
exactly what the plan says, and rank processes never hang or outlive their notebook."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from helpers import generate_with_cache
from helpers.models import BUNDLED_MODEL_DIR
from helpers.sharding import (LLAMA2_70B_SHAPE, LINKS, CommCounts, GroupBroken, RankDied,
                              SimulatedTP, ThreadGroup, allreduce_bytes_per_step,
                              allreduce_seconds, check_world_size, embed_vocab_shard, gpt2_plan,
                              greedy_decode, load_shard, pipeline_generate, pipeline_schedule,
                              run_in_threads, shard_model,
                              split_columns, split_qkv, split_rows, stage_blocks, start_ranks,
                              tp_decode_step, vocab_shard, weight_bytes, weight_bytes_per_rank)
from tests.conftest import COURSE_PROMPTS, process_gone

pytestmark = pytest.mark.usefixtures("one_thread")

WHOLE_BYTES = 13_865_984          # the bundled model's weights, float32 (its model card)


_LESSON01 = {}


def lesson01_tokens(model, tokenizer, prompt, n):
    """Lesson 01's greedy tokens (the loop with the cache), computed once per prompt."""
    if (prompt, n) not in _LESSON01:
        _LESSON01[prompt, n] = generate_with_cache(model, tokenizer, prompt, n,
                                                   stop_at_eos=False).token_ids
    return _LESSON01[prompt, n]


def ids_of(tokenizer, prompt):
    return tokenizer(prompt, return_tensors="pt").input_ids


# ---- the splits ---------------------------------------------------------------------------

def test_conv1d_is_x_times_w_with_w_stored_in_out():
    layer = Conv1D(nf=6, nx=4)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 4)
    assert layer.weight.shape == (4, 6)                  # (in, out): nn.Linear's transposed
    assert torch.allclose(layer(x), x @ layer.weight + layer.bias, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_and_row_splits_of_a_conv1d_equal_the_whole(bundled, world_size):
    model, _ = bundled
    fc = model.transformer.h[0].mlp.c_fc                  # (256, 1024)
    proj = model.transformer.h[0].mlp.c_proj              # (1024, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        columns = [split_columns(fc.weight, fc.bias, r, world_size) for r in range(world_size)]
        assert all(w.shape == (256, 1024 // world_size) for w, _ in columns)
        by_columns = torch.cat([x @ w + b for w, b in columns], dim=1)
        assert torch.allclose(by_columns, fc(x), atol=1e-5)
        h = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
        rows = [split_rows(proj.weight, r, world_size) for r in range(world_size)]
        assert all(w.shape == (1024 // world_size, 256) for w in rows)
        part = 1024 // world_size
        by_rows = sum(h[:, r * part:(r + 1) * part] @ w for r, w in enumerate(rows)) + proj.bias
        assert torch.allclose(by_rows, proj(h), atol=1e-5)
        # the bias added on every rank is wrong by (world_size - 1) biases
        every = sum(h[:, r * part:(r + 1) * part] @ w + proj.bias for r, w in enumerate(rows))
        assert not torch.allclose(every, proj(h), atol=1e-3)


def test_split_pieces_are_copies_that_hold_only_their_share(bundled):
    model, _ = bundled
    weight = model.transformer.h[0].mlp.c_fc.weight
    piece, _ = split_columns(weight, None, 1, 4)
    assert piece.is_contiguous() and piece.untyped_storage().nbytes() == piece.nbytes
    assert piece.data_ptr() != weight.data_ptr()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_split_qkv_gives_each_rank_the_queries_keys_and_values_of_its_heads(bundled, world_size):
    model, _ = bundled
    attn = model.transformer.h[1].attn
    heads, hidden = 4, 256
    head = hidden // heads
    mine = heads // world_size
    for rank in range(world_size):
        weight, bias = split_qkv(attn.c_attn.weight, attn.c_attn.bias, heads, rank, world_size)
        assert weight.shape == (hidden, 3 * hidden // world_size)
        assert bias.shape == (3 * hidden // world_size,)
        for part in range(3):                              # queries, keys, values
            first = part * hidden + rank * mine * head
            expected = attn.c_attn.weight[:, first:first + mine * head]
            got = weight[:, part * mine * head:(part + 1) * mine * head]
            assert torch.equal(got, expected)
            assert torch.equal(bias[part * mine * head:(part + 1) * mine * head],
                               attn.c_attn.bias[first:first + mine * head])


@pytest.mark.parametrize("world_size, what", [(3, "4 attention heads"), (8, "4 attention heads"),
                                              (0, "at least 1")])
def test_a_world_size_that_does_not_divide_the_heads_is_refused(bundled, world_size, what):
    model, _ = bundled
    with pytest.raises(ValueError, match=what):
        check_world_size(model.config, world_size)
    with pytest.raises(ValueError, match=what):
        SimulatedTP(model, world_size)


def test_a_world_size_that_does_not_divide_the_mlp_width_is_refused(bundled):
    model, _ = bundled
    config = model.config.__class__(**{**model.config.to_dict(), "n_inner": 1022})
    with pytest.raises(ValueError, match="MLP's width of 1022"):
        check_world_size(config, 4)
    check_world_size(config, 2)


def test_split_qkv_refuses_a_world_size_that_splits_a_head(bundled):
    model, _ = bundled
    attn = model.transformer.h[0].attn
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        split_qkv(attn.c_attn.weight, attn.c_attn.bias, 4, 0, 8)


# ---- simulated ranks -------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_simulated_tensor_parallelism_writes_lesson_01s_tokens(bundled, world_size):
    model, tokenizer = bundled
    tp = SimulatedTP(model, world_size)
    for prompt in COURSE_PROMPTS:
        run = tp.generate(ids_of(tokenizer, prompt), 24)
        assert run.tokens[0] == lesson01_tokens(model, tokenizer, prompt, 24), prompt


@pytest.mark.parametrize("world_size, batch", [(2, 1), (2, 3), (4, 2)])
def test_all_reduces_and_bytes_per_step_are_exact(bundled, world_size, batch):
    model, tokenizer = bundled
    tp = SimulatedTP(model, world_size)
    prompt = ids_of(tokenizer, "Jack and Jill").repeat(batch, 1)          # 3 tokens a row
    run = tp.generate(prompt, 6)
    layers, hidden = 4, 256
    assert run.step_comm[0].calls == 2 * layers                           # the prefill
    assert run.step_comm[0].bytes == 2 * layers * batch * 3 * hidden * 4
    per_step = run.comm_per_decode_step()
    assert (per_step.calls, per_step.bytes) == (2 * layers, 2 * layers * batch * hidden * 4)
    assert per_step.bytes == allreduce_bytes_per_step(model.config, batch)
    assert all((c.calls, c.bytes) == (per_step.calls, per_step.bytes) for c in run.step_comm[1:])
    assert [c.counts().calls for c in tp.comms] == [6 * 2 * layers] * world_size


@pytest.mark.parametrize("world_size, expected", [(1, WHOLE_BYTES), (2, 7_560_192),
                                                  (4, 4_407_296)])
def test_bytes_of_weights_per_rank_are_exact(bundled, world_size, expected):
    model, _ = bundled
    assert weight_bytes(model) == WHOLE_BYTES
    assert weight_bytes_per_rank(model.config, world_size) == expected
    assert SimulatedTP(model, world_size).weight_bytes() == [expected] * world_size
    shard, read = load_shard(BUNDLED_MODEL_DIR, world_size - 1, world_size,
                             ThreadGroup(world_size).communicator(world_size - 1))
    assert weight_bytes(shard) == read == expected          # it read its share, nothing more


@pytest.mark.parametrize("rank", [0, 1])
def test_load_shard_reads_what_shard_model_cuts(bundled, rank):
    model, _ = bundled
    comm = ThreadGroup(2).communicator(rank)
    cut = dict(shard_model(model, rank, 2, comm).named_parameters())
    read = dict(load_shard(BUNDLED_MODEL_DIR, rank, 2, comm)[0].named_parameters())
    assert cut.keys() == read.keys()
    for name in cut:
        assert torch.equal(cut[name], read[name]), name


def test_the_plan_lists_every_split_weight_with_its_shape(bundled):
    model, _ = bundled
    plan = {w.name: w for w in gpt2_plan(model.config, 2)}
    assert plan["attn.c_attn.weight"].shard == (256, 384)
    assert plan["attn.c_proj.weight"].shard == (128, 256)
    assert plan["mlp.c_fc.weight"].shard == (256, 512)
    assert plan["mlp.c_proj.weight"].shard == (512, 256)
    assert plan["mlp.c_proj.bias"].kind == "whole"
    norms = plan["ln_1, ln_2 (weight, bias each)"]       # two norms, each a weight and a bias
    assert norms.kind == "whole" and norms.whole == norms.shard == (4, 256)


def test_the_kv_cache_of_a_rank_holds_its_heads_only(bundled):
    model, tokenizer = bundled
    tp = SimulatedTP(model, 2)
    caches = tp.run(lambda rank, m, comm: m(ids_of(tokenizer, "Jack and Jill")).past_key_values)
    whole = model(ids_of(tokenizer, "Jack and Jill"), use_cache=True).past_key_values
    assert caches[0].layers[0][0].shape == (1, 2, 3, 64)
    assert torch.allclose(torch.cat([c.layers[2][0] for c in caches], dim=1),
                          whole.layers[2].keys, atol=1e-5)


def test_a_rank_that_stops_calling_all_reduce_breaks_the_group_at_once():
    group = ThreadGroup(2, timeout=30)

    def uneven(rank, comm):
        for _ in range(2 if rank == 0 else 1):
            comm.all_reduce(torch.ones(3))

    start = time.monotonic()
    with pytest.raises(GroupBroken, match="rank 0 waits in all-reduce number 2, but rank 1 "
                                          "finished after 1 all-reduces"):
        run_in_threads(group, uneven)
    assert time.monotonic() - start < 5

    def raising(rank, comm):
        if rank == 1:
            raise NotImplementedError()
        comm.all_reduce(torch.ones(3))

    with pytest.raises(NotImplementedError):               # the cause, not the waiting rank
        run_in_threads(group, raising)

    def shapes(rank, comm):
        comm.all_reduce(torch.ones(3 + rank))

    with pytest.raises(GroupBroken, match="different shapes"):
        run_in_threads(group, shapes)
    assert run_in_threads(group, lambda rank, comm: comm.all_reduce(
        torch.ones(2) * (rank + 1)).tolist()) == [[3.0, 3.0], [3.0, 3.0]]


def test_a_communicator_switched_off_keeps_each_ranks_partial_sum():
    group = ThreadGroup(1)
    comm = group.communicator(0)
    comm.enabled = False
    x = torch.ones(4)
    assert torch.equal(comm.all_reduce(x), torch.ones(4))
    assert comm.counts() == CommCounts(1, 16, comm.counts().seconds)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_vocabulary_split_with_masking_gives_the_whole_embedding(bundled, world_size):
    model, tokenizer = bundled
    wte = model.transformer.wte.weight.detach()
    ids = ids_of(tokenizer, "Humpty Dumpty sat on a wall")
    ids = torch.cat([ids, torch.tensor([[0, 942]])], dim=1)           # the first and last ids
    shards = [vocab_shard(wte, r, world_size) for r in range(world_size)]
    assert sum(s.shape[0] for s, _ in shards) == 943
    out = run_in_threads(ThreadGroup(world_size),
                         lambda rank, comm: embed_vocab_shard(ids, *shards[rank], comm))
    for rows in out:
        assert torch.equal(rows, wte[ids])


# ---- the pipeline and the cost model ---------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2, 4])
def test_a_pipeline_writes_the_same_tokens_and_sends_one_hidden_vector_a_token(bundled, stages):
    model, tokenizer = bundled
    whole = shard_model(model, 0, 1, ThreadGroup(1).communicator(0))
    prompts = ["Jack and Jill", "Humpty Dumpty sat"]
    run = pipeline_generate(whole, [ids_of(tokenizer, p) for p in prompts], 10, stages=stages)
    for prompt, tokens in zip(prompts, run.tokens):
        assert tokens[0] == lesson01_tokens(model, tokenizer, prompt, 10)
    tokens_in = sum(len(ids_of(tokenizer, p)[0]) + 9 for p in prompts)    # prompt + 9 steps
    assert run.forward_bytes == (stages - 1) * tokens_in * 256 * 4
    assert run.back_bytes == 2 * 9 * 8                                     # int64 tokens back
    assert [len(r) for r in stage_blocks(4, stages)] == [4 // stages] * stages
    assert 0 <= run.idle_share() < 1


def test_the_cost_model_is_the_ring_formula():
    nvlink = LINKS[0]
    assert allreduce_seconds(1e6, 1, nvlink) == 0.0
    assert allreduce_seconds(1e6, 4, nvlink) == pytest.approx(
        nvlink.latency + 2 * 3 / 4 * 1e6 / nvlink.bandwidth)
    one = tp_decode_step(LLAMA2_70B_SHAPE, 1, nvlink)
    two = tp_decode_step(LLAMA2_70B_SHAPE, 2, nvlink)
    assert not one.fits and two.fits                      # 140 GB of fp16 weights, 80 GB GPUs
    assert two.weights == pytest.approx(70e9 * 2 / 2 / 3.35e12)
    assert two.comm == pytest.approx(2 * 80 * (nvlink.latency + 8192 * 2 / nvlink.bandwidth))
    slow = tp_decode_step(LLAMA2_70B_SHAPE, 8, LINKS[2])
    assert slow.comm > tp_decode_step(LLAMA2_70B_SHAPE, 8, nvlink).comm
    with pytest.raises(ValueError):
        allreduce_seconds(10, 0, nvlink)


# ---- ranks as processes (gloo) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks():
    group = start_ranks(2, backend="gloo", name="tests")
    yield group
    group.stop()


def test_processes_write_lesson_01s_tokens(bundled, two_ranks):
    model, tokenizer = bundled
    assert two_ranks.backend == "gloo"
    for prompt in COURSE_PROMPTS[:3]:
        run = two_ranks.generate(ids_of(tokenizer, prompt), 24)
        assert run.tokens[0] == lesson01_tokens(model, tokenizer, prompt, 24), prompt


def test_processes_count_all_reduces_and_bytes_exactly(bundled, two_ranks):
    model, tokenizer = bundled
    batch = ids_of(tokenizer, "Jack and Jill").repeat(4, 1)
    run = two_ranks.generate(batch, 5)
    step = run.comm_per_decode_step()
    assert (step.calls, step.bytes) == (8, allreduce_bytes_per_step(model.config, 4))
    assert step.seconds > 0
    fox = "The quick brown fox jumped over the"
    wrong = two_ranks.generate(ids_of(tokenizer, fox), 20, communicate=False)  # partial sums
    assert wrong.comm_per_decode_step().calls == 8
    assert wrong.tokens[0] != lesson01_tokens(model, tokenizer, fox, 20)


def test_processes_hold_and_read_exactly_their_share(two_ranks):
    for ready in two_ranks.ready:
        assert ready["weight_bytes"] == ready["bytes_read"] == 7_560_192
    memory = two_ranks.memory()
    assert [m["weight_bytes"] for m in memory] == [7_560_192, 7_560_192]
    assert all(m["rss_bytes"] > m["weight_bytes"] for m in memory)
    assert len(two_ranks.allreduce_seconds(256, repeats=5)) == 5


def test_two_sharded_models_at_once_and_a_rank_that_dies(bundled, two_ranks):
    """A second group runs beside the first (its own store file, no port to share); then one of
    its ranks is killed: the next call fails within seconds naming it, and no process stays."""
    model, tokenizer = bundled
    other = start_ranks(2, backend="gloo", name="tests-other")
    try:
        assert other.store != two_ranks.store
        for group in (two_ranks, other):
            run = group.generate(ids_of(tokenizer, "Humpty Dumpty sat"), 12)
            assert run.tokens[0] == lesson01_tokens(model, tokenizer, "Humpty Dumpty sat", 12)
        os.kill(other.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankDied, match=r"rank 1 of 2 died \(killed by SIGKILL\)"):
            other.generate(ids_of(tokenizer, "Jack and Jill"), 12)
        assert time.monotonic() - start < 5
        assert all(process_gone(pid, 10.0) for pid in other.pids)
        with pytest.raises(RuntimeError, match="this group was stopped because rank 1 of 2 "
                                               "died"):            # the group stays stopped
            other.generate(ids_of(tokenizer, "Jack and Jill"), 2)
        assert two_ranks.running                           # the first group is untouched
    finally:
        other.stop()
    assert not other.running


@pytest.mark.parametrize("arguments, message", [
    ({"world_size": 3}, "does not divide the 4 attention heads"),
    ({"world_size": 2, "threads": 0}, "threads must be a positive integer, got 0")])
def test_a_world_size_or_threads_that_start_ranks_refuses_start_no_process(arguments, message):
    before = set(os.listdir("/proc")) if os.path.isdir("/proc") else set()
    with pytest.raises(ValueError, match=message):
        start_ranks(backend="gloo", name="tests-refused", **arguments)
    if before:
        children = [p for p in set(os.listdir("/proc")) - before if p.isdigit()]
        assert not any("helpers.sharding.worker" in open(f"/proc/{p}/cmdline").read()
                       for p in children if os.path.exists(f"/proc/{p}/cmdline"))


def cpu_ticks(pid: int) -> int:
    """The processor time process ``pid`` has used, in clock ticks (user and system)."""
    with open(f"/proc/{pid}/stat") as stat:
        return sum(map(int, stat.read().rsplit(")", 1)[1].split()[11:13]))


def interrupt_mid_call(group) -> threading.Event:
    """SIGINT to this process and to the group's ranks once rank 0 has worked 0.1 s more (its
    heartbeat alone takes far less): the notebook's Interrupt button in the middle of a call
    (it signals the kernel's whole process group). Set the event returned to call it off."""
    start, called_off = cpu_ticks(group.pids[0]), threading.Event()

    def watch():
        while cpu_ticks(group.pids[0]) < start + os.sysconf("SC_CLK_TCK") // 10:
            if called_off.wait(0.01):
                return
        for pid in [*group.pids, os.getpid()]:
            os.kill(pid, signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()
    return called_off


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see a rank at work")
def test_an_interrupted_call_leaves_the_group_usable_and_the_next_answer_its_own(bundled,
                                                                               two_ranks):
    model, tokenizer = bundled
    called_off = interrupt_mid_call(two_ranks)
    try:
        with pytest.raises(KeyboardInterrupt):
            two_ranks.generate(ids_of(tokenizer, "Jack and Jill").repeat(8, 1), 200)
    finally:
        called_off.set()
    run = two_ranks.generate(ids_of(tokenizer, "Humpty Dumpty sat"), 5)  # not the 8 x 200 above
    assert run.tokens == [lesson01_tokens(model, tokenizer, "Humpty Dumpty sat", 5)]
    assert [m["weight_bytes"] for m in two_ranks.memory()] == [7_560_192] * 2
    assert two_ranks.running


def test_a_bad_argument_to_generate_is_named_in_the_notebook_and_the_group_goes_on(bundled,
                                                                                 two_ranks):
    model, tokenizer = bundled
    jack = ids_of(tokenizer, "Jack and Jill")                             # 3 tokens
    for input_ids, new_tokens, named in [
            ([], 3, r"input_ids must be a non-empty \(batch, length\)"),
            (jack[0].tolist(), 3, r"input_ids .* got shape \(3,\)"),
            ([[5, 6], [7]], 3, "input_ids must be rows of token ids of equal length"),
            (jack.float(), 3, "input_ids must hold integer token ids"),
            ([[5, 943]], 3, "input_ids holds 943: the model's token ids go from 0 to 942"),
            ([[-1, 5]], 3, "input_ids holds -1"),
            (jack, 0, "new_tokens must be a positive integer, got 0"),
            (jack, -2, "new_tokens must be a positive integer, got -2"),
            (jack, 2.5, "new_tokens must be a positive integer, got 2.5"),
            (jack, "3", "new_tokens must be a positive integer, got '3'"),
            (jack, 255, "the model has 256: at most 254 new tokens")]:
        with pytest.raises(ValueError, match=named):
            two_ranks.generate(input_ids, new_tokens)
    with pytest.raises(ValueError, match="communicate must be True or False"):
        two_ranks.generate(jack, 3, communicate="no")
    run = two_ranks.generate(jack, 5)                                     # nothing was sent
    assert run.tokens == [lesson01_tokens(model, tokenizer, "Jack and Jill", 5)]
    whole, _ = load_shard(BUNDLED_MODEL_DIR, 0, 1, ThreadGroup(1).communicator(0))
    assert len(greedy_decode(whole, jack, 254).tokens[0]) == 254          # the last position


def test_a_hung_rank_is_named_long_before_the_timeout(bundled):
    _, tokenizer = bundled
    group = start_ranks(2, backend="gloo", name="tests-hung")
    try:
        os.kill(group.pids[1], signal.SIGSTOP)     # rank 1 hangs; rank 0 waits in an all-reduce
        with pytest.raises(TimeoutError, match=r"^rank 1 of 2 stopped answering while "
                                               r"generating: no sign of life for 10 s"):
            group.generate(ids_of(tokenizer, "Jack and Jill"), 3)          # timeout: 120 s
        assert all(process_gone(pid, 10.0) for pid in group.pids)
    finally:
        group.stop()


def test_a_call_on_a_stopped_group_says_it_was_stopped(bundled):
    _, tokenizer = bundled
    group = start_ranks(2, backend="gloo", name="tests-stopped", wait=False)
    group.stop()
    with pytest.raises(RuntimeError, match=r"^this group was stopped: start a new one"):
        group.generate(ids_of(tokenizer, "Jack and Jill"), 3)


@pytest.mark.skipif(os.name != "posix", reason="folders name their notebook's pid on POSIX")
def test_the_next_start_removes_the_folder_of_ranks_killed_with_their_notebook():
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()                                   # a notebook process that is gone
    stale = Path(tempfile.mkdtemp(prefix=f"helpers-ranks-{ended.pid}-"))
    (stale / "rank0.log").write_text("the kernel was killed with its ranks\n")
    alive = Path(tempfile.mkdtemp(prefix=f"helpers-ranks-{os.getpid()}-"))   # a live one's
    try:
        group = start_ranks(2, backend="gloo", name="tests-stale", wait=False)
        group.stop()
        assert not stale.exists() and alive.exists()
    finally:
        for folder in (stale, alive):
            shutil.rmtree(folder, ignore_errors=True)


DRIVER = """
import os, time
from helpers.sharding import start_ranks
group = start_ranks(2, backend="gloo", name="driver")
child = os.fork()
if child == 0:                 # a child of the notebook's that keeps the ranks' pipes open
    time.sleep(60)
    os._exit(0)
print(group.workdir, child, *group.pids, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the ranks exit")
def test_ranks_end_with_their_notebook_even_if_a_child_holds_their_pipes():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                              env=env)
    pids = []
    try:
        workdir, *pids = driver.stdout.readline().split()
        child, ranks = int(pids[0]), [int(p) for p in pids[1:]]
        assert len(ranks) == 2 and Path(workdir).is_dir()
        driver.kill()                                       # the kernel is killed
        driver.wait()
        assert all(process_gone(pid, 10.0) for pid in ranks), "a rank outlived its notebook"
        assert not process_gone(child, 0.1)                 # though the child holds the pipes
        assert not Path(workdir).exists()                   # and the ranks removed the folder
    finally:
        driver.kill()
        for pid in map(int, pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the ranks exit")
def test_killing_the_notebook_kernel_stops_its_ranks():
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=90)
    try:
        out = []
        reply = client.execute_interactive(
            "from helpers.sharding import start_ranks\n"
            "group = start_ranks(2, backend='gloo')\nprint(group.workdir, *group.pids)",
            timeout=120, output_hook=lambda m: out.append(m["content"].get("text", ""))
            if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", out
        workdir, *pids = "".join(out).split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and not any(process_gone(p, 0.5) for p in pids)
        os.kill(manager.provisioner.process.pid, signal.SIGKILL)
        assert all(process_gone(pid, 10.0) for pid in pids), "a rank outlived its kernel"
        assert not Path(workdir).exists(), "the kernel's ranks left their folder"
    finally:
        client.stop_channels()
        if manager.is_alive():
            manager.shutdown_kernel(now=True)


@pytest.mark.parametrize("stages, micro_batches, idle", [(2, 1, 0.5), (4, 1, 0.75),
                                                         (4, 2, 33 / 65), (2, 2, 1 / 33)])
def test_the_pipeline_schedule_shows_the_bubble(stages, micro_batches, idle):
    schedule = pipeline_schedule(stages, micro_batches, 16)
    assert schedule.idle_share() == pytest.approx(idle)
    for stage in schedule.busy:                       # one piece at a time on each stage
        assert all(a[1] <= b[0] for a, b in zip(stage, stage[1:]))
    assert len(schedule.busy[0]) == micro_batches * 16


def test_a_runs_fastest_step_and_its_all_reduces():
    from helpers.sharding import Decoded
    run = Decoded([[1, 2, 3]], [0.5, 0.03, 0.01, 0.02],
                  [CommCounts(8, 10, 0.1), CommCounts(8, 10, 0.02), CommCounts(8, 10, 0.004),
                   CommCounts(8, 10, 0.01)])
    assert run.fastest_step() == (0.01, 0.004)             # the prefill (step 0) left out
    assert run.median_step() == 0.02
    with pytest.raises(ValueError, match="at least 2 new tokens"):
        Decoded([[1]], [0.5], [CommCounts()]).fastest_step()
