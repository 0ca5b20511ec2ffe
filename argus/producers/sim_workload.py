"""What one simulated training step runs on each pipeline stage: kernels, streams, phases and order.

Every rank of a stage runs the same *program*: a fixed kernel list (names, streams, relative durations)
and the operations that lay it out in time (compute runs, blocking TP collectives, overlapped DP buckets,
pipeline send/receive). Streams: see docs/internals/producers.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from argus.schemas.records import ParallelGroup, PhaseKind

__all__ = [
    "COMPUTE_STREAM",
    "DP_STREAM",
    "K_ALL_GATHER",
    "K_ALL_REDUCE",
    "K_GEMM",
    "K_REDUCE_SCATTER",
    "K_SEND_RECV",
    "PP_STREAM",
    "TP_STREAM",
    "Block",
    "Cat",
    "GradSync",
    "Op",
    "Phases",
    "StageProgram",
    "build_programs",
    "one_f_one_b",
    "p2p_tag",
]

COMPUTE_STREAM = 7
DP_STREAM = 13
TP_STREAM = 17
PP_STREAM = 21

K_GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"  # noqa: E501
K_FLASH_FWD = ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
               "cutlass::bfloat16_t>, false, false, false, false, true, true, false>(Flash_fwd_params)")
K_FLASH_BWD = ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, "
               "128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>, false, false, false, false, true, true, "
               "false>(Flash_bwd_params)")
K_LN_FWD = "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"
K_LN_BWD = ("void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<c10::BFloat16, "
            "float>")
K_ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
         "std::array<char*, 3ul> >")
K_GELU = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl<c10::BFloat16>, "
          "std::array<char*, 2ul> >")
K_GELU_BWD = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluBackwardCUDAKernelImpl"
              "<c10::BFloat16>, std::array<char*, 3ul> >")
K_EMBED = ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, "
           "2, 2, -2, true>")
K_EMBED_BWD = ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16, "
               "float, long>")
K_SOFTMAX = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
             "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>")
K_SOFTMAX_BWD = ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, "
                 "at::native::(anonymous namespace)::LogSoftMaxBackwardEpilogue>")
K_OPT_NORM = ("void multi_tensor_apply_kernel<TensorListMetadata<1>, L2NormFunctor<float, float>, float*, "
              "float*, bool, int>")
K_OPT_ADAM = ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>, float, float, "
              "float, float, float, float, adamMode_t, float>")
K_ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
K_REDUCE_SCATTER = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"
K_ALL_GATHER = "ncclDevKernel_AllGather_RING_LL"
K_SEND_RECV = "ncclDevKernel_SendRecv"

# Relative durations (microseconds at scale 1); the simulator rescales them to the requested step time.
_US = {
    "gemm_out": 200.0, "gemm_qkv": 600.0, "gemm_mlp": 1600.0, "flash_fwd": 600.0, "flash_bwd": 1500.0,
    "ln_fwd": 60.0, "ln_bwd": 90.0, "add": 45.0, "gelu": 80.0, "gelu_bwd": 120.0, "embed": 40.0,
    "embed_bwd": 150.0, "softmax": 300.0, "softmax_bwd": 300.0, "opt_norm": 200.0, "opt_adam": 700.0,
    "tp_ar": 300.0, "dp_ar": 4000.0, "dp_rs": 2000.0, "dp_ag": 2000.0, "dp_ar_small": 150.0, "p2p": 250.0,
}
_ADAM_CHUNKS = 4


class GradSync(enum.Enum):
    """How DP gradients are synchronized (one bucket per transformer layer, overlapped with backward)."""

    #: DDP: one AllReduce per bucket, then the optimizer.
    ALL_REDUCE = "ALL_REDUCE"
    #: Distributed optimizer: ReduceScatter per bucket, a small AllReduce (grad norm / unsharded
    #: parameters), the optimizer, then an AllGather of parameters per bucket.
    DISTRIBUTED = "DISTRIBUTED"


class Cat(enum.IntEnum):
    """Kernel category, which fault factors select on."""

    ATTENTION = 0
    MLP = 1
    OTHER = 2
    OPTIMIZER = 3
    ALL_REDUCE = 4
    REDUCE_SCATTER = 5
    ALL_GATHER = 6
    SEND_RECV = 7


class Op(enum.IntEnum):
    """Timeline operations: ``(op, a, b)`` tuples in :attr:`Block.ops` / :attr:`StageProgram.tail`."""

    RUN = 0      # a = run id: compute kernels laid out back to back on the compute stream
    TP_SYNC = 1  # a = kernel: blocking TP collective
    DP_SYNC = 2  # a = kernel, b = 1 if the compute stream waits for it
    DP_WAIT = 3  # compute stream waits for every queued DP collective
    SEND = 4     # a = kernel, b = tag: pipeline send (data ready at the compute cursor)
    RECV = 5     # a = kernel, b = tag: pipeline receive matching the SEND with the same tag


@dataclass(frozen=True)
class Block:
    """One microbatch's forward or backward on one stage."""

    backward: bool
    microbatch: int
    ops: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, eq=False)
class Phases:
    """Phase template: phase ``i`` spans kernel ``first[i]`` start to kernel ``last[i]`` end."""

    kinds: tuple[PhaseKind, ...]
    names: tuple[str, ...]
    groups: tuple[ParallelGroup, ...]
    streams: tuple[int, ...]
    first: npt.NDArray[np.int64]
    last: npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class StageProgram:
    """The kernels and operations of one step of one pipeline stage (the same for all its ranks)."""

    stage: int
    name_idx: npt.NDArray[np.uint32]
    stream: npt.NDArray[np.uint32]
    base_us: npt.NDArray[np.float64]
    cat: npt.NDArray[np.int8]
    backward: npt.NDArray[np.bool_]
    compute: npt.NDArray[np.bool_]
    run_first: npt.NDArray[np.int64]
    run_last: npt.NDArray[np.int64]
    run_of: npt.NDArray[np.int64]
    blocks: tuple[Block, ...]
    tail: tuple[tuple[int, int, int], ...]
    phases: Phases

    def __len__(self) -> int:
        return int(self.name_idx.shape[0])


def one_f_one_b(pp: int, microbatches: int, stage: int) -> list[tuple[bool, int]]:
    """The 1F1B order of ``(backward, microbatch)`` blocks on ``stage`` of a ``pp``-stage pipeline."""
    warmup = min(pp - stage - 1, microbatches)
    order = [(False, m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(False, warmup + i), (True, i)]
    return order + [(True, m) for m in range(microbatches - warmup, microbatches)]


def p2p_tag(microbatch: int, backward: bool, sender: int, pp: int) -> int:
    """Identifier matching a pipeline send with its receive."""
    return (microbatch * 2 + int(backward)) * pp + sender


class _Builder:
    def __init__(self, names: dict[str, int]) -> None:
        self.names = names
        self.kernels: list[tuple[int, int, float, int, bool, bool]] = []
        self.runs: list[tuple[int, int]] = []
        self.ops: list[tuple[int, int, int]] = []
        self.phases: list[list[object]] = []
        self._open: list[list[object]] = []
        self._run_first = -1
        self._last_compute = -1
        self._backward = False

    def _add(self, name: str, stream: int, us: float, cat: Cat, compute: bool) -> int:
        idx = len(self.kernels)
        self.kernels.append((self.names.setdefault(name, len(self.names)), stream, us, int(cat),
                             self._backward, compute))
        return idx

    def compute(self, name: str, key: str, cat: Cat) -> None:
        idx = self._add(name, COMPUTE_STREAM, _US[key], cat, True)
        if self._run_first < 0:
            self._run_first = idx
        self._last_compute = idx
        for ph in self._open:
            if ph[4] is None:
                ph[4] = idx

    def close_run(self) -> None:
        if self._run_first >= 0:
            self.ops.append((Op.RUN, len(self.runs), 0))
            self.runs.append((self._run_first, self._last_compute))
            self._run_first = -1

    def comm(self, op: Op, name: str, stream: int, key: str, cat: Cat, b: int, phase: tuple[PhaseKind, str,
             ParallelGroup]) -> None:
        self.close_run()
        idx = self._add(name, stream, _US[key], cat, False)
        self.ops.append((op, idx, b))
        self.phases.append([phase[0], phase[1], phase[2], stream, idx, idx])

    def wait(self, op: Op) -> None:
        self.close_run()
        self.ops.append((op, 0, 0))

    def begin(self, kind: PhaseKind, name: str) -> None:
        ph: list[object] = [kind, name, ParallelGroup.NONE, COMPUTE_STREAM, None, None]
        self.phases.append(ph)
        self._open.append(ph)

    def end(self) -> None:
        self._open.pop()[5] = self._last_compute

    def take_ops(self) -> tuple[tuple[int, int, int], ...]:
        self.close_run()
        ops, self.ops = tuple(self.ops), []
        return ops


def _layer(b: _Builder, backward: bool, tp: int) -> None:
    kind = PhaseKind.BACKWARD if backward else PhaseKind.FORWARD
    tp_phase = (PhaseKind.ALL_REDUCE, "tp-allreduce", ParallelGroup.TP)

    def tp_sync() -> None:
        if tp > 1:
            b.comm(Op.TP_SYNC, K_ALL_REDUCE, TP_STREAM, "tp_ar", Cat.ALL_REDUCE, 0, tp_phase)

    attention = [(K_LN_FWD, "ln_fwd"), (K_GEMM, "gemm_qkv"), (K_FLASH_FWD, "flash_fwd"), (K_GEMM, "gemm_out"),
                 None, (K_ADD, "add")]
    mlp = [(K_LN_FWD, "ln_fwd"), (K_GEMM, "gemm_mlp"), (K_GELU, "gelu"), (K_GEMM, "gemm_mlp"), None,
           (K_ADD, "add")]
    if backward:
        attention = [(K_GEMM, "gemm_out"), (K_GEMM, "gemm_out"), (K_FLASH_BWD, "flash_bwd"),
                     (K_GEMM, "gemm_qkv"), None, (K_GEMM, "gemm_qkv"), (K_LN_BWD, "ln_bwd")]
        mlp = [(K_GEMM, "gemm_mlp"), (K_GEMM, "gemm_mlp"), (K_GELU_BWD, "gelu_bwd"), (K_GEMM, "gemm_mlp"),
               None, (K_GEMM, "gemm_mlp"), (K_LN_BWD, "ln_bwd")]
    parts = [("mlp", Cat.MLP, mlp), ("self_attention", Cat.ATTENTION, attention)]
    for name, cat, kernels in parts if backward else parts[::-1]:
        b.begin(kind, name)
        for k in kernels:
            if k is None:
                tp_sync()
            else:
                b.compute(k[0], k[1], cat)
        b.end()


def _stage(names: dict[str, int], stage: int, *, dp: int, tp: int, pp: int, layers: int, microbatches: int,
           grad_sync: GradSync) -> StageProgram:
    b = _Builder(names)
    p2p = (PhaseKind.SEND_RECV, "pp-send-recv", ParallelGroup.PP)
    bucket = ((Op.DP_SYNC, K_REDUCE_SCATTER, "dp_rs", Cat.REDUCE_SCATTER,
               (PhaseKind.REDUCE_SCATTER, "dp-reduce-scatter", ParallelGroup.DP))
              if grad_sync is GradSync.DISTRIBUTED else
              (Op.DP_SYNC, K_ALL_REDUCE, "dp_ar", Cat.ALL_REDUCE,
               (PhaseKind.ALL_REDUCE, "dp-allreduce", ParallelGroup.DP)))
    blocks: list[Block] = []
    for backward, m in one_f_one_b(pp, microbatches, stage):
        b._backward = backward
        last_in, last_out = (stage == pp - 1, stage == 0) if backward else (stage == 0, stage == pp - 1)
        if not last_in:
            b.comm(Op.RECV, K_SEND_RECV, PP_STREAM, "p2p", Cat.SEND_RECV,
                   p2p_tag(m, backward, stage + (1 if backward else -1), pp), p2p)
        b.begin(PhaseKind.BACKWARD if backward else PhaseKind.FORWARD, "backward" if backward else "forward")
        if not backward and stage == 0:
            b.compute(K_EMBED, "embed", Cat.OTHER)
        if backward and stage == pp - 1:
            b.compute(K_SOFTMAX_BWD, "softmax_bwd", Cat.OTHER)
        for _ in range(layers):
            _layer(b, backward, tp)
            if backward and m == microbatches - 1 and dp > 1:
                b.comm(bucket[0], bucket[1], DP_STREAM, bucket[2], bucket[3], 0, bucket[4])
        if not backward and stage == pp - 1:
            b.compute(K_SOFTMAX, "softmax", Cat.OTHER)
        if backward and stage == 0:
            b.compute(K_EMBED_BWD, "embed_bwd", Cat.OTHER)
        b.end()
        if not last_out:
            tag = p2p_tag(m, backward, stage, pp)
            b.comm(Op.SEND, K_SEND_RECV, PP_STREAM, "p2p", Cat.SEND_RECV, tag, p2p)
        blocks.append(Block(backward, m, b.take_ops()))
    b._backward = False
    distributed = grad_sync is GradSync.DISTRIBUTED and dp > 1
    if distributed:
        b.comm(Op.DP_SYNC, K_ALL_REDUCE, DP_STREAM, "dp_ar_small", Cat.ALL_REDUCE, 1,
               (PhaseKind.ALL_REDUCE, "dp-allreduce", ParallelGroup.DP))
    b.begin(PhaseKind.OPTIMIZER, "optimizer")
    b.compute(K_OPT_NORM, "opt_norm", Cat.OPTIMIZER)
    for _ in range(_ADAM_CHUNKS):
        b.compute(K_OPT_ADAM, "opt_adam", Cat.OPTIMIZER)
    b.end()
    if distributed:
        for _ in range(layers):
            b.comm(Op.DP_SYNC, K_ALL_GATHER, DP_STREAM, "dp_ag", Cat.ALL_GATHER, 0,
                   (PhaseKind.ALL_GATHER, "dp-all-gather", ParallelGroup.DP))
        b.wait(Op.DP_WAIT)
    tail = b.take_ops()
    cols = list(zip(*b.kernels, strict=True))
    run_of = np.full(len(b.kernels), -1, dtype=np.int64)
    for i, (lo, hi) in enumerate(b.runs):
        run_of[lo:hi + 1] = i
    compute = np.array(cols[5], dtype=bool)
    run_of[~compute] = -1
    ph = b.phases
    return StageProgram(
        stage=stage,
        name_idx=np.array(cols[0], dtype=np.uint32),
        stream=np.array(cols[1], dtype=np.uint32),
        base_us=np.array(cols[2], dtype=np.float64),
        cat=np.array(cols[3], dtype=np.int8),
        backward=np.array(cols[4], dtype=bool),
        compute=compute,
        run_first=np.array([r[0] for r in b.runs], dtype=np.int64),
        run_last=np.array([r[1] for r in b.runs], dtype=np.int64),
        run_of=run_of,
        blocks=tuple(blocks),
        tail=tail,
        phases=Phases(
            kinds=tuple(p[0] for p in ph),  # type: ignore[misc]
            names=tuple(str(p[1]) for p in ph),
            groups=tuple(p[2] for p in ph),  # type: ignore[misc]
            streams=tuple(int(p[3]) for p in ph),  # type: ignore[call-overload]
            first=np.array([p[4] for p in ph], dtype=np.int64),
            last=np.array([p[5] for p in ph], dtype=np.int64),
        ),
    )


def build_programs(*, dp: int, tp: int, pp: int, layers: int, microbatches: int,
                   grad_sync: GradSync) -> tuple[tuple[str, ...], tuple[StageProgram, ...]]:
    """The kernel-name table (shared by all stages) and one program per pipeline stage."""
    if layers < 1 or microbatches < 1:
        raise ValueError(f"layers and microbatches must be >= 1, got {layers}, {microbatches}")
    names: dict[str, int] = {}
    programs = tuple(_stage(names, s, dp=dp, tp=tp, pp=pp, layers=layers, microbatches=microbatches,
                            grad_sync=grad_sync) for s in range(pp))
    return tuple(names), programs
