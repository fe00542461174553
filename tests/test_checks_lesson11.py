"""Lesson 11's checks pass the course's code, say "not written yet" for a stub, and catch the
mistakes learners make when they split a model: the Conv1D orientation, the fused queries,
keys and values cut as one block, a bias added on every rank, an all-reduce missing or
doubled, a vocabulary split without masking, inputs or weights changed in place; each with a
hint that names the cause."""

import pytest
import torch

from helpers.checks import check_embed_vocab_shard, check_sharded_mlp, check_split_qkv
from helpers.sharding import (ShardedMLP, SimulatedTP, embed_vocab_shard, split_qkv,
                              run_in_threads, ThreadGroup, vocab_shard)
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(bundled):
    return bundled[0]


# ---- split_qkv: the lesson's solution and typical mistakes -------------------------------------

def lesson_split_qkv(weight, bias, num_heads, rank, world_size):          # as in the lesson
    if num_heads % world_size:
        raise ValueError(f"{world_size} ranks cannot share {num_heads} heads")
    hidden = weight.shape[1] // 3
    part = hidden // world_size
    columns = [slice(start + rank * part, start + (rank + 1) * part)
               for start in (0, hidden, 2 * hidden)]
    return (torch.cat([weight[:, c] for c in columns], dim=1),
            torch.cat([bias[c] for c in columns]))


def with_chunks(weight, bias, num_heads, rank, world_size):                # also right
    if num_heads % world_size:
        raise ValueError("heads")
    parts = [p.chunk(world_size, dim=1)[rank] for p in weight.chunk(3, dim=1)]
    biases = [b.chunk(world_size)[rank] for b in bias.chunk(3)]
    return torch.cat(parts, dim=1), torch.cat(biases)


def rows_cut(weight, bias, num_heads, rank, world_size):                   # nn.Linear habit
    if num_heads % world_size:
        raise ValueError("heads")
    part = weight.shape[0] // world_size
    return weight[rank * part:(rank + 1) * part], bias


def parts_cut_along_the_rows(weight, bias, num_heads, rank, world_size):   # nn.Linear's layout
    if num_heads % world_size:
        raise ValueError("heads")
    part = weight.shape[0] // 3 // world_size
    pieces = [weight[s + rank * part:s + (rank + 1) * part]
              for s in range(0, 3 * (weight.shape[0] // 3), weight.shape[0] // 3)]
    cols = bias.shape[0] // 3 // world_size
    return torch.cat(pieces), torch.cat([bias[s + rank * cols:s + (rank + 1) * cols]
                                         for s in range(0, bias.shape[0], bias.shape[0] // 3)])


def one_block(weight, bias, num_heads, rank, world_size):
    if num_heads % world_size:
        raise ValueError("heads")
    return weight.chunk(world_size, dim=1)[rank], bias.chunk(world_size)[rank]


def bias_as_one_block(weight, bias, num_heads, rank, world_size):
    w, _ = lesson_split_qkv(weight, bias, num_heads, rank, world_size)
    return w, bias.chunk(world_size)[rank]


def bias_whole(weight, bias, num_heads, rank, world_size):
    w, _ = lesson_split_qkv(weight, bias, num_heads, rank, world_size)
    return w, bias


def strided_heads(weight, bias, num_heads, rank, world_size):
    if num_heads % world_size:
        raise ValueError("heads")
    hidden = weight.shape[1] // 3
    head = hidden // num_heads
    mine = [rank + i * world_size for i in range(num_heads // world_size)]
    pieces = [weight[:, s + h * head:s + (h + 1) * head] for s in (0, hidden, 2 * hidden)
              for h in mine]
    biases = [bias[s + h * head:s + (h + 1) * head] for s in (0, hidden, 2 * hidden) for h in mine]
    return torch.cat(pieces, dim=1), torch.cat(biases)


def no_head_check(weight, bias, num_heads, rank, world_size):
    hidden = weight.shape[1] // 3
    if hidden % world_size:
        raise ValueError("width")
    part = hidden // world_size
    columns = [slice(s + rank * part, s + (rank + 1) * part) for s in (0, hidden, 2 * hidden)]
    return torch.cat([weight[:, c] for c in columns], 1), torch.cat([bias[c] for c in columns])


def transposed(weight, bias, num_heads, rank, world_size):
    w, b = lesson_split_qkv(weight, bias, num_heads, rank, world_size)
    return w.T.contiguous(), b


def as_float32(weight, bias, num_heads, rank, world_size):
    w, b = lesson_split_qkv(weight, bias, num_heads, rank, world_size)
    return w.float(), b.float()


def assertion_instead(weight, bias, num_heads, rank, world_size):
    assert num_heads % world_size == 0
    return lesson_split_qkv(weight, bias, 4 * world_size, rank, world_size)


def a_list_of_three(weight, bias, num_heads, rank, world_size):
    w, b = lesson_split_qkv(weight, bias, num_heads, rank, world_size)
    return [w, b, None]


def regrouping_in_place(weight, bias, num_heads, rank, world_size):
    """Every rank's columns made one block, in the weight itself, then one block cut: right
    pieces, but the model's own c_attn is scrambled for the next rank and later cells."""
    if num_heads % world_size:
        raise ValueError("heads")
    hidden = weight.shape[1] // 3
    part = hidden // world_size
    order = torch.cat([torch.arange(s + r * part, s + (r + 1) * part, device=weight.device)
                       for r in range(world_size) for s in (0, hidden, 2 * hidden)])
    weight.copy_(weight[:, order])
    bias.copy_(bias[order])
    mine = slice(rank * 3 * part, (rank + 1) * 3 * part)
    return weight[:, mine].clone(), bias[mine].clone()


QKV_MISTAKES = {
    rows_cut: "a Conv1D, whose weight is (in, out)",
    parts_cut_along_the_rows: "you cut the rows, dimension 0, as for an nn.Linear",
    one_block: "cut c_attn's columns as one block",
    bias_as_one_block: "the bias was cut as one block",
    bias_whole: "cut it like the weight's columns",
    strided_heads: "a rank's heads are consecutive",
    no_head_check: "raise ValueError when num_heads % world_size",
    transposed: "do not transpose it",
    as_float32: "keep the dtype",
    assertion_instead: "raised AssertionError, expected ValueError",
    a_list_of_three: "return two tensors",
    regrouping_in_place: "it changed the weight or bias it was given",
}


def test_split_qkv_check_passes_the_course_functions(model):
    assert_passes(check_split_qkv, lesson_split_qkv, model)
    assert_passes(check_split_qkv, with_chunks, model)
    assert_passes(check_split_qkv, split_qkv, model)


def test_split_qkv_check_says_not_written_for_a_stub(model):
    assert_not_written(check_split_qkv, model, fallback=split_qkv)


@pytest.mark.parametrize("mistake", QKV_MISTAKES, ids=lambda f: f.__name__)
def test_split_qkv_check_catches(mistake, model):
    assert_caught(check_split_qkv, mistake, model, symptom=QKV_MISTAKES[mistake],
                  fallback=split_qkv)


# ---- ShardedMLP.forward: the lesson's solution and typical mistakes ---------------------------

class LessonMLP(ShardedMLP):                                                # as in the lesson
    def forward(self, x):
        h = self.act(x @ self.fc_weight + self.fc_bias)
        partial = h @ self.proj_weight
        self.comm.all_reduce(partial)
        return partial + self.proj_bias


class ReturningTheSum(ShardedMLP):                                          # also right
    def forward(self, x):
        h = self.act(x @ self.fc_weight + self.fc_bias)
        return self.comm.all_reduce(h @ self.proj_weight) + self.proj_bias


class NoAllReduce(ShardedMLP):
    def forward(self, x):
        return self.act(x @ self.fc_weight + self.fc_bias) @ self.proj_weight + self.proj_bias


class TwoAllReduces(ShardedMLP):
    def forward(self, x):
        h = self.comm.all_reduce(x @ self.fc_weight + self.fc_bias)
        partial = self.act(h) @ self.proj_weight
        return self.comm.all_reduce(partial) + self.proj_bias


class BiasOnEveryRank(ShardedMLP):
    def forward(self, x):
        h = self.act(x @ self.fc_weight + self.fc_bias)
        return self.comm.all_reduce(h @ self.proj_weight + self.proj_bias)


class NoBias(ShardedMLP):
    def forward(self, x):
        h = self.act(x @ self.fc_weight + self.fc_bias)
        return self.comm.all_reduce(h @ self.proj_weight)


class NoActivation(ShardedMLP):
    def forward(self, x):
        h = x @ self.fc_weight + self.fc_bias
        return self.comm.all_reduce(h @ self.proj_weight) + self.proj_bias


class ReduceBeforeActivation(ShardedMLP):          # the sum of c_fc's pieces: wrong shape
    def forward(self, x):
        h = x @ self.fc_weight + self.fc_bias
        self.comm.all_reduce(h)
        return self.act(h) @ self.proj_weight + self.proj_bias


class LinearHabit(ShardedMLP):                     # weights used as nn.Linear's (out, in)
    def forward(self, x):
        h = self.act(x @ self.fc_weight.T + self.fc_bias)
        return self.comm.all_reduce(h @ self.proj_weight.T) + self.proj_bias


class SumDiscarded(ShardedMLP):
    def forward(self, x):
        h = self.act(x @ self.fc_weight + self.fc_bias)
        partial = h @ self.proj_weight
        self.comm.all_reduce(partial.clone())
        return partial + self.proj_bias


class OnlyRankZeroReduces(ShardedMLP):
    def forward(self, x):
        partial = self.act(x @ self.fc_weight + self.fc_bias) @ self.proj_weight
        if self.comm.rank == 0:
            self.comm.all_reduce(partial)
        return partial + self.proj_bias


class Float64(ShardedMLP):
    def forward(self, x):
        h = self.act(x.double() @ self.fc_weight.double() + self.fc_bias.double())
        partial = h @ self.proj_weight.double()
        return self.comm.all_reduce(partial) + self.proj_bias.double()


class BiasDividedInPlace(ShardedMLP):        # right once; the bias shrinks at every call
    def forward(self, x):
        self.proj_bias /= self.comm.world_size
        h = self.act(x @ self.fc_weight + self.fc_bias)
        return self.comm.all_reduce(h @ self.proj_weight + self.proj_bias)


class Stub(ShardedMLP):
    def forward(self, x):
        raise NotImplementedError()


MLP_MISTAKES = {
    NoAllReduce: "no all-reduce",
    TwoAllReduces: "made 2 all-reduces in one forward, expected 1",
    BiasOnEveryRank: "added it before the all-reduce",
    NoBias: "lacks c_proj's bias",
    NoActivation: "without its activation",
    ReduceBeforeActivation: "its partial product h @ proj_weight, all-reduces that",
    LinearHabit: "(in, out)",
    SumDiscarded: "its sum never reached the output",
    OnlyRankZeroReduces: "different numbers of all-reduces",
    Float64: "keep the dtype",
    BiasDividedInPlace: "its second (a decode step) differs",
}


def test_sharded_mlp_check_passes_the_course_classes(model):
    assert_passes(check_sharded_mlp, LessonMLP, model)
    assert_passes(check_sharded_mlp, ReturningTheSum, model)
    assert_passes(check_sharded_mlp, ShardedMLP, model)


def test_sharded_mlp_check_says_not_written_for_a_stub(model):
    line, returned = run(check_sharded_mlp, Stub, model)
    assert "not written yet" in line and returned is ShardedMLP


@pytest.mark.parametrize("mistake", MLP_MISTAKES, ids=lambda c: c.__name__)
def test_sharded_mlp_check_catches(mistake, model):
    assert_caught(check_sharded_mlp, mistake, model, symptom=MLP_MISTAKES[mistake],
                  fallback=ShardedMLP)


def test_a_passing_mlp_gives_lesson_01s_tokens_in_the_sharded_model(bundled):
    """What the lesson does next with the class the check returned."""
    model, tokenizer = bundled
    from helpers import generate_with_cache
    ids = tokenizer("What comes up must", return_tensors="pt").input_ids
    tp = SimulatedTP(model, 2, split_qkv=lesson_split_qkv, mlp_class=LessonMLP)
    assert tp.generate(ids, 12).tokens[0] == generate_with_cache(
        model, tokenizer, "What comes up must", 12, stop_at_eos=False).token_ids


# ---- embed_vocab_shard: the lesson's solution and typical mistakes -----------------------------

def lesson_embed(ids, weight_shard, start, comm):                          # as in the lesson
    mine = (ids >= start) & (ids < start + weight_shard.shape[0])
    rows = weight_shard[torch.where(mine, ids - start, 0)]
    rows = rows * mine.unsqueeze(-1)
    comm.all_reduce(rows)
    return rows


def with_masked_fill(ids, weight_shard, start, comm):                      # also right
    mine = (ids >= start) & (ids < start + len(weight_shard))
    rows = weight_shard[(ids - start).clamp(0, len(weight_shard) - 1)]
    return comm.all_reduce(rows.masked_fill(~mine.unsqueeze(-1), 0))


def reducing_a_copy(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids < start + weight_shard.shape[0])
    rows = weight_shard[torch.where(mine, ids - start, 0)] * mine.unsqueeze(-1)
    comm.all_reduce(rows.clone())                   # the sum goes into the copy
    return rows


def no_mask_no_offset(ids, weight_shard, start, comm):
    return comm.all_reduce(weight_shard[ids])


def offset_without_mask(ids, weight_shard, start, comm):
    rows = weight_shard[(ids - start).clamp(0, len(weight_shard) - 1)]
    return comm.all_reduce(rows)


def mask_without_offset(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids < start + len(weight_shard))
    rows = weight_shard[ids.clamp(0, len(weight_shard) - 1)] * mine.unsqueeze(-1)
    return comm.all_reduce(rows)


def no_reduce(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids < start + len(weight_shard))
    return weight_shard[torch.where(mine, ids - start, 0)] * mine.unsqueeze(-1)


def reduce_twice(ids, weight_shard, start, comm):
    return comm.all_reduce(lesson_embed(ids, weight_shard, start, comm))


def off_by_one(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids <= start + len(weight_shard))
    local = (ids - start).clamp(0, len(weight_shard) - 1)
    return comm.all_reduce(weight_shard[local] * mine.unsqueeze(-1))


def float_mask(ids, weight_shard, start, comm):      # a float32 mask makes float16 rows float32
    mine = ((ids >= start) & (ids < start + len(weight_shard))).float()
    rows = weight_shard[torch.where(mine.bool(), ids - start, 0)] * mine.unsqueeze(-1)
    return comm.all_reduce(rows)


def mask_without_a_hidden_dimension(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids < start + len(weight_shard))
    rows = weight_shard[torch.where(mine, ids - start, 0)]
    return comm.all_reduce(rows * mine.to(rows.dtype))              # (.., hidden) * (..)


def only_this_ranks_rows(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids < start + len(weight_shard))
    comm.all_reduce(torch.zeros(1))
    return weight_shard[(ids - start)[mine]]


def shifting_ids_in_place(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids < start + len(weight_shard))
    ids -= start                                       # the other ranks' ids too, in the lesson
    rows = weight_shard[torch.where(mine, ids, 0)] * mine.unsqueeze(-1)
    return comm.all_reduce(rows)


def rows_scaled_a_little(ids, weight_shard, start, comm):
    """One part in a million off: close, but the lesson compares with torch.equal."""
    return lesson_embed(ids, weight_shard, start, comm) * (1 + 2 ** -20)


EMBED_MISTAKES = {
    no_mask_no_offset: "look up ids - start, and only for the ids it holds",
    offset_without_mask: "got rows from several ranks",
    mask_without_offset: "its row for id i is weight_shard[i - start]",
    no_reduce: "made no all-reduce",
    reduce_twice: "made 2 all-reduces, expected 1",
    off_by_one: "not <=",
    float_mask: "give the mask the rows' dtype",
    reducing_a_copy: "the sum never reached it",
    mask_without_a_hidden_dimension: "mask.unsqueeze(-1)",
    only_this_ranks_rows: "has shape",
    shifting_ids_in_place: "changed the ids it was given",
    rows_scaled_a_little: "close but not equal",
}


def test_embedding_check_passes_the_course_functions(model):
    assert_passes(check_embed_vocab_shard, lesson_embed, model)
    assert_passes(check_embed_vocab_shard, with_masked_fill, model)
    assert_passes(check_embed_vocab_shard, embed_vocab_shard, model)


def test_embedding_check_says_not_written_for_a_stub(model):
    assert_not_written(check_embed_vocab_shard, model, fallback=embed_vocab_shard)


@pytest.mark.parametrize("mistake", EMBED_MISTAKES, ids=lambda f: f.__name__)
def test_embedding_check_catches(mistake, model):
    assert_caught(check_embed_vocab_shard, mistake, model, symptom=EMBED_MISTAKES[mistake],
                  fallback=embed_vocab_shard)


def test_a_passing_embedding_gives_the_whole_embedding(model):
    """What the lesson does next with the function the check returned."""
    wte = model.transformer.wte.weight.detach()
    ids = torch.tensor([[5, 470, 471, 472, 942]])
    shards = [vocab_shard(wte, r, 2) for r in range(2)]
    out = run_in_threads(ThreadGroup(2), lambda r, comm: lesson_embed(ids, *shards[r], comm))
    assert all(torch.equal(rows, wte[ids]) for rows in out)


# ---- a tensor made on the CPU, which a GPU refuses --------------------------------------------

def columns_picked_by_a_cpu_index(weight, bias, num_heads, rank, world_size):
    """index_select with an index made by torch.arange, on the CPU: on a GPU it cannot pick
    from the weight's columns."""
    if num_heads % world_size:
        raise ValueError("heads")
    hidden = weight.shape[1] // 3
    part = hidden // world_size
    index = torch.cat([torch.arange(s + rank * part, s + (rank + 1) * part)
                       for s in (0, hidden, 2 * hidden)])
    return weight.index_select(1, index), bias.index_select(0, index)


class SumIntoCpuZeros(ShardedMLP):
    """The partial sum gathered into zeros made on the CPU."""
    def forward(self, x):
        h = self.act(x @ self.fc_weight + self.fc_bias)
        partial = torch.zeros(*x.shape[:-1], self.proj_weight.shape[1], dtype=x.dtype)
        partial += h @ self.proj_weight
        self.comm.all_reduce(partial)
        return partial + self.proj_bias


def zeros_made_on_the_cpu(ids, weight_shard, start, comm):
    mine = (ids >= start) & (ids < start + len(weight_shard))
    local = torch.where(mine, ids - start, torch.zeros(ids.shape, dtype=ids.dtype))
    rows = weight_shard[local] * mine.unsqueeze(-1).to(weight_shard.dtype)
    return comm.all_reduce(rows)


EXERCISES = [
    Exercise("split_qkv", check_split_qkv, ("model",), split_qkv,
             right=[lesson_split_qkv, with_chunks],
             wrong={**QKV_MISTAKES,
                    columns_picked_by_a_cpu_index: "a tensor made on the CPU met one on the GPU"}),
    Exercise("ShardedMLP", check_sharded_mlp, ("model",), ShardedMLP,
             right=[LessonMLP, ReturningTheSum],
             wrong={**MLP_MISTAKES, SumIntoCpuZeros: "a tensor made on the CPU met one on the GPU"}),
    Exercise("embed_vocab_shard", check_embed_vocab_shard, ("model",), embed_vocab_shard,
             right=[lesson_embed, with_masked_fill],
             wrong={**EMBED_MISTAKES,
                    zeros_made_on_the_cpu: "a tensor made on the CPU met one on the GPU"}),
]
