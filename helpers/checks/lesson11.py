"""Lesson 11's checks: the fused queries/keys/values cut per part, a rank's MLP with its one
all-reduce, and an embedding split by vocabulary.

Each case runs the learner's code as the lesson does. ``split_qkv`` is compared with
``helpers.sharding.split_qkv`` on the bundled model's ``c_attn`` for 1, 2 and 4 ranks, on small
layers of 6 heads over 3 ranks and in float16, must leave the weight and bias it is given as
they were (the lesson gives it the model's own), and must refuse a world size that does not
divide the heads even where it divides the width. ``ShardedMLP`` is built for every rank of 1,
2 and 4 (the bundled model's first MLP cut by the course's plan), each rank runs ``forward`` in
a thread of its own with a counting communicator, on a prompt and then on one more token with
the same layer (as decoding calls it), and every rank's output must equal the whole MLP's, after
exactly one all-reduce each time. ``embed_vocab_shard`` runs the same way on the bundled
model's embeddings split 2 and 3 ways (the last share shorter) and a small one split 4 ways,
with ids at both ends of every share; its rows must equal the embedding's exactly (the lesson
compares them with ``torch.equal``) and the ids it is given must come back unchanged (the
lesson gives every rank the same tensor). Results are compared in shape, dtype and device as
well as in value, on the model's device.
"""

from __future__ import annotations

import torch

from ..sharding import (LeftWaiting, ShardedMLP, ThreadGroup, embed_vocab_shard, run_in_threads,
                        split_columns, split_qkv, split_rows, vocab_shard)
from .core import (Hint, OnTheGpu, dtype_name, expect_device, expect_kind, expect_shape,
                   expect_unchanged, run_check)

__all__ = ["check_embed_vocab_shard", "check_sharded_mlp", "check_split_qkv"]


def _first_difference(got: torch.Tensor, expected: torch.Tensor, atol: float) -> str:
    bad = ~torch.isclose(got.detach().double().cpu(), expected.detach().double().cpu(),
                         atol=atol, rtol=1e-3)
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (f"at {index}: got {got[index].item():.4g}, expected {expected[index].item():.4g}")


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float) -> bool:
    return got.shape == expected.shape and torch.allclose(got.double(), expected.double(),
                                                          atol=atol, rtol=1e-3)


# ---- split_qkv ---------------------------------------------------------------------------------

def _qkv_variants(weight, bias, heads, rank, world_size):
    """What the usual mistakes give (weight, bias), each with the hint that names its cause."""
    hidden = weight.shape[1] // 3
    part = hidden // world_size
    head = hidden // heads
    mine = heads // world_size
    block = slice(rank * 3 * part, (rank + 1) * 3 * part)
    per_part = [slice(s + rank * part, s + (rank + 1) * part) for s in (0, hidden, 2 * hidden)]
    heads_of_rank = [rank + i * world_size for i in range(mine)]
    strided_w = torch.cat([weight[:, s + h * head:s + (h + 1) * head]
                           for s in (0, hidden, 2 * hidden) for h in heads_of_rank], 1)
    strided_b = torch.cat([bias[s + h * head:s + (h + 1) * head]
                           for s in (0, hidden, 2 * hidden) for h in heads_of_rank])
    right_weight = torch.cat([weight[:, c] for c in per_part], 1)
    right_bias = torch.cat([bias[c] for c in per_part])
    return [
        ((weight[:, block], bias[block]),
         "you cut c_attn's columns as one block, so rank 0 got all the queries and some of the "
         "keys: its columns are three parts, [queries | keys | values]; cut each part by heads "
         "and put the rank's three pieces side by side"),
        ((right_weight, bias[block]),
         "the weight is right but the bias was cut as one block: cut it like the columns, each "
         "of its three parts by heads"),
        ((strided_w, strided_b),
         f"rank {rank} got heads {rank}, {rank + world_size}, ... (one in every {world_size}): "
         f"a rank's heads are consecutive, columns rank × {part} to (rank + 1) × {part} of each "
         f"part"),
    ]


def _qkv_layer(hidden, heads, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(hidden, 3 * hidden, generator=generator).to(device=device, dtype=dtype)
    bias = torch.randn(3 * hidden, generator=generator).to(device=device, dtype=dtype)
    return weight, bias


def _split_qkv_cases(model):
    def cases(learner, cases):
        attn = model.transformer.h[0].attn
        weight, bias = attn.c_attn.weight.detach(), attn.c_attn.bias.detach()
        heads = model.config.num_attention_heads
        device = weight.device
        small = _qkv_layer(12, 6, torch.float32, device, 0)
        half = _qkv_layer(8, 4, torch.float16, device, 1)
        scenarios = [
            ("the bundled model's c_attn, 2 ranks, rank 0", weight, bias, heads, 0, 2),
            ("the bundled model's c_attn, 2 ranks, rank 1", weight, bias, heads, 1, 2),
            ("the bundled model's c_attn, 4 ranks, rank 2", weight, bias, heads, 2, 4),
            ("one rank: the whole layer", weight, bias, heads, 0, 1),
            ("6 heads of 2 over 3 ranks, rank 1", *small, 6, 1, 3),
            ("float16, 4 heads of 2 over 2 ranks, rank 1", *half, 4, 1, 2),
        ]
        for label, w, b, h, rank, world in scenarios:
            with cases(f"{label}: split_qkv(weight {tuple(w.shape)}, bias, {h}, {rank}, {world})"):
                expected_w, expected_b = split_qkv(w, b, h, rank, world)
                given_w, given_b = w.clone(), b.clone()
                got = learner(given_w, given_b, h, rank, world)
                if not (torch.equal(given_w, w) and torch.equal(given_b, b)):
                    raise Hint("it changed the weight or bias it was given: the lesson passes "
                               "the model's own c_attn, so the next rank would cut a changed "
                               "model; cut slices into new tensors (no copy_, slice assignment "
                               "or *_() on the inputs)")
                if not isinstance(got, (tuple, list)) or len(got) != 2:
                    raise Hint(f"return two tensors, (weight, bias); got {type(got).__name__}")
                got_w, got_b = got
                if not isinstance(got_w, torch.Tensor) or not isinstance(got_b, torch.Tensor):
                    raise Hint(f"return two tensors, (weight, bias); got "
                               f"({type(got_w).__name__}, {type(got_b).__name__})")
                hidden = w.shape[0]
                right_shape = tuple(got_w.shape) == tuple(expected_w.shape)
                if (not right_shape and got_w.dim() == 2 and got_w.shape[1] == w.shape[1]
                        and got_w.shape[0] < hidden):
                    raise Hint(f"the weight has shape {tuple(got_w.shape)}, expected "
                               f"{tuple(expected_w.shape)}: you cut the rows, dimension 0, as "
                               f"for an nn.Linear, whose weight is (out, in); GPT-2's c_attn is "
                               f"a Conv1D, whose weight is (in, out) = (hidden, 3 × hidden), so "
                               f"the queries, keys and values are its columns: cut dimension 1")
                if not right_shape and tuple(got_w.shape) == tuple(expected_w.shape)[::-1]:
                    raise Hint(f"the weight has shape {tuple(got_w.shape)}, expected "
                               f"{tuple(expected_w.shape)}: keep Conv1D's orientation, (in, "
                               f"out); do not transpose it")
                expect_shape("the weight", got_w, tuple(expected_w.shape),
                             ": (hidden, 3 × hidden / world_size)")
                if tuple(got_b.shape) == tuple(b.shape) and world > 1:
                    raise Hint(f"the bias has all {b.shape[0]} entries: cut it like the weight's "
                               f"columns, to {expected_b.shape[0]}")
                expect_shape("the bias", got_b, tuple(expected_b.shape),
                             ": 3 × hidden / world_size")
                expect_kind("the weight", got_w, w)
                expect_kind("the bias", got_b, b)
                if torch.equal(got_w, expected_w) and torch.equal(got_b, expected_b):
                    continue
                for (variant_w, variant_b), hint in _qkv_variants(w, b, h, rank, world):
                    if torch.equal(got_w, variant_w) and torch.equal(got_b, variant_b):
                        raise Hint(hint)
                if not torch.equal(got_w, expected_w):
                    raise Hint(f"the weight differs {_first_difference(got_w, expected_w, 0)}: "
                               f"rank {rank} should get columns rank × {w.shape[1] // 3 // world}"
                               f" onwards of the queries, of the keys and of the values")
                raise Hint(f"the bias differs {_first_difference(got_b, expected_b, 0)}: cut it "
                           f"exactly as the weight's columns")
        for label, w, b, h, world in [
                ("4 heads of 3 over 3 ranks (the width, 12, divides; the heads do not)",
                 *_qkv_layer(12, 4, torch.float32, device, 2), 4, 3),
                ("the bundled model over 8 ranks (4 heads)", weight, bias, heads, 8)]:
            with cases(f"{label}: split_qkv(..., {h}, 0, {world}) must raise ValueError"):
                try:
                    learner(w.clone(), b.clone(), h, 0, world)
                except ValueError:
                    continue
                except NotImplementedError:
                    raise
                except Exception as error:
                    raise Hint(f"it raised {type(error).__name__}, expected ValueError: refuse a "
                               f"world size that does not divide num_heads yourself, with a "
                               f"ValueError that says so") from None
                raise Hint(f"{h} heads cannot be shared by {world} ranks, yet nothing was "
                           f"refused: a rank must hold whole heads; raise ValueError when "
                           f"num_heads % world_size is not 0")
    return cases


def check_split_qkv(learner_split_qkv, model):
    """Lesson 11: check the learner's ``split_qkv(weight, bias, num_heads, rank, world_size)``
    against ``helpers.sharding.split_qkv`` (eight cases); print one line and return the
    function the rest of the lesson should use."""
    return run_check("split_qkv", learner_split_qkv, _split_qkv_cases(model), fallback=split_qkv,
                     causes={"mat1 and mat2": "Conv1D's weight is (in, out): x @ weight"}, gpu=True)


# ---- ShardedMLP.forward ------------------------------------------------------------------------

def _mlp_shards(mlp, rank, world_size):
    fc_weight, fc_bias = split_columns(mlp.c_fc.weight.detach(), mlp.c_fc.bias.detach(), rank,
                                       world_size)
    return (fc_weight, fc_bias, split_rows(mlp.c_proj.weight.detach(), rank, world_size),
            mlp.c_proj.bias.detach().clone())


def _run_mlp(cls, mlp, x, world_size, act, step):
    """Every rank's (output, all-reduces) for ``x``, then the same layer's (output,
    all-reduces) for ``step``, as a prompt and then a decode step use it; one thread per
    rank."""
    def rank_forward(rank, comm):
        layer = cls(*_mlp_shards(mlp, rank, world_size), act, comm)
        given = x.clone()
        with OnTheGpu():                      # x stands for a GPU's activations
            out = layer(given)
            calls = comm.counts().calls
            again = layer(step.clone())
        expect_unchanged("x", x, given)           # the residual stream adds it back
        return out, calls, again, comm.counts().calls - calls

    return _on_every_rank(world_size, rank_forward,
                          "every rank runs the same forward, with one all-reduce each")


def _on_every_rank(world_size: int, function, rule: str) -> list:
    """``function(rank, comm)`` on every rank, one thread each; a Hint ending with ``rule``
    when a rank waited for ever on an all-reduce the others never made."""
    try:
        return run_in_threads(ThreadGroup(world_size, timeout=10), function)
    except LeftWaiting:
        raise Hint(f"the ranks made different numbers of all-reduces, so one waited for ever: "
                   f"{rule}") from None


def _sharded_mlp_cases(model):
    def cases(learner_class, cases):
        mlp = model.transformer.h[0].mlp
        device = mlp.c_fc.weight.device
        generator = torch.Generator().manual_seed(0)
        hidden = model.config.hidden_size
        scenarios = [("one rank: the whole MLP", 1, (2, 3)), ("2 ranks, one token", 2, (1, 1)),
                     ("2 ranks, 2 prompts of 5 tokens", 2, (2, 5)),
                     ("4 ranks, 3 prompts of 4 tokens", 4, (3, 4))]
        for label, world, (batch, length) in scenarios:
            x = torch.randn(batch, length, hidden, generator=generator).to(device)
            step = torch.randn(batch, 1, hidden, generator=generator).to(device)
            with cases(f"{label}: x {tuple(x.shape)}, then a step {tuple(step.shape)}"):
                with torch.no_grad():
                    expected, expected_step = mlp(x), mlp(step)
                outputs = _run_mlp(learner_class, mlp, x, world, mlp.act, step)
                for rank, (out, calls, again, calls_again) in enumerate(outputs):
                    who = f"rank {rank} of {world}"
                    if calls == 0 and world > 1:
                        raise Hint(f"{who} made no all-reduce, so it holds only its own partial "
                                   f"sum: call self.comm.all_reduce on c_proj's partial product "
                                   f"(h @ self.proj_weight), then add the bias")
                    if calls > 1:
                        raise Hint(f"{who} made {calls} all-reduces in one forward, expected 1: "
                                   f"c_fc's columns need none (each rank's activations stay its "
                                   f"own); only c_proj's partial products are summed")
                    if calls == 0:
                        raise Hint("no all-reduce was made: with one rank it changes nothing, "
                                   "but with two it is what adds up the partial sums; call "
                                   "self.comm.all_reduce on c_proj's partial product")
                    if not isinstance(out, torch.Tensor):
                        raise Hint(f"forward should return a tensor, got {type(out).__name__}")
                    expect_shape(f"{who}'s output", out, tuple(x.shape),
                                 ": (batch, tokens, hidden), like its input")
                    expect_kind(f"{who}'s output", out, x)
                    expect_device(f"{who}'s output", out, x.device)
                    if _close(out, expected, 1e-4):
                        _second_forward(who, again, calls_again, expected_step)
                        continue
                    bias = mlp.c_proj.bias.detach()
                    if _close(out, expected + (world - 1) * bias, 1e-4):
                        raise Hint(f"{who}'s output has c_proj's bias {world} times: every rank "
                                   f"added it before the all-reduce, which sums the biases too; "
                                   f"add it once, after the all-reduce")
                    if _close(out, expected - bias, 1e-4):
                        raise Hint(f"{who}'s output lacks c_proj's bias: add self.proj_bias "
                                   f"after the all-reduce")
                    shards = _mlp_shards(mlp, 0, 1)
                    no_act = (x @ shards[0] + shards[1]) @ shards[2] + shards[3]
                    if _close(out, no_act, 1e-4):
                        raise Hint(f"{who}'s output is the MLP without its activation: apply "
                                   f"self.act to x @ self.fc_weight + self.fc_bias")
                    if world > 1:
                        fc_w, fc_b, proj_w, proj_b = _mlp_shards(mlp, rank, world)
                        with torch.no_grad():
                            own = mlp.act(x @ fc_w + fc_b) @ proj_w + proj_b
                        if _close(out, own, 1e-4):
                            raise Hint(f"{who}'s output is its own partial sum plus the bias: "
                                       f"its sum never reached the output. all_reduce sums in "
                                       f"place, into the tensor it is given: a copy of the "
                                       f"partial (.clone()) got the sum and was dropped; "
                                       f"all-reduce the partial itself")
                    raise Hint(f"{who}'s output differs from the whole MLP's "
                               f"{_first_difference(out, expected, 1e-4)}: each rank computes "
                               f"h = act(x @ fc_weight + fc_bias), its partial product h @ "
                               f"proj_weight, all-reduces that, then adds proj_bias once")
    return cases


def _second_forward(who, out, calls, expected):
    """A Hint unless the layer's second forward (a decode step after the prompt) is right
    too: generation calls every layer once a step."""
    if calls != 1:
        raise Hint(f"{who} made {calls} all-reduces in its second forward, expected 1 as in "
                   f"the first: every forward makes exactly one")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(expected.shape):
        raise Hint(f"{who}'s second forward (one new token after the prompt) returned "
                   f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                   f", expected shape {tuple(expected.shape)}")
    if not _close(out, expected, 1e-4):
        raise Hint(f"{who}'s first forward was right, its second (a decode step) differs "
                   f"{_first_difference(out, expected, 1e-4)}: forward changed the layer's "
                   f"own tensors (/=, += or *_() on self.proj_bias...); compute into new ones")


MLP_CAUSES = {
    "mat1 and mat2": "Conv1D-style weights are (in, out): compute x @ weight, not weight.T",
    "must match the size": "Conv1D-style weights are (in, out): compute x @ weight",
}


def check_sharded_mlp(learner_sharded_mlp, model):
    """Lesson 11: check the learner's ``ShardedMLP`` class (its ``forward``) on 1, 2 and 4
    ranks in threads against the bundled model's whole first MLP, a prompt and then one more
    token through the same layer, counting each rank's all-reduces; print one line and return
    the class the rest of the lesson should use."""
    return run_check("ShardedMLP", learner_sharded_mlp, _sharded_mlp_cases(model),
                     fallback=ShardedMLP, kind="class", causes=MLP_CAUSES)


# ---- embed_vocab_shard -------------------------------------------------------------------------

def _run_embedding(learner, ids, shards):
    def one(rank, comm):
        weight, start = shards[rank]
        given, given_weight = ids.clone(), weight.clone()
        out = learner(given, given_weight, start, comm)
        expect_unchanged("weight_shard", weight, given_weight)    # the model's own rows
        return out, comm.counts().calls, torch.equal(given, ids)

    return _on_every_rank(len(shards), one,
                          "every rank makes exactly one, whatever ids it holds")


def _embedding_cases(model):
    def cases(learner, cases):
        wte = model.transformer.wte.weight.detach()
        device = wte.device
        small = torch.arange(40.0, device=device).view(10, 4) + 1
        ids_small = torch.tensor([[0, 9, 3, 3, 5], [2, 6, 9, 0, 1]], device=device)
        scenarios = []
        for world in (2, 3):
            shards = [vocab_shard(wte, r, world) for r in range(world)]
            edges = sorted({s for _, s in shards} | {s - 1 for _, s in shards if s}
                           | {wte.shape[0] - 1})
            ids = torch.tensor([edges + [17, 17]], device=device)
            scenarios.append((f"the bundled model's {wte.shape[0]} embeddings over {world} ranks "
                              f"({', '.join(str(s.shape[0]) for s, _ in shards)} rows)",
                              wte, shards, ids))
        shards = [vocab_shard(small, r, 4) for r in range(4)]
        scenarios.append(("10 embeddings over 4 ranks (3, 3, 3 and 1 rows), 2 rows of ids",
                          small, shards, ids_small))
        half = small.half()
        scenarios.append(("float16, 10 embeddings over 2 ranks", half,
                          [vocab_shard(half, r, 2) for r in range(2)], ids_small))
        for label, weight, shards, ids in scenarios:
            with cases(label):
                expected = weight[ids]
                for rank, (out, calls, ids_kept) in enumerate(_run_embedding(learner, ids,
                                                                             shards)):
                    start, rows = shards[rank][1], shards[rank][0].shape[0]
                    who = f"rank {rank} (ids {start} to {start + rows - 1})"
                    if not ids_kept:
                        raise Hint(f"{who} changed the ids it was given (ids -= start?): "
                                   f"the lesson hands every rank the same ids, so the others "
                                   f"would look up shifted ones; compute ids - start into a "
                                   f"new tensor")
                    if calls == 0:
                        raise Hint(f"{who} made no all-reduce: each rank holds the rows of its "
                                   f"own ids only; all-reduce the rows it looked up (zeros for "
                                   f"the others) so that every rank has every id's row")
                    if calls > 1:
                        raise Hint(f"{who} made {calls} all-reduces, expected 1: one sum of "
                                   f"the ranks' pieces is the whole embedding")
                    if not isinstance(out, torch.Tensor):
                        raise Hint(f"return a tensor, got {type(out).__name__}")
                    expect_shape(f"{who}'s result", out, tuple(expected.shape),
                                 ": (ids' shape, hidden)")
                    if out.dtype != weight.dtype and out.dtype == torch.promote_types(
                            out.dtype, weight.dtype) and weight.is_floating_point():
                        raise Hint(f"{who}'s result holds {dtype_name(out.dtype)}, the "
                                   f"embedding {dtype_name(weight.dtype)}: a mask in another "
                                   f"dtype (.float()) multiplied the rows and promoted them; "
                                   f"give the mask the rows' dtype, mine.to(weight_shard.dtype), "
                                   f"or zero the other ids' rows with torch.where / masked_fill")
                    expect_kind(f"{who}'s result", out, weight)
                    expect_device(f"{who}'s result", out, weight.device)
                    if torch.equal(out, expected):
                        continue
                    wrong = (out.double() - expected.double()).abs().sum(-1) > 0
                    bad_id = int(ids[tuple(wrong.nonzero()[0].tolist())])
                    if torch.allclose(out.double(), expected.double()):
                        place = tuple(int(i) for i in (out != expected).nonzero()[0])
                        raise Hint(f"the row of token id {bad_id} is close but not equal "
                                   f"(got {out[place].item():.8g}, expected "
                                   f"{expected[place].item():.8g}): a lookup copies rows "
                                   f"exactly, and the lesson compares them with torch.equal; "
                                   f"do no arithmetic on them but the mask")
                    raise Hint(_embedding_hint(weight, shards, ids, out, bad_id, rank))
    return cases


def _embedding_hint(weight, shards, ids, out, bad_id, rank) -> str:
    """Name the usual cause of a wrong embedding on ``rank``."""
    def summed(piece):
        return sum(piece(w, s) for w, s in shards).double()

    def unmasked(w, s):                  # the offset, clamped, but no mask
        return w[(ids - s).clamp(0, w.shape[0] - 1)]

    def no_offset(w, s):                 # the mask, but ids not shifted by start
        mine = (ids >= s) & (ids < s + w.shape[0])
        return w[ids.clamp(0, w.shape[0] - 1)] * mine.unsqueeze(-1).to(w.dtype)

    def inclusive(w, s):                 # the mask's upper end included
        mine = (ids >= s) & (ids <= s + w.shape[0])
        return w[(ids - s).clamp(0, w.shape[0] - 1)] * mine.unsqueeze(-1).to(w.dtype)

    def masked(w, s):                    # the right piece of one rank
        mine = (ids >= s) & (ids < s + w.shape[0])
        return w[(ids - s).clamp(0, w.shape[0] - 1)] * mine.unsqueeze(-1).to(w.dtype)

    if len(shards) > 1 and torch.equal(out, masked(*shards[rank])):
        return (f"the result is this rank's own rows alone: the sum never reached it. "
                f"all_reduce sums in place, into the tensor it is given: a copy of the rows "
                f"(.clone()) got the sum and was dropped; all-reduce the rows themselves")
    if torch.allclose(out.double(), summed(inclusive)):
        return (f"token id {bad_id} got rows from several ranks: it is the first id of the next "
                f"rank's share, and the mask took it too; a rank holds ids start to start + "
                f"len(weight_shard) - 1 (ids < start + len(weight_shard), not <=)")
    if torch.allclose(out.double(), summed(unmasked)):
        return (f"token id {bad_id} got rows from several ranks: a rank must write zeros for "
                f"the ids it does not hold (mask = (ids >= start) & (ids < start + rows)), so "
                f"that the all-reduce adds exactly one row per id")
    if torch.allclose(out.double(), summed(no_offset)):
        return (f"token id {bad_id} got another token's row: a rank holds the rows of ids start "
                f"onwards, so its row for id i is weight_shard[i - start]")
    return (f"the row of token id {bad_id} is wrong: look up weight_shard[ids - start] for the "
            f"ids start <= id < start + len(weight_shard), zeros for the others, then one "
            f"all-reduce")


EMBEDDING_CAUSES = {
    "out of bounds": "this rank holds only rows start to start + len(weight_shard) - 1: look "
                     "up ids - start, and only for the ids it holds (zeros for the others)",
    "index out of range": "this rank holds only rows start to start + len(weight_shard) - 1: "
                          "look up ids - start, and only for the ids it holds",
    "must match the size": "the mask has one value a token and the rows one a hidden unit: "
                           "give it a last dimension (mask.unsqueeze(-1))",
}


def check_embed_vocab_shard(learner_embed_vocab_shard, model):
    """Lesson 11: check the learner's ``embed_vocab_shard(ids, weight_shard, start, comm)`` on
    embeddings split 2, 3 and 4 ways, every rank in a thread, against the whole embedding;
    print one line and return the function the rest of the lesson should use."""
    return run_check("embed_vocab_shard", learner_embed_vocab_shard, _embedding_cases(model),
                     fallback=embed_vocab_shard, causes=EMBEDDING_CAUSES, gpu=True)

