"""Lesson 08's checks pass the course's code, say "not written yet" for a stub, and catch the
mistakes learners make in the chained block hashes and in the block manager (allocate, grow,
free_request), each with a hint at its symptom."""

import math
import time
from collections import OrderedDict

import pytest

from helpers import BlockManager, PoolExhausted
from helpers.paged import block_hash
from helpers.checks import check_block_hashes, check_blocks
from helpers.checks.lesson08 import course_block_hashes
from tests.answers import Exercise
from tests.checking import assert_caught, assert_not_written, assert_passes


# ---- block_hashes: the lesson's solution and typical mistakes ---------------------------------

def block_hashes(token_ids, block_size, adapter=None):       # as in the lesson
    names, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], adapter)
        names.append(parent)
    return names


def hashes_without_parent(token_ids, block_size, adapter=None):
    return [block_hash(None, token_ids[i * block_size:(i + 1) * block_size], adapter)
            for i in range(len(token_ids) // block_size)]


def hashes_of_partial_blocks(token_ids, block_size, adapter=None):
    names, parent = [], None
    for i in range(math.ceil(len(token_ids) / block_size)):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], adapter)
        names.append(parent)
    return names


def hashes_without_adapter(token_ids, block_size, adapter=None):
    return block_hashes(token_ids, block_size)


def hashes_of_overlapping_blocks(token_ids, block_size, adapter=None):
    names, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i:i + block_size], adapter)
        names.append(parent)
    return names


def hashes_as_a_tuple(token_ids, block_size, adapter=None):
    return tuple(block_hashes(token_ids, block_size, adapter))


def hashes_eating_the_list(token_ids, block_size, adapter=None):
    names, parent = [], None
    while len(token_ids) >= block_size:
        parent = block_hash(parent, token_ids[:block_size], adapter)
        names.append(parent)
        del token_ids[:block_size]                      # the caller's list shrinks
    return names


def hashes_with_a_while_loop(token_ids, block_size, adapter=None):
    """Right, written another way: a start index that moves a block at a time."""
    names, start = [], 0
    while start + block_size <= len(token_ids):
        names.append(block_hash(names[-1] if names else None,
                                token_ids[start:start + block_size], adapter))
        start += block_size
    return names


HASH_MISTAKES = {
    hashes_without_parent: "pass the previous block's name as the parent",
    hashes_of_partial_blocks: "a partial block gets no name",
    hashes_without_adapter: "the names ignore the adapter 'entities'",
    hashes_of_overlapping_blocks: "your blocks overlap",
    hashes_as_a_tuple: "should return a list of names",
    hashes_eating_the_list: "changed its input token_ids in place",
}


# ---- Blocks: the lesson's class and typical mistakes ------------------------------------------

class Blocks:
    """The lesson's block manager, solutions filled in."""

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.hashes = [None] * num_blocks
        self.cached = {}
        self.free = OrderedDict.fromkeys(range(num_blocks))
        self.tables, self.reserved, self.hit_blocks = {}, {}, 0

    def cached_prefix(self, prompt_ids):
        hits = []
        for name in block_hashes(prompt_ids[:-1], self.block_size):
            if name not in self.cached:
                break
            hits.append(self.cached[name])
        return hits

    def take(self, block):
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1
        return block

    def evict(self, block):
        if self.cached.get(self.hashes[block]) == block:
            del self.cached[self.hashes[block]]
        self.hashes[block] = None

    def commit(self, rid, token_ids):
        for block, name in zip(self.tables[rid], block_hashes(token_ids, self.block_size)):
            if self.hashes[block] is None:
                self.hashes[block] = name
                self.cached.setdefault(name, block)

    def blocks_needed(self, prompt_ids, max_new_tokens, hits):
        return math.ceil((len(prompt_ids) + max_new_tokens) / self.block_size) - len(hits)

    def can_promise(self, needed, hits):
        free_hits = sum(self.ref_counts[b] == 0 for b in hits)
        return needed + free_hits <= len(self.free) - sum(self.reserved.values())

    def allocate(self, rid, prompt_ids, max_new_tokens):
        hits = self.cached_prefix(prompt_ids)
        needed = self.blocks_needed(prompt_ids, max_new_tokens, hits)
        if not self.can_promise(needed, hits):
            raise PoolExhausted(f"request {rid}: not enough free blocks")
        self.tables[rid] = [self.take(b) for b in hits]
        self.reserved[rid] = needed
        self.hit_blocks += len(hits)
        return len(hits) * self.block_size

    def grow(self, rid, n_tokens):
        table = self.tables[rid]
        while len(table) * self.block_size < n_tokens:
            self.reserved[rid] -= 1
            block = next(iter(self.free))
            self.evict(block)
            table.append(self.take(block))
        return table

    def free_request(self, rid):
        for block in self.tables.pop(rid):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.cached.get(self.hashes[block]) != block:
                    self.free.move_to_end(block, last=False)
        del self.reserved[rid]


class FloorBlockCount(Blocks):
    def blocks_needed(self, prompt_ids, max_new_tokens, hits):
        return (len(prompt_ids) + max_new_tokens) // self.block_size - len(hits)


class NotSubtractingHits(Blocks):
    def blocks_needed(self, prompt_ids, max_new_tokens, hits):
        return math.ceil((len(prompt_ids) + max_new_tokens) / self.block_size)


class IgnoringReservations(Blocks):
    def can_promise(self, needed, hits):
        return needed + sum(self.ref_counts[b] == 0 for b in hits) <= len(self.free)


class ForgettingFreeHits(Blocks):
    def can_promise(self, needed, hits):
        return needed <= len(self.free) - sum(self.reserved.values())


class RefusingAtTheEdge(Blocks):
    def can_promise(self, needed, hits):
        free_hits = sum(self.ref_counts[b] == 0 for b in hits)
        return needed + free_hits < len(self.free) - sum(self.reserved.values())


class NotTakingCachedBlocks(Blocks):
    def allocate(self, rid, prompt_ids, max_new_tokens):
        hits = self.cached_prefix(prompt_ids)
        needed = self.blocks_needed(prompt_ids, max_new_tokens, hits)
        if not self.can_promise(needed, hits):
            raise PoolExhausted(f"request {rid}: not enough free blocks")
        self.tables[rid] = list(hits)                     # shared, but not counted
        self.reserved[rid] = needed
        self.hit_blocks += len(hits)
        return len(hits) * self.block_size


class GrowingOneBlockTooMany(Blocks):
    def grow(self, rid, n_tokens):
        table = self.tables[rid]
        while len(table) * self.block_size <= n_tokens:
            self.reserved[rid] -= 1
            block = next(iter(self.free))
            self.evict(block)
            table.append(self.take(block))
        return table


class GrowingWithoutReturningTheTable(Blocks):
    def grow(self, rid, n_tokens):
        super().grow(rid, n_tokens)


class GrowingWithoutEviction(Blocks):
    def grow(self, rid, n_tokens):
        table = self.tables[rid]
        while len(table) * self.block_size < n_tokens:
            self.reserved[rid] -= 1
            table.append(self.take(next(iter(self.free))))
        return table


class GrowingFromTheBack(Blocks):
    def grow(self, rid, n_tokens):
        table = self.tables[rid]
        while len(table) * self.block_size < n_tokens:
            self.reserved[rid] -= 1
            block = next(reversed(self.free))             # the most recently freed
            self.evict(block)
            table.append(self.take(block))
        return table


class FreeingSharedBlocks(Blocks):
    def free_request(self, rid):
        for block in self.tables.pop(rid):
            self.ref_counts[block] = max(self.ref_counts[block] - 1, 0)
            self.free[block] = None                       # free, even if someone else uses it
            if self.cached.get(self.hashes[block]) != block:
                self.free.move_to_end(block, last=False)
        del self.reserved[rid]


class ZeroingRefCounts(Blocks):
    def free_request(self, rid):
        for block in self.tables.pop(rid):
            self.ref_counts[block] = 0
            self.free[block] = None
            if self.cached.get(self.hashes[block]) != block:
                self.free.move_to_end(block, last=False)
        del self.reserved[rid]


class FreeingAllToTheBack(Blocks):
    def free_request(self, rid):
        for block in self.tables.pop(rid):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        del self.reserved[rid]


class KeepingTheReservation(Blocks):
    def free_request(self, rid):
        for block in self.tables.pop(rid):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.cached.get(self.hashes[block]) != block:
                    self.free.move_to_end(block, last=False)


BLOCK_MISTAKES = {
    FloorBlockCount: "round up, a partial block is a block",
    NotSubtractingHits: "reserve only the other",
    IgnoringReservations: "not promised to running requests",
    ForgettingFreeHits: "cached but free",
    RefusingAtTheEdge: "(>, not >=)",
    NotTakingCachedBlocks: "allocate must take() every cached block",
    GrowingOneBlockTooMany: "take a block only while len(table) * block_size < n_tokens",
    GrowingWithoutEviction: "still finds it under its old name",
    GrowingWithoutReturningTheTable: "grow should return the request's block table",
    GrowingFromTheBack: "take the block at the front of the free list",
    FreeingSharedBlocks: "still uses it",
    ZeroingRefCounts: "do not set the count to 0",
    FreeingAllToTheBack: "any other to the front",
    KeepingTheReservation: "del self.reserved[rid]",
}


# ---- the tests -------------------------------------------------------------------------------

def test_the_reference_hashes_are_the_block_managers():
    manager = BlockManager(num_blocks=4, block_size=4)
    manager.allocate("A", list(range(10)), 2)
    manager.grow("A", 10)
    manager.commit("A", list(range(10)))
    assert [manager.hashes[b] for b in manager.tables["A"][:2]] == course_block_hashes(list(range(10)), 4)


def test_hash_check_passes_the_course_function():
    assert_passes(check_block_hashes, block_hashes)
    assert_passes(check_block_hashes, course_block_hashes)
    assert_passes(check_block_hashes, hashes_with_a_while_loop)


def test_hash_check_says_not_written_for_a_stub():
    assert_not_written(check_block_hashes, fallback=course_block_hashes)


@pytest.mark.parametrize("mistake", HASH_MISTAKES, ids=lambda f: f.__name__)
def test_hash_check_catches(mistake):
    assert_caught(check_block_hashes, mistake, symptom=HASH_MISTAKES[mistake],
                  fallback=course_block_hashes)


def test_blocks_check_passes_the_lesson_class_quickly():
    start = time.perf_counter()
    assert_passes(check_blocks, Blocks)
    assert_passes(check_blocks, BlockManager)
    assert time.perf_counter() - start < 2


def test_blocks_check_says_not_written_for_a_stub():
    class Stub(Blocks):
        def grow(self, rid, n_tokens):
            raise NotImplementedError()
    assert_not_written(check_blocks, fallback=BlockManager)
    line = assert_not_written(lambda cls: check_blocks(Stub), fallback=BlockManager)
    assert "Blocks" in line


@pytest.mark.parametrize("mistake", BLOCK_MISTAKES, ids=lambda c: c.__name__)
def test_blocks_check_catches(mistake):
    assert_caught(check_blocks, mistake, symptom=BLOCK_MISTAKES[mistake], fallback=BlockManager)


def test_blocks_check_names_the_exception_of_a_broken_class():
    class NoTables(Blocks):
        def free_request(self, rid):
            del self.tables[rid], self.reserved[rid]
            for block in self.tables[rid]:            # the table is gone already
                self.ref_counts[block] -= 1
    line = assert_caught(check_blocks, NoTables, symptom="free_request('A') raised KeyError", fallback=BlockManager)
    assert "self.tables[rid]" in line


def test_the_fallback_class_runs_the_lesson_scenario():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.allocate("A", list(range(10)), 3) == 0
    with pytest.raises(PoolExhausted):
        manager.allocate("B", list(range(40)), 1)


EXERCISES = [
    Exercise("block_hashes", check_block_hashes, (), course_block_hashes,
             right=[block_hashes, hashes_with_a_while_loop], wrong=HASH_MISTAKES),
    Exercise("Blocks", check_blocks, (), BlockManager, right=[Blocks, BlockManager],
             wrong=BLOCK_MISTAKES),
]
