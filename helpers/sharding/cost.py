"""A cost model of a tensor-parallel decode step: weights read against bytes all-reduced.
(Lesson 11.)

At small batches a decode step is bound by memory: every weight is read once per step. With
tensor parallelism each of ``W`` GPUs reads ``1 / W`` of the weights, at the same time, so that
part of the step shrinks ``W`` times. What it adds is communication: two all-reduces a block,
each of one hidden vector per token of the batch. A ring all-reduce of ``S`` bytes over ``W``
GPUs sends and receives ``2 (W - 1) / W × S`` bytes on each GPU's link (NCCL's tests call the
speed measured this way the *bus bandwidth*), after a fixed *latency* that does not depend on
the size. So, per decode step (one token per row):

    weights  = weight bytes / W / memory bandwidth
    comm     = 2 × layers × (latency + 2 (W - 1) / W × batch × hidden × bytes / link bandwidth)

Tensor parallelism pays while ``comm`` stays small against what it saves of ``weights``. The
bandwidths below are the makers' published figures, one direction (an all-reduce sends and
receives at once); the latencies are assumptions of the right order, to be measured on a real
machine (NCCL's ``all_reduce_perf``), and the model leaves out the arithmetic, the KV cache
and any overlap of communication with computation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link between GPUs: one direction's bandwidth (bytes/s) and an all-reduce's fixed
    latency (seconds); ``source`` says where the bandwidth comes from. (Lesson 11.)"""

    name: str
    bandwidth: float
    latency: float
    source: str


@dataclass(frozen=True)
class Device:
    """A device's memory (bytes) and memory bandwidth (bytes/s). (Lesson 11.)"""

    name: str
    memory: float
    bandwidth: float
    source: str


H100_SXM = Device("H100 SXM 80 GB", 80e9, 3.35e12,
                  "NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s")

LINKS = (
    Link("NVLink 4 (H100 SXM)", 450e9, 10e-6,
         "NVIDIA H100 datasheet: NVLink 900 GB/s, both directions together"),
    Link("PCIe Gen5 x16", 64e9, 15e-6,
         "NVIDIA H100 datasheet: PCIe Gen5 128 GB/s, both directions together"),
    Link("InfiniBand NDR, 400 Gb/s", 50e9, 30e-6,
         "NVIDIA ConnectX-7: 400 Gb/s a port, one direction"),
)


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model: its parameters, layers and hidden size, and the
    bytes of one value (2 in fp16/bf16). (Lesson 11.)"""

    name: str
    params: float
    layers: int
    hidden: int
    bytes_per_value: int = 2


#: A 70B model of Llama-2-70B's shape, as lesson 01 and 04 count it (70e9 parameters).
LLAMA2_70B_SHAPE = ModelShape("70B (Llama-2-70B)", 70e9, 80, 8192)


def allreduce_seconds(nbytes: float, world_size: int, link: Link) -> float:
    """One ring all-reduce of ``nbytes`` over ``world_size`` GPUs: the link's latency, plus
    ``2 (W - 1) / W × nbytes`` through its bandwidth. Zero for one GPU. (Lesson 11.)"""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, got {nbytes!r}")
    if world_size == 1:
        return 0.0
    return link.latency + 2 * (world_size - 1) / world_size * nbytes / link.bandwidth


@dataclass(frozen=True)
class StepEstimate:
    """The cost model's decode step, seconds: reading this GPU's weights, and the
    all-reduces; ``fits`` says whether the weights alone fit in the device's memory.
    (Lesson 11.)"""

    weights: float
    comm: float
    fits: bool

    @property
    def total(self) -> float:
        return self.weights + self.comm


def tp_decode_step(model: ModelShape, world_size: int, link: Link, device: Device = H100_SXM,
                   batch: int = 1) -> StepEstimate:
    """The cost model's decode step of ``model`` on ``world_size`` ``device``s joined by
    ``link``, at ``batch`` rows. (Lesson 11.)"""
    weight_bytes = model.params * model.bytes_per_value
    weights = weight_bytes / world_size / device.bandwidth
    message = batch * model.hidden * model.bytes_per_value
    comm = 2 * model.layers * allreduce_seconds(message, world_size, link)
    return StepEstimate(weights, comm, weight_bytes / world_size <= device.memory)
