"""Sharding: one model across several ranks with tensor parallelism, and pipeline parallelism
in brief. (Lesson 11.)

One idea a module, in the order lesson 11 meets them:

    plan        the split plan for GPT-2: which weight is cut along which dimension (``Conv1D``
                stores its weight as (in, out)), the fused queries/keys/values cut per part,
                the world sizes a model allows, the bytes each rank holds and all-reduces
    comm        communicators that add up partial sums and count calls, bytes and seconds: one
                for ranks that are threads of one process, one over ``torch.distributed``
    model       a rank's GPT-2 in plain PyTorch (``ShardedGPT2``): cut from a loaded model
                (``shard_model``) or read slice by slice from the checkpoint (``load_shard``)
    decode      the greedy loop every rank runs, each step timed and its all-reduces counted
    simulated   every rank in one process, one thread each (``SimulatedTP``)
    processes   every rank a process of its own, started and stopped from a notebook
                (``start_ranks``; ``worker`` is the rank's program): free ports, a dead rank
                reported by name within a second and a hung one within seconds, an
                interrupted cell harmless, no process or folder left behind
    pipeline    the layers split into stages that pass activations on, and the bubble
    cost        the cost model: weights read against bytes all-reduced, at NVLink, PCIe and
                network speeds
    figures     the lesson's plots

It builds on ``helpers.models`` (where the bundled model lives) and nothing above it; the
rank processes import only torch and safetensors, so that they start quickly.
"""

from .comm import (CommCounts, Communicator, DistributedCommunicator, GroupBroken,
                   LeftWaiting, ThreadCommunicator, ThreadGroup)
from .cost import (H100_SXM, LINKS, LLAMA2_70B_SHAPE, Device, Link, ModelShape, StepEstimate,
                   allreduce_seconds, tp_decode_step)
from .decode import Decoded, greedy_decode
from .model import (KVCache, RowParallelConv1D, ShardedAttention, ShardedGPT2, ShardedMLP,
                    embed_vocab_shard, load_shard, shard_model, vocab_shard, weight_bytes)
from .pipeline import (PipelineRun, PipelineSchedule, StageLink, pipeline_generate,
                       pipeline_schedule, stage_blocks)
from .plan import (GPT2_PLAN, SplitWeight, allreduce_bytes_per_step, check_world_size,
                   gpt2_plan, mlp_width, split_columns, split_qkv, split_rows, vocab_range,
                   weight_bytes_per_rank)
from .processes import RankDied, RankGroup, choose_backend, start_ranks, stop_all
from .simulated import SimulatedTP, run_in_threads

_FIGURES = ("cost_figure", "pipeline_figure", "step_time_figure")

__all__ = [
    # plan
    "GPT2_PLAN", "SplitWeight", "allreduce_bytes_per_step", "check_world_size", "gpt2_plan",
    "mlp_width", "split_columns", "split_qkv", "split_rows", "vocab_range",
    "weight_bytes_per_rank",
    # comm
    "CommCounts", "Communicator", "DistributedCommunicator", "GroupBroken", "LeftWaiting",
    "ThreadCommunicator", "ThreadGroup",
    # model, decode
    "KVCache", "RowParallelConv1D", "ShardedAttention", "ShardedGPT2", "ShardedMLP",
    "embed_vocab_shard", "load_shard", "shard_model", "vocab_shard", "weight_bytes",
    "Decoded", "greedy_decode",
    # ranks in threads, ranks in processes
    "SimulatedTP", "run_in_threads", "RankDied", "RankGroup", "choose_backend", "start_ranks",
    "stop_all",
    # pipeline, cost model, figures
    "PipelineRun", "PipelineSchedule", "StageLink", "pipeline_generate", "pipeline_schedule",
    "stage_blocks",
    "H100_SXM", "LINKS", "LLAMA2_70B_SHAPE", "Device", "Link", "ModelShape", "StepEstimate",
    "allreduce_seconds", "tp_decode_step", *_FIGURES,
]


def __getattr__(name: str):
    # The figures import matplotlib: only when a lesson asks for one (a rank never does).
    if name in _FIGURES:
        from . import figures

        return getattr(figures, name)
    raise AttributeError(f"module 'helpers.sharding' has no attribute {name!r}")
