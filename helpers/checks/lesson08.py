"""Lesson 08's checks: the learner's chained block hashes and block manager.

``block_hashes`` is compared with the course's chain (``helpers.paged.block_hash`` from one
full block to the next) on prompts of whole and partial blocks, an empty one, two prompts that
differ only in their first block, and an adapter. The block manager (the lesson's ``Blocks``
class, whose ``allocate``, ``grow`` and ``free_request`` the learner writes) runs the same
operations as ``helpers.BlockManager``, side by side, and after every operation the two must
agree on everything they hold: block tables, reservations, reference counts, the free list and
its order, the names of the blocks and the cache of names.
"""

from __future__ import annotations

import math

from ..paged import BlockManager, PoolExhausted, block_hash
from .core import Hint, expect_equal, expect_unchanged, run_check

__all__ = ["check_block_hashes", "check_blocks", "course_block_hashes"]


# ---- block_hashes -------------------------------------------------------------------------

def course_block_hashes(token_ids, block_size, adapter=None):
    """The names of the full blocks of ``token_ids``, in order: each one a hash of its parent's
    name, its tokens and the adapter (``helpers.paged.block_hash``). A partial last block gets
    no name. (Lesson 08.)"""
    names, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], adapter)
        names.append(parent)
    return names


def _variants(token_ids, block_size, adapter):
    """What the usual mistakes give, each with the hint that names it."""
    full = len(token_ids) // block_size
    blocks = [token_ids[i * block_size:(i + 1) * block_size]
              for i in range(math.ceil(len(token_ids) / block_size))]

    def chain(chunks, adapter=adapter, chained=True):
        names, parent = [], None
        for chunk in chunks:
            name = block_hash(parent if chained else None, chunk, adapter)
            names.append(name)
            parent = name
        return names

    return [
        (chain(blocks[:full], chained=False),
         "each name covers only its own block's tokens: pass the previous block's name as "
         "the parent (None for the first block), so that equal names mean equal text from the "
         "very start of the prompt"),
        (chain(blocks),
         f"the last {len(token_ids) - full * block_size} token(s) are a partial block, and a "
         f"partial block gets no name (its tokens are not all there yet): name only the "
         f"{full} full block(s), len(token_ids) // block_size"),
        (chain(blocks[:full], adapter=None),
         f"the names ignore the adapter {adapter!r}: pass it to chain_hash (two adapters give "
         f"different keys and values for the same tokens)"),
        (chain([token_ids[i:i + block_size] for i in range(full)]),
         f"block i holds tokens i * block_size to (i + 1) * block_size - 1: your blocks "
         f"overlap (token_ids[i:i + block_size])"),
    ]


def _block_hash_cases(learner, cases):
    scenarios = [
        ("10 tokens in blocks of 4 (2 full blocks and 2 tokens more)", list(range(11, 21)), 4, None),
        ("8 tokens in blocks of 4 (exactly 2 full blocks)", [11, 12, 13, 14, 15, 16, 17, 18], 4, None),
        ("3 tokens in blocks of 4 (no full block)", [11, 12, 13], 4, None),
        ("an empty list", [], 4, None),
        ("the same second block after another first block", [19, 12, 13, 14, 15, 16, 17, 18], 4, None),
        ("blocks of 3 with an adapter", [5, 6, 7, 8, 9, 10, 11], 3, "entities"),
    ]
    for label, tokens, size, adapter in scenarios:
        with cases(label):
            expected = course_block_hashes(tokens, size, adapter)
            given = list(tokens)
            got = learner(given, size, adapter) if adapter else learner(given, size)
            expect_unchanged("token_ids", list(tokens), given)
            if not isinstance(got, list):
                raise Hint(f"block_hashes should return a list of names (strings), "
                           f"got {type(got).__name__}")
            if got == expected:
                continue
            for wrong, hint in _variants(tokens, size, adapter):
                if got == wrong:
                    raise Hint(hint)
            if len(got) != len(expected):
                raise Hint(f"got {len(got)} names for {len(tokens)} tokens in blocks of {size}, "
                           f"expected {len(expected)} (one per full block)")
            first = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
            raise Hint(f"block {first}'s name differs from the course's: it is chain_hash("
                       f"parent, the block's {size} tokens, adapter) with the parent being block "
                       f"{first - 1}'s name" if first else
                       f"block 0's name differs from the course's: it is chain_hash(None, "
                       f"token_ids[:{size}], adapter)")


def check_block_hashes(learner_block_hashes):
    """Lesson 08: check the learner's ``block_hashes(token_ids, block_size, adapter=None)``
    (the chained names of the full blocks) against the course's; print one line and return the
    function the rest of the lesson should use."""
    return run_check("block_hashes", learner_block_hashes, _block_hash_cases,
                     fallback=course_block_hashes)


# ---- the block manager --------------------------------------------------------------------

def _prefix(n, start=11):
    return list(range(start, start + n))


# (what the operation says in a hint, method, arguments). A request id is a letter.
GROWING = [
    ("allocate('A', a 6-token prompt, max_new_tokens=3)", "allocate", ("A", _prefix(6), 3)),
    ("grow('A', 6)", "grow", ("A", 6)),
    ("commit('A', 6 tokens)", "commit", ("A", _prefix(6))),
    ("grow('A', 7)", "grow", ("A", 7)),
    ("grow('A', 8)", "grow", ("A", 8)),
    ("commit('A', 8 tokens)", "commit", ("A", _prefix(8))),
    ("grow('A', 9)", "grow", ("A", 9)),
    ("free_request('A')", "free_request", ("A",)),
]

A, B = _prefix(8) + [21, 22], _prefix(8) + [31, 32, 33]
SHARING = [
    ("allocate('A', a 10-token prompt, max_new_tokens=3)", "allocate", ("A", A, 3)),
    ("grow('A', 10)", "grow", ("A", 10)),
    ("commit('A', 10 tokens)", "commit", ("A", A)),
    ("grow('A', 12)", "grow", ("A", 12)),
    ("commit('A', 12 tokens)", "commit", ("A", A + [23, 24])),
    ("allocate('B', an 11-token prompt that starts with A's 8 first tokens, max_new_tokens=2)",
     "allocate", ("B", B, 2)),
    ("grow('B', 11)", "grow", ("B", 11)),
    ("commit('B', 11 tokens)", "commit", ("B", B)),
    ("free_request('A') while B still shares blocks 0 and 1", "free_request", ("A",)),
    ("free_request('B')", "free_request", ("B",)),
    ("allocate('C', a prompt with A's 8 first tokens, after A and B ended)",
     "allocate", ("C", _prefix(8) + [41], 1)),
]

FULL_POOL = [
    ("allocate('A', an 8-token prompt, max_new_tokens=4)", "allocate", ("A", _prefix(8, 50), 4)),
    ("allocate('B', a 3-token prompt, max_new_tokens=2)", "allocate", ("B", _prefix(3, 70), 2)),
    ("allocate('B', a 3-token prompt, max_new_tokens=1)", "allocate", ("B", _prefix(3, 70), 1)),
    ("grow('A', 8)", "grow", ("A", 8)),
    ("grow('B', 3)", "grow", ("B", 3)),
]

REUSE = [
    ("allocate('A', an 8-token prompt, max_new_tokens=1)", "allocate", ("A", _prefix(8), 1)),
    ("grow('A', 8)", "grow", ("A", 8)),
    ("commit('A', 8 tokens)", "commit", ("A", _prefix(8))),
    ("free_request('A')", "free_request", ("A",)),
    ("allocate('B', A's 8 tokens and one more, max_new_tokens=8)", "allocate", ("B", _prefix(9), 8)),
    ("allocate('B', A's 8 tokens and one more, max_new_tokens=3)", "allocate", ("B", _prefix(9), 3)),
    ("free_request('B')", "free_request", ("B",)),
    ("allocate('C', another 6-token prompt, max_new_tokens=6)", "allocate", ("C", _prefix(6, 60), 6)),
    ("grow('C', 6)", "grow", ("C", 6)),
    ("grow('C', 9)", "grow", ("C", 9)),
    ("allocate('D', A's 8 tokens and one more, max_new_tokens=1)", "allocate", ("D", _prefix(9), 1)),
]

SCENARIOS = [
    ("a request that grows block by block, then ends (a pool of 4 blocks of 4)", 4, 4, GROWING),
    ("two requests that share a prefix (a pool of 8 blocks of 4)", 8, 4, SHARING),
    ("a full pool (4 blocks of 4)", 4, 4, FULL_POOL),
    ("freed cached blocks, found and then reused (4 blocks of 4)", 4, 4, REUSE),
]


BLOCK_CAUSES = {
    StopIteration: "the free list is empty: grow takes only blocks that allocate reserved, so "
                   "check allocate's count of blocks",
    KeyError: "allocate fills self.tables[rid] and self.reserved[rid], grow and commit read them, "
              "free_request removes both (once)",
    IndexError: "a block id or a table index out of range: block i of a table holds tokens "
                "i * block_size to (i + 1) * block_size - 1",
}


def _run(manager, method, args, op=None):
    """What the operation returned, or the PoolExhausted it raised. Another exception of the
    learner's class (``op`` given) becomes a Hint that names the operation."""
    try:
        result = getattr(manager, method)(*args)
    except PoolExhausted as refused:
        return refused
    except NotImplementedError:
        raise
    except Exception as error:
        if op is None:
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        cause = next((c for name, c in BLOCK_CAUSES.items() if isinstance(error, name)), None)
        raise Hint(f"{op} raised {type(error).__name__}: {message[:100]}"
                   + (f"; likely cause: {cause}" if cause else "")) from None
    return list(result) if method == "grow" and result is not None else result


def _state(manager) -> dict:
    return {"tables": {r: list(t) for r, t in manager.tables.items()},
            "reserved": dict(manager.reserved), "ref_counts": list(manager.ref_counts),
            "free": list(manager.free), "hashes": list(manager.hashes),
            "cached": dict(manager.cached), "hit_blocks": manager.hit_blocks}


def _holder(state, block):
    return next((r for r, table in state["tables"].items() if block in table), None)


def _compare(op, method, args, got, want, before, ref):
    """Raise a Hint at the first difference between the learner's manager (state ``got``)
    and the course's (``want``) after one operation; ``before`` is the course's state before it."""
    rid, size = args[0], ref.block_size
    if method == "allocate":
        prompt, new = args[1], args[2]
        total = math.ceil((len(prompt) + new) / size)
        if isinstance(want["result"], PoolExhausted) and not isinstance(got["result"], PoolExhausted):
            hits = ref.cached_prefix(prompt)
            free_hits = sum(before["ref_counts"][b] == 0 for b in hits)
            needed = total - len(hits) + free_hits
            cached = (f"; {free_hits} of them cached but free, and taking them shortens the "
                      f"free list too" if free_hits else "")
            raise Hint(f"{op}: it should refuse (PoolExhausted): the request needs {needed} "
                       f"free blocks ({len(prompt)} + {new} tokens: {total} blocks of "
                       f"{size}{cached}), but only "
                       f"{len(before['free']) - sum(before['reserved'].values())} free blocks "
                       f"are not promised to running requests (self.reserved)")
        if isinstance(got["result"], PoolExhausted) and not isinstance(want["result"], PoolExhausted):
            available = len(before["free"]) - sum(before["reserved"].values())
            raise Hint(f"{op}: it was refused, but the pool can promise what it needs ({available} "
                       f"free block(s) not promised to others): refuse only when the blocks "
                       f"needed are more than those available (>, not >=); count "
                       f"ceil((prompt + max_new_tokens) / block_size) blocks, less the cached ones")
        if isinstance(want["result"], PoolExhausted):
            for field in ("tables", "reserved", "ref_counts", "free"):
                if got[field] != before[field]:
                    raise Hint(f"{op} refused, as it should, but changed {field} first: check "
                               f"that the pool can promise the blocks before taking or reserving "
                               f"anything (a refused request must leave the pool as it was)")
        else:
            n_hits = want["result"] // size
            if got["result"] != want["result"]:
                raise Hint(f"{op} returned {got['result']!r}, expected {want['result']} "
                           f"(prompt tokens already computed: {n_hits} cached block(s) of "
                           f"{size}, found with self.cached_prefix)")
            g, w = got["reserved"].get(rid), want["reserved"][rid]
            if g != w:
                floor = (len(prompt) + new) // size - n_hits
                why = (f"{len(prompt)} + {new} tokens need ceil({len(prompt) + new} / {size}) = "
                       f"{total} blocks: round up, a partial block is a block" if g == floor else
                       f"the {n_hits} cached block(s) are already there: reserve only the other "
                       f"{w}" if g == total else
                       f"reserve ceil((prompt + max_new_tokens) / block_size) blocks less the "
                       f"cached ones ({total} - {n_hits})")
                raise Hint(f"after {op}, reserved[{rid!r}] is {g}, expected {w}: {why}")
    if method == "grow" and not isinstance(got["result"], list):
        raise Hint(f"{op} returned {type(got['result']).__name__}: grow should return the "
                   f"request's block table (the list self.tables[rid])")
    if method == "grow" and got["result"] != want["result"]:
        g, w = got["result"], want["result"]
        n_tokens = args[1]
        if len(g) > len(w):
            raise Hint(f"after {op} the table has {len(g)} blocks, expected {len(w)}: {n_tokens} "
                       f"tokens fit in {len(w)} block(s) of {size}; take a block only while "
                       f"len(table) * block_size < n_tokens")
        if len(g) < len(w):
            raise Hint(f"after {op} the table has {len(g)} block(s), room for {len(g) * size} "
                       f"tokens, expected {len(w)} blocks for {n_tokens} tokens")
        i = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
        raise Hint(f"{op} took block {g[i]}, expected block {w[i]}: take the block at the front "
                   f"of the free list, next(iter(self.free)) (the free list is {before['free']})")
    for field in ("tables", "reserved"):
        if got[field] != want[field]:
            extra = [r for r in got[field] if r not in want[field]]
            if method == "free_request" and extra:
                raise Hint(f"after {op}, {field} still holds {extra[0]!r}: free_request must "
                           f"remove the request's " + ("table" if field == "tables" else
                                                       "reservation (del self.reserved[rid])"))
            if method == "grow" and field == "reserved":
                raise Hint(f"after {op}, reserved is {got['reserved']}, expected "
                           f"{want['reserved']}: every block grow takes turns one block of the "
                           f"reservation into a real one (self.reserved[rid] -= 1)")
            expect_equal(f"after {op}, {field}", got[field], want[field])
    if got["ref_counts"] != want["ref_counts"]:
        b = next(i for i, (x, y) in enumerate(zip(got["ref_counts"], want["ref_counts"])) if x != y)
        g, w = got["ref_counts"][b], want["ref_counts"][b]
        if method == "allocate" and g < w:
            why = (f"block {b} comes from the cache: allocate must take() every cached block it "
                   f"reuses, so that its reference count counts this request too")
        elif method == "grow" and g < w:
            why = f"grow must take() the block it adds (its reference count becomes 1)"
        elif method == "free_request" and g > w:
            why = "free_request must drop one reference for every block in the request's table"
        elif method == "free_request" and g < w:
            why = (f"block {b} is still used by request {_holder(want, b)!r}: drop one "
                   f"reference per request, do not set the count to 0")
        else:
            why = "each request that uses a block counts once"
        raise Hint(f"after {op}, block {b}'s reference count is {g}, expected {w}: {why}")
    if got["free"] != want["free"]:
        wrong = [b for b in got["free"] if b not in want["free"]]
        missing = [b for b in want["free"] if b not in got["free"]]
        if wrong and want["ref_counts"][wrong[0]] > 0 and method == "free_request":
            raise Hint(f"after {op}, block {wrong[0]} is on the free list but request "
                       f"{_holder(want, wrong[0])!r} still uses it (reference count "
                       f"{want['ref_counts'][wrong[0]]}): a block is free only when its count "
                       f"drops to 0")
        if wrong and method == "allocate":
            raise Hint(f"after {op}, block {wrong[0]} is still on the free list although the "
                       f"request now uses it: take() it")
        if missing and method == "free_request":
            raise Hint(f"after {op}, block {missing[0]} has no reference left but is not on "
                       f"the free list: put it there when its count reaches 0")
        if sorted(got["free"]) == sorted(want["free"]):
            raise Hint(f"after {op}, the free list is {got['free']}, expected {want['free']} "
                       f"(same blocks, other order): a freed block its name still finds goes "
                       f"to the back, any other to the front; free the table first block first")
        expect_equal(f"after {op}, the free list", got["free"], want["free"])
    if got["cached"] != want["cached"] or got["hashes"] != want["hashes"]:
        stale = [name for name, b in got["cached"].items()
                 if name not in want["cached"] and b in (want["tables"].get(rid) or [])]
        if method == "grow" and stale:
            b = got["cached"][stale[0]]
            raise Hint(f"{op} handed out block {b} for new tokens, but the cache still finds it "
                       f"under its old name: self.evict(block) before taking a free block, or a "
                       f"later prompt would get someone else's keys and values")
        raise Hint(f"after {op}, the names of the blocks differ from the course's (got "
                   f"{len(got['cached'])} cached names, expected {len(want['cached'])})")
    expect_equal(f"after {op}, hit_blocks", got["hit_blocks"], want["hit_blocks"])


def _block_cases(learner_class, cases):
    for label, num_blocks, block_size, operations in SCENARIOS:
        with cases(label):
            ours, ref = learner_class(num_blocks, block_size), BlockManager(num_blocks, block_size)
            for op, method, args in operations:
                before = _state(ref)
                want = {"result": _run(ref, method, args), **_state(ref)}
                got = {"result": _run(ours, method, args, op), **_state(ours)}
                _compare(op, method, args, got, want, before, ref)




def check_blocks(learner_blocks):
    """Lesson 08: run the learner's ``Blocks`` class (its ``allocate``, ``grow`` and
    ``free_request``) side by side with ``helpers.BlockManager`` on four scenarios (growth,
    a shared prefix, a full pool, freed cached blocks found and then reused), comparing every
    table, reservation, reference count, the free list's order and the cached names after
    each operation; print one line and return the class the rest of the lesson should use."""
    return run_check("Blocks", learner_blocks, _block_cases, fallback=BlockManager,
                     kind="class")
