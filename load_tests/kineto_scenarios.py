"""Randomized torch.profiler / Kineto Chrome traces of a synchronous Megatron-style job, with known faults.

An evaluation generator **independent of** ``producers/sim_*`` and ``producers/faults.py``: its own kernel
mixes, topologies, schedules, noise model and fault magnitudes, and it writes *files* (one Kineto trace per
rank, as ``torch.profiler`` exports them) that go through the real importer (``argus import-kineto``).
Only numpy and the standard library.

The job (per ``ProfilerStep``) is a discrete-event timeline, vectorized over the ranks of a pipeline stage:

* topology DP x TP x PP (x EP for MoE: expert groups carved out of each DP group), Megatron rank order
  ``rank = pp_stage * dp * tp + dp_idx * tp + tp_idx``; every rank's ``distributedInfo.pg_config`` lists its
  groups of each kind (``TENSOR_MODEL_PARALLEL_GROUP``, ``DATA_PARALLEL_GROUP``, ...) and ``default_pg``, and
  NCCL kernels may name their process group in their args: three trace variants (``Scenario.pg_variant``:
  args and pg_config, pg_config only, neither -- then the importer needs :func:`topology_flag`);
* per microbatch and layer: GEMMs (one kernel name at several shapes: QKV, out-projection, fc1 share the
  forward name, so its durations are multimodal; dgrad/wgrad names likewise), flash attention, norms,
  elementwise, dropout, MoE router/permute/grouped GEMMs; embedding on the first stage, LM head and loss on
  the last; the optimizer (``multi_tensor_apply_kernel``) after the gradient sync; memset/memcpy;
* compute on stream 7, every communicator on its own NCCL stream. A collective **ends together** on all
  members of its group: each member's kernel starts when it arrives (and its stream is free) and ends at
  ``max(arrival over the group) + transfer`` (each within ``coend_jitter_us``), so early members show long
  kernels. TP collectives (and the MoE
  all-to-all) block the compute stream; pipeline send/recv between adjacent stages (GPipe or 1F1B) gate each
  stage's forward/backward; DP reduce-scatter/all-reduce buckets overlap the last backward; the distributed
  optimizer's all-gather closes the step; the host synchronizes at the end of every step;
* noise: lognormal, per-kernel sigma 3-10 % (per scenario), per-step shared, per-rank persistent and
  per-rank-step factors, optional rare outlier kernels.

Faults (:data:`FAULT_CLASSES`) and the expected diagnosis (``truth.json``, see :func:`expected_findings` and
:func:`score_findings`) are recorded per scenario. Sizes keep a scenario within :func:`kernel_budget` kernel
events (4,000 per rank, at most :data:`MAX_KERNEL_EVENTS`: fewer layers, microbatches and steps for large
worlds); a scenario runs a few layers per stage but stands for a deep model (``Scenario.head_ratio``).

    scn = Scenario.draw(np.random.default_rng(7), fault="link_degraded", max_ranks=64)
    traces = write_scenario(scn, Path("/tmp/scn7"))   # /tmp/scn7/traces/rank-<r>.pt.trace.json[.gz]
    # argus import-kineto /tmp/scn7/traces --job scn7 ; truth in /tmp/scn7/truth.json
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "FAULT_CLASSES",
    "KIND_CLASS",
    "LINK_FAULTS",
    "MAX_KERNEL_EVENTS",
    "MOE_CLASSES",
    "RANK_KINDS",
    "Scenario",
    "Timeline",
    "estimate_kernel_events",
    "expected_findings",
    "kernel_budget",
    "score_findings",
    "simulate",
    "topology_flag",
    "write_scenario",
]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B8 = npt.NDArray[np.bool_]

FAULT_CLASSES = ("compute_straggler", "stage_slow", "link_degraded", "one_mode", "job_regression", "host_stall",
                 "healthy", "short_trace", "slow_host", "link_small_group", "ep_straggler", "token_imbalance")
#: Classes whose fault is a degraded link: ``link_small_group`` is one in a group of 2-4 members or among only two
#: groups of its kind, in a trace whose NCCL kernels do not name their process group.
LINK_FAULTS = ("link_degraded", "link_small_group")
#: Classes drawn on MoE jobs with expert parallelism (EP >= 2) only.
MOE_CLASSES = ("ep_straggler", "token_imbalance")
#: Finding kinds that name a slow rank.
RANK_KINDS = ("compute_straggler", "late_arrival", "kernel_degraded", "rank_degraded")
#: Coarse class of each finding kind, for precision/recall over (kind class, rank) pairs.
KIND_CLASS = {"compute_straggler": "rank", "late_arrival": "rank", "kernel_degraded": "rank", "rank_degraded": "rank",
              "phase_straggler": "rank", "pp_stage_slow": "stage", "link_degraded": "link", "node_degraded": "host",
              "step_regression": "regression", "iteration_spike": "spike"}
#: Upper bound of kernel events (all ranks) per scenario; small worlds get less (:func:`kernel_budget`).
MAX_KERNEL_EVENTS = 300_000
GPUS_PER_NODE = 8
_HOST_FORMATS = ("node{:04d}", "gpu-{:03d}.cluster.local", "trn-a{:03d}")
COMPUTE_STREAM = 7
#: Each NCCL communicator's stream, as an offset from the scenario's ``nccl_stream_base``.
NCCL_STREAMS = {"tp": 0, "dp": 4, "ep": 8, "pp_prev": 12, "pp_next": 16, "mp": 20}

# -- kernel names -----------------------------------------------------------------------------------------

_SM90_GEMM = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_{l}_n_tilesize{t}_warpgroupsize{w}"
              "_execute_segment_k_off_kernel__5x_cublas")
_SM80_GEMM = "ampere_{d}_s16816gemm_{d}_{t}_ldg8_f2f_stages_64x3_{l}"
_CUTLASS90 = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape"
              "<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::"
              "MainloopSm90ArrayTmaGmmaWarpSpecialized<{s}, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
              "cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>, cute::tuple<cute::C<{t}>, "
              "cute::C<64> >, cutlass::bfloat16_t, cute::tuple<long, cute::C<1>, cute::C<0> >*, "
              "cutlass::bfloat16_t, cute::tuple<long, cute::C<1>, cute::C<0> >*> > >(...)")
_GROUPED80 = ("void cutlass::Kernel<cutlass::gemm::kernel::GemmGrouped<cutlass::gemm::threadblock::MmaMultistage<"
              "cutlass::gemm::GemmShape<{m}, {n}, {k}>, cutlass::bfloat16_t, cutlass::layout::RowMajor>, "
              "cutlass::epilogue::threadblock::Epilogue<cutlass::gemm::GemmShape<{m}, {n}, {k}> >, "
              "cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, "
              "(cutlass::gemm::kernel::GroupScheduleMode)0, false> >(cutlass::gemm::kernel::GemmGrouped<"
              "cutlass::gemm::GemmShape<{m}, {n}, {k}> >::Params)")
_SM90_TILES = ("128x128x64", "256x128x64", "128x256x64", "64x128x64", "128x64x64", "256x64x64", "64x256x64",
               "192x128x64")
_SM80_TILES = ("128x128", "256x128", "128x256", "64x128", "128x64", "256x64", "64x256", "64x64")
_FLASH_FWD = ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, {c}, "
              "Flash_kernel_traits<128, 128, 64, 4, {c}> >, false, true, false, false, true, true, false, false>"
              "(flash::Flash_fwd_params)")
_FLASH_BWD = ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, "
              "4, 2, false, false, {c}, Flash_kernel_traits<128, 64, 128, 8, {c}> >, true, false, false, false, "
              "true, true, false>(flash::Flash_bwd_params)")
_FLASH_DOT = ("void flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, "
              "false, {c}, Flash_kernel_traits<128, 64, 128, 8, {c}> > >(flash::Flash_bwd_params)")
_FLASH_CVT = ("void flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, "
              "false, {c}, Flash_kernel_traits<128, 64, 128, 8, {c}> > >(flash::Flash_bwd_params, int)")
_EW = ("void at::native::vectorized_elementwise_kernel<4, {f}, at::detail::Array<char*, {n}> >"
       "(int, {f}, at::detail::Array<char*, {n}>)")
_NAMES_COMMON = {
    "norm_fwd": ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<{c}, float>(int, float, "
                 "{c} const*, {c} const*, {c} const*, float*, float*, {c}*)"),
    "rms_fwd": ("void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<transformer_engine::normalization::"
                "Kernel_traits<{c}, {c}, {c}, float, unsigned int, 4096u, 1u, 1u, 4u, 16u, transformer_engine::"
                "normalization::Kernel_traits_base<4096u, {c}, {c}, {c}, float, unsigned int, 128u> >, false>"
                "(transformer_engine::normalization::FwdParams)"),
    "norm_bwd": ("void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<{c}, float>"
                 "({c} const*, {c} const*, float const*, float const*, {c} const*, {c}*, int)"),
    "norm_gamma": ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<{c}, float>(long, "
                   "long, {c} const*, {c} const*, float const*, float const*, {c}*, {c}*)"),
    "rms_bwd": ("void transformer_engine::normalization::rmsnorm_bwd_tuned_kernel<transformer_engine::normalization::"
                "Kernel_traits<{c}, {c}, {c}, float, unsigned int, 4096u, 1u, 1u, 4u, 16u, transformer_engine::"
                "normalization::Kernel_traits_base<4096u, {c}, {c}, {c}, float, unsigned int, 128u> >, false>"
                "(transformer_engine::normalization::BwdParams)"),
    "add": _EW.format(f="at::native::CUDAFunctor_add<{c}>", n=3),
    "mul": _EW.format(f="at::native::BinaryFunctor<{c}, {c}, {c}, at::native::binary_internal::MulFunctor<float> >",
                      n=3),
    "gelu": _EW.format(f="at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{{lambda()#2}}"
                       "::operator()() const::{{lambda()#2}}::operator()() const::{{lambda({c})#1}}", n=2),
    "gelu_bwd": _EW.format(f="at::native::GeluBackwardCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::"
                           "{{lambda()#2}}::operator()() const::{{lambda()#2}}::operator()() const::{{lambda({c}, "
                           "{c})#1}}", n=3),
    "dropout": ("void at::native::(anonymous namespace)::fused_dropout_kernel_vec<{c}, float, unsigned int, 1, 8, "
                "bool>(at::cuda::detail::TensorInfo<{c} const, unsigned int>, at::cuda::detail::TensorInfo<{c}, "
                "unsigned int>, at::cuda::detail::TensorInfo<bool, unsigned int>, unsigned int, float, "
                "at::PhiloxCudaState)"),
    "softmax": ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
                "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)"),
    "topk": ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float "
             "const, unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, "
             "at::cuda::detail::TensorInfo<float, unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, "
             "unsigned int>, unsigned int, float*)"),
    "permute": ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::"
                "index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, "
                "c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1}>(at::TensorIteratorBase&, "
                "c10::ArrayRef<long>, c10::ArrayRef<long>, at::native::index_kernel_impl<at::native::OpaqueType<2> "
                ">(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, "
                "long)#1} const&, bool)::{lambda(int)#1}>(long, at::native::gpu_index_kernel<at::native::"
                "index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::ArrayRef<long>, "
                "c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1}>(at::TensorIteratorBase&, "
                "c10::ArrayRef<long>, c10::ArrayRef<long>, at::native::index_kernel_impl<at::native::OpaqueType<2> "
                ">(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, char const*, "
                "long)#1} const&, bool)::{lambda(int)#1})"),
    "unpermute": ("void at::native::(anonymous namespace)::indexFuncLargeIndex<{c}, long, unsigned int, 2, 2, -2, "
                  "true, at::native::(anonymous namespace)::ReduceAdd>(at::cuda::detail::TensorInfo<{c}, unsigned "
                  "int>, at::cuda::detail::TensorInfo<{c} const, unsigned int>, at::cuda::detail::TensorInfo<long "
                  "const, unsigned int>, int, int, unsigned int, unsigned int, long, long, "
                  "at::native::(anonymous namespace)::ReduceAdd const&, {c})"),
    "embed_fwd": ("void at::native::(anonymous namespace)::indexSelectLargeIndex<{c}, long, unsigned int, 2, 2, -2, "
                  "true>(at::cuda::detail::TensorInfo<{c}, unsigned int>, at::cuda::detail::TensorInfo<{c} const, "
                  "unsigned int>, at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, unsigned int, "
                  "unsigned int, long)"),
    "embed_bwd": ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<{c}, float, long>"
                  "(long const*, {c} const*, float*, int, long, int)"),
    "loss_softmax": ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
                     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)"),
    "loss_nll": ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, "
                 "long>(float*, float*, float const*, long const*, float const*, bool, long, long, long, long)"),
    "loss_nll_bwd": ("void at::native::(anonymous namespace)::nll_loss_backward_reduce_cuda_kernel_2d<float, long>"
                     "(float*, float const*, long const*, float const*, float const*, bool, int, int, long, long)"),
    "loss_softmax_bwd": ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, "
                         "at::native::(anonymous namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, "
                         "float const*, long)"),
    "opt_l2norm": ("void multi_tensor_apply_kernel<TensorListMetadata<1>, L2NormFunctor<float, 1, 1>, float*, "
                   "float*, bool, int>(long, int volatile*, TensorListMetadata<1>, L2NormFunctor<float, 1, 1>, "
                   "float*, float*, bool, int)"),
    "opt_adam": ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, int>, float, "
                 "float, float, float, float, float, adamMode_t, float>(long, int volatile*, TensorListMetadata<4>, "
                 "AdamFunctor<float, float, int>, float, float, float, float, float, float, adamMode_t, float)"),
    "opt_scale": ("void multi_tensor_apply_kernel<TensorListMetadata<2>, ScaleFunctor<float, float>, float*, "
                  "float>(long, int volatile*, TensorListMetadata<2>, ScaleFunctor<float, float>, float*, float)"),
}
_NCCL_DEV = {
    "allreduce": "ncclDevKernel_AllReduce_Sum_{d}_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "allreduce_f32": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "allreduce_max": "ncclDevKernel_AllReduce_Max_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "reducescatter": "ncclDevKernel_ReduceScatter_Sum_{d}_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "reducescatter_f32": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "allgather": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "sendrecv": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
}
_NCCL_LEGACY = {
    "allreduce": "ncclKernel_AllReduce_RING_LL_Sum_{d}(ncclDevComm*, unsigned long, ncclWork*)",
    "allreduce_f32": "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
    "allreduce_max": "ncclKernel_AllReduce_RING_LL_Max_float(ncclDevComm*, unsigned long, ncclWork*)",
    "reducescatter": "ncclKernel_ReduceScatter_RING_LL_Sum_{d}(ncclDevComm*, unsigned long, ncclWork*)",
    "reducescatter_f32": "ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
    "allgather": "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
    "sendrecv": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
}
_NCCL_ANN = {"allreduce": "nccl:all_reduce", "allreduce_f32": "nccl:all_reduce", "allreduce_max": "nccl:all_reduce",
             "reducescatter": "nccl:_reduce_scatter_base", "reducescatter_f32": "nccl:_reduce_scatter_base",
             "allgather": "nccl:_all_gather_base", "alltoall": "nccl:all_to_all"}
_PHASE_NAMES = (("## forward ##", "## backward ##", "Optimizer.step#AdamW.step"),
                ("forward", "backward", "Optimizer.step#AdamW.step"),
                ("forward-compute", "backward-compute", "optimizer"))
_DEVICES = {
    "sm90": {"name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85029158912, "computeMajor": 9, "computeMinor": 0,
             "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
             "regsPerMultiprocessor": 65536, "warpSize": 32, "sharedMemPerBlock": 49152,
             "sharedMemPerMultiprocessor": 233472, "numSms": 132, "sharedMemPerBlockOptin": 232448},
    "sm80": {"name": "NVIDIA A100-SXM4-80GB", "totalGlobalMem": 85198045184, "computeMajor": 8, "computeMinor": 0,
             "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
             "regsPerMultiprocessor": 65536, "warpSize": 32, "sharedMemPerBlock": 49152,
             "sharedMemPerMultiprocessor": 167936, "numSms": 108, "sharedMemPerBlockOptin": 166912},
}
#: Effective dense bf16/fp16 throughput (FLOP/s) and memory bandwidth (B/s) per GPU generation.
_PEAK = {"sm90": (5.2e14, 2.6e12), "sm80": (2.1e14, 1.5e12)}
_STYLES = ("sm90", "sm80", "sm80_legacy")
_COMPUTE_FAMILIES = frozenset({"gemm", "attn", "norm", "ew", "softmax", "embed", "loss", "opt"})
_CAT_KERNEL, _CAT_MEMCPY, _CAT_MEMSET = 0, 1, 2
_PH_NONE, _PH_FWD, _PH_BWD, _PH_OPT = 0, 1, 2, 3


# -- the scenario ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """Everything that determines one generated job (``seed`` drives the noise; the rest is structure).

    Step indices (``onset``, ``stall_steps``) count from 0 = the first traced step; the traces number their
    steps from ``first_step`` (``ProfilerStep#<first_step + index>``), and ``truth.json`` uses those numbers.
    """

    seed: int
    fault: str = "healthy"
    dp: int = 2
    tp: int = 1
    pp: int = 1
    ep: int = 1
    moe: bool = False
    steps: int = 12
    first_step: int = 0
    microbatches: int = 2
    #: Transformer layers per pipeline stage.
    layers: int = 2
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    dp_buckets: int = 2
    grad_norm_allreduce: bool = False
    hidden: int = 4096
    tokens: int = 4096
    vocab: int = 32000
    topk: int = 2
    norm: str = "layernorm"
    dropout: bool = True
    #: 'sm90' (H100, bf16, ncclDevKernel_*), 'sm80' (A100, bf16, ncclDevKernel_*), 'sm80_legacy' (fp16,
    #: ncclKernel_*).
    name_style: str = "sm90"
    #: GEMM names differ per shape (no multimodal names), as in ``short_trace``.
    distinct_gemm_names: bool = False
    #: The LM head's GEMM shares the forward GEMM name (one more mode, on the last stage only).
    lm_head_shared: bool = False
    #: Only the first call of each kernel name per step is kept (short traces: 1-3 calls per name).
    unique_names: bool = False
    noise: float = 0.05
    outlier_rate: float = 0.0
    #: Bandwidths (GB/s) of TP (NVLink), pipeline send/recv and expert all-to-all links.
    tp_bw: float = 200.0
    pp_bw: float = 40.0
    ep_bw: float = 60.0
    #: DP gradient sync and optimizer time as fractions of a step's compute.
    dp_ratio: float = 0.1
    opt_ratio: float = 0.02
    launch_us: float = 6.0
    host_overhead_us: float = 150.0
    #: LM head (and loss) cost over the GEMMs of one stage's layers. A scenario runs only a few layers per
    #: stage (to stay small) but stands for a real model of tens of layers per stage, whose last stage is
    #: only ~5-20 % heavier than the others; the vocabulary alone would make it several times heavier.
    head_ratio: float = 0.1
    fault_ranks: tuple[int, ...] = ()
    #: link_degraded: 'tp', 'dp', 'ep' or 'pp' (a send/recv pair between stages ``fault_stage`` and +1).
    fault_group: str = ""
    fault_stage: int = -1
    #: one_mode: '<name key>:<shape>' of the slowed mode, e.g. 'gemm_fwd:qkv'.
    fault_shape: str = ""
    magnitude: float = 1.0
    onset: int = 0
    stall_steps: tuple[int, ...] = ()
    #: compute_straggler: every compute kernel is slow, not only the GEMMs (slow_host: always).
    all_compute: bool = False
    annotate_phases: bool = False
    phase_style: int = 0
    gpu_step_annotations: bool = True
    nccl_annotations: bool = False
    flows: bool = False
    compress: bool = False
    absolute_ts: bool = False
    extra_pgs: bool = False
    nccl_stream_base: int = 20
    #: NCCL kernels name their process group in their args (PyTorch 2.3+: ``Process Group Name``,
    #: ``Process Group Description``, ``Process Group Ranks``, ``Group size``).
    pg_args: bool = False
    #: ``distributedInfo`` lists the rank's process groups (``pg_config``); without it (and without ``pg_args``)
    #: the trace names no group at all, and the importer needs the topology given (:func:`topology_flag`).
    pg_config: bool = True
    #: Members of a collective end within this many µs of each other (the ring's last hops), not at one instant.
    coend_jitter_us: float = 0.0
    #: MoE routing: per position in an expert group, the share of the group's routed tokens its experts get,
    #: over an even share (mean 1; empty: even). Tokens are conserved within a group: a hot expert's extra
    #: tokens are its peers' missing ones. Per chunk the shares also wander (``routing_noise``, log sigma).
    expert_skew: tuple[float, ...] = ()
    routing_noise: float = 0.08
    #: The trace records routed tokens: each forward grouped GEMM's cpu_op (``GroupedGemm``, as the
    #: ``grouped_gemm`` package's autograd function shows with ``record_shapes``) carries ``Input Dims`` whose
    #: first input is ``[tokens routed to the rank's experts, hidden]``.
    token_counts: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def pg_variant(self) -> str:
        """What names the process groups: 'args' (NCCL kernels' args, and ``pg_config``), 'pg_config' only, or
        'none'."""
        return "args" if self.pg_args else "pg_config" if self.pg_config else "none"

    @property
    def stage_size(self) -> int:
        return self.dp * self.tp

    def step_number(self, index: int) -> int:
        """The ``ProfilerStep`` number of step ``index``."""
        return self.first_step + index

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["world"] = self.world
        return d

    @classmethod
    def from_seed(cls, seed: int, fault: str | None = None, max_ranks: int = 512) -> Scenario:
        """The scenario drawn by ``np.random.default_rng(seed)``: the same seed, class and ``max_ranks``
        always give the same scenario (and traces)."""
        return cls.draw(np.random.default_rng(seed), fault=fault, max_ranks=max_ranks, seed=seed)

    @classmethod
    def draw(cls, rng: np.random.Generator, fault: str | None = None, max_ranks: int = 512,
             seed: int | None = None) -> Scenario:
        """A random scenario of class ``fault`` (None: any of :data:`FAULT_CLASSES`) with at most ``max_ranks``
        ranks: mostly small and medium worlds, a few large ones."""
        fault = fault or str(rng.choice(FAULT_CLASSES))
        if fault not in FAULT_CLASSES:
            raise ValueError(f"unknown fault class {fault!r}; expected one of {FAULT_CLASSES}")
        if max_ranks < 2:
            raise ValueError("max_ranks must be >= 2")
        seed = int(rng.integers(0, 2**31 - 1)) if seed is None else int(seed)
        dp, tp, pp, ep, moe = _draw_topology(rng, fault, max_ranks)
        style = str(rng.choice(_STYLES, p=[0.5, 0.3, 0.2]))
        hidden = int(rng.choice([2048, 3072, 4096, 5120, 6144, 8192]))
        tokens = int(rng.choice([2048, 4096, 8192]))
        kw: dict[str, Any] = dict(
            seed=seed, fault=fault, dp=dp, tp=tp, pp=pp, ep=ep, moe=moe,
            first_step=int(rng.choice([0, 0, 1, 2, 5, 10, 100])),
            schedule="gpipe" if rng.random() < 0.3 else "1f1b",
            sequence_parallel=tp > 1 and rng.random() < 0.4,
            distributed_optimizer=bool(rng.random() < 0.6), dp_buckets=int(rng.integers(1, 5)),
            grad_norm_allreduce=tp * pp > 1 and rng.random() < 0.5,
            hidden=hidden, tokens=tokens, vocab=int(rng.choice([32000, 50304, 128256])),
            topk=int(rng.choice([1, 2, 2, 4])), norm="rmsnorm" if rng.random() < 0.5 else "layernorm",
            dropout=bool(rng.random() < 0.5), name_style=style, lm_head_shared=bool(rng.random() < 0.5),
            noise=float(rng.uniform(0.03, 0.10)),
            outlier_rate=float(rng.choice([0.0, 1e-4, 5e-4])),
            tp_bw=float(rng.uniform(150, 350)), pp_bw=float(rng.uniform(20, 80)), ep_bw=float(rng.uniform(40, 150)),
            dp_ratio=float(rng.uniform(0.04, 0.2)), opt_ratio=float(rng.uniform(0.01, 0.04)),
            launch_us=float(rng.uniform(4, 9)), host_overhead_us=float(rng.uniform(60, 400)),
            head_ratio=float(rng.uniform(0.04, 0.2)),
            annotate_phases=bool(rng.random() < 0.5), phase_style=int(rng.integers(0, len(_PHASE_NAMES))),
            gpu_step_annotations=bool(rng.random() < 0.6), nccl_annotations=bool(rng.random() < 0.4),
            flows=bool(rng.random() < 0.3), compress=bool(rng.random() < 0.5),
            absolute_ts=bool(rng.random() < 0.25), extra_pgs=bool(rng.random() < 0.5),
            nccl_stream_base=int(rng.choice([13, 20, 24, 32])),
        )
        min_steps = {"job_regression": 16, "host_stall": 12}.get(fault, 6)
        if fault == "short_trace":
            kw.update(steps=int(rng.integers(1, 4)), microbatches=1, layers=1, distinct_gemm_names=True,
                      unique_names=True, schedule="gpipe")
        else:
            kw.update(steps=int(rng.integers(max(min_steps, 10), 41)), microbatches=int(rng.integers(1, 9)),
                      layers=int(rng.integers(1, 7)))
            if kw["schedule"] == "1f1b":
                kw["microbatches"] = max(kw["microbatches"], pp)
        scn = _fit_budget(cls(**kw), min_steps)
        # Drawn on its own stream, so that every other draw of a seed is what it was before the field existed.
        own = np.random.default_rng([seed, 11]) if seed is not None else rng
        scn = dataclasses.replace(scn, pg_args=bool(own.random() < 0.5) and fault != "link_small_group")
        # Likewise the trace variant without process-group args (pg_config only, or nothing) and the co-end jitter.
        own = np.random.default_rng([seed, 12]) if seed is not None else rng
        scn = dataclasses.replace(scn, pg_config=scn.pg_args or bool(own.random() < 0.5),
                                  coend_jitter_us=float(own.uniform(0.5, 4.0)))
        if scn.moe:
            moe_rng = np.random.default_rng([seed, 13])
            scn = dataclasses.replace(scn, token_counts=bool(moe_rng.random() < 0.5))
        return _draw_fault(scn, rng)


def _draw_topology(rng: np.random.Generator, fault: str, max_ranks: int) -> tuple[int, int, int, int, bool]:
    """(dp, tp, pp, ep, moe): mostly <= 16 ranks, some <= 128, a few up to ``max_ranks``."""
    bucket = rng.choice(3, p=[0.5, 0.38, 0.12])
    hi = min(max_ranks, (16, 128, 512)[bucket])
    lo = min(hi, (2, 17, 129)[bucket])
    if fault == "slow_host":
        # Every pipeline stage spans four hosts or more: argus compares a rank with its stage's other ranks, and
        # a host that is half of its stage leaves no majority to compare with (which half is slow?), while a
        # stage that is one host is the stage's slowness as argus reads it (docs/incidents.md).
        hi = max(hi, min(max_ranks, 128))
        lo = 4 * GPUS_PER_NODE
    for _ in range(10_000):
        tp = int(rng.choice([1, 1, 2, 2, 4, 8]))
        pp = int(rng.choice([1, 1, 2, 2, 4, 8]))
        dp = int(rng.choice([1, 2, 2, 4, 4, 8, 8, 16, 32, 64]))
        if fault == "stage_slow" and pp < 2:
            continue
        if dp < 2 and fault != "stage_slow":
            continue
        if fault in MOE_CLASSES and dp % 2:
            continue
        world = dp * tp * pp
        if not lo <= world <= hi or (fault == "stage_slow" and dp * tp < 2):
            continue
        if fault == "slow_host" and dp * tp < 4 * GPUS_PER_NODE:
            continue
        moe = dp >= 2 and (rng.random() < 0.25 or fault in MOE_CLASSES) and fault != "short_trace"
        ep = int(rng.choice([e for e in (2, 4, 8) if dp % e == 0 and e <= dp])) if moe else 1
        if fault == "link_degraded" and not _link_kinds(dp, tp, pp, ep):
            continue
        if fault == "link_small_group" and not _small_link_kinds(dp, tp, pp, ep):
            continue
        return dp, tp, pp, ep, moe
    raise ValueError(f"no topology for {fault} within {max_ranks} ranks")  # pragma: no cover


def kernel_budget(world: int) -> int:
    """Kernel events a scenario of ``world`` ranks may have: 4,000 per rank, at least 40,000, at most
    :data:`MAX_KERNEL_EVENTS` (importing ~300k events takes ~15-20 s of parsing)."""
    return min(MAX_KERNEL_EVENTS, max(40_000, 4_000 * world))


def _fit_budget(scn: Scenario, min_steps: int) -> Scenario:
    """Fewer layers, microbatches and steps until the scenario fits :func:`kernel_budget`."""
    budget = kernel_budget(scn.world)
    while estimate_kernel_events(scn) > budget:
        floor_mb = scn.pp if scn.schedule == "1f1b" else 1
        if scn.layers > 2:
            scn = dataclasses.replace(scn, layers=scn.layers - 1)
        elif scn.microbatches > max(2, floor_mb):
            scn = dataclasses.replace(scn, microbatches=scn.microbatches - 1)
        elif scn.steps > min_steps:
            scn = dataclasses.replace(scn, steps=max(min_steps, scn.steps - 4))
        elif scn.layers > 1:
            scn = dataclasses.replace(scn, layers=1)
        elif scn.microbatches > 1:
            scn = dataclasses.replace(scn, microbatches=scn.microbatches - 1, schedule="gpipe")
        else:
            break
    return scn


def _draw_fault(scn: Scenario, rng: np.random.Generator) -> Scenario:
    f, n, w = scn.fault, scn.steps, scn.world

    def onset() -> int:
        return 0 if rng.random() < 0.4 or n < 8 else int(rng.integers(1, n // 2 + 1))

    def mag(lo: float, hi: float) -> float:
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))

    if f == "compute_straggler":
        k = 2 if rng.random() < 0.2 and w >= 4 else 1
        ranks = tuple(sorted(int(r) for r in rng.choice(w, size=k, replace=False)))
        return dataclasses.replace(scn, fault_ranks=ranks, magnitude=mag(1.2, 3.0), onset=onset(),
                                   all_compute=bool(rng.random() < 0.4))
    if f == "slow_host":
        host = int(rng.integers(0, w // GPUS_PER_NODE))
        ranks = tuple(range(host * GPUS_PER_NODE, (host + 1) * GPUS_PER_NODE))
        return dataclasses.replace(scn, fault_ranks=ranks, magnitude=mag(1.15, 1.5), onset=onset(), all_compute=True)
    if f == "stage_slow":
        stage = scn.pp - 1 if rng.random() < 0.6 else int(rng.integers(0, scn.pp))
        return dataclasses.replace(scn, fault_stage=stage, fault_ranks=tuple(_stage_ranks(scn, stage)),
                                   magnitude=mag(1.2, 3.0), onset=onset())
    if f in LINK_FAULTS:
        kinds = _link_kinds if f == "link_degraded" else _small_link_kinds
        kind = str(rng.choice(kinds(scn.dp, scn.tp, scn.pp, scn.ep)))
        scn = dataclasses.replace(scn, fault_group=kind, magnitude=mag(1.5, 3.0), onset=onset())
        r = int(rng.integers(0, w))
        if kind == "pp":
            stage = int(rng.integers(0, scn.pp - 1))
            pos = r % scn.stage_size
            ranks = (stage * scn.stage_size + pos, (stage + 1) * scn.stage_size + pos)
            return dataclasses.replace(scn, fault_stage=stage, fault_ranks=ranks)
        return dataclasses.replace(scn, fault_ranks=tuple(_group_of(scn, kind, r)))
    if f == "one_mode":
        key = "gemm_dgrad" if rng.random() < 0.3 else "gemm_fwd"
        shape = str(rng.choice(["qkv", "proj", "fc1"])) if not scn.moe else str(rng.choice(["qkv", "proj"]))
        if key == "gemm_dgrad":
            shape = str(rng.choice(["qkv", "proj"] if scn.moe else ["qkv", "proj", "fc"]))
        return dataclasses.replace(scn, fault_ranks=(int(rng.integers(0, w)),), magnitude=mag(1.2, 1.6),
                                   onset=onset(), fault_shape=f"{key}:{shape}")
    if f == "job_regression":
        margin = max(5, n // 4)
        return dataclasses.replace(scn, magnitude=mag(1.05, 1.4), onset=int(rng.integers(margin, n - margin + 1)))
    if f == "host_stall":
        k = int(rng.integers(1, 4))
        cands = list(range(3, n - 3))
        chosen: list[int] = []
        for c in rng.permutation(cands).tolist():
            if all(abs(c - x) >= 4 for x in chosen):
                chosen.append(int(c))
            if len(chosen) == k:
                break
        return dataclasses.replace(scn, stall_steps=tuple(sorted(chosen)), magnitude=mag(2.0, 4.0))
    if f == "short_trace":
        return dataclasses.replace(scn, fault_ranks=(int(rng.integers(0, w)),), magnitude=mag(1.3, 1.6), onset=0)
    if f == "ep_straggler":
        # One expert rank's GPU runs its grouped GEMMs slow (its all-to-all peers wait for it).
        return dataclasses.replace(scn, fault_ranks=(int(rng.integers(0, w)),), magnitude=mag(1.3, 2.5),
                                   onset=onset())
    if f == "token_imbalance":
        # A healthy job whose router favours one expert position: its grouped GEMMs get `hot` times an even
        # share of the tokens, its peers fewer (tokens are conserved in an expert group); no fault.
        e = scn.ep
        hot = mag(1.3, min(3.0, 0.8 * e))
        cold = (e - hot) / (e - 1)
        pos = int(rng.integers(0, e))
        return dataclasses.replace(scn, expert_skew=tuple(hot if i == pos else cold for i in range(e)),
                                   magnitude=hot)
    return scn


def _link_kinds(dp: int, tp: int, pp: int, ep: int) -> list[str]:
    """Group kinds a degraded link can be put in: groups of >= 2 members, and >= 2 such groups to compare."""
    groups = {"tp": (tp, dp * pp), "dp": (dp, tp * pp), "pp": (pp, (pp - 1) * dp * tp), "ep": (ep, dp // ep * tp * pp)}
    return [k for k, (size, count) in groups.items() if size > 1 and count > 1]


def _small_link_kinds(dp: int, tp: int, pp: int, ep: int) -> list[str]:
    """Collective kinds (reductions, all-to-alls) whose groups are small for the link rule: 2-4 members, or
    only two groups of the kind in the job."""
    groups = {"tp": (tp, dp * pp), "dp": (dp, tp * pp), "ep": (ep, dp // ep * tp * pp)}
    return [k for k, (size, count) in groups.items() if size > 1 and count > 1 and (size <= 4 or count == 2)]


def topology_flag(scn: Scenario) -> str | None:
    """``argus import-kineto --topology`` for a scenario whose traces carry no ``pg_config`` (None otherwise):
    what its operator would pass."""
    if scn.pg_config:
        return None
    return f"dp={scn.dp},tp={scn.tp},pp={scn.pp}" + (f",ep={scn.ep}" if scn.ep > 1 else "")


def _stage_ranks(scn: Scenario, stage: int) -> list[int]:
    return list(range(stage * scn.stage_size, (stage + 1) * scn.stage_size))


def _coords(scn: Scenario, rank: int) -> tuple[int, int, int]:
    """(pp stage, dp index, tp index) of a rank in Megatron order."""
    return rank // scn.stage_size, (rank // scn.tp) % scn.dp, rank % scn.tp


def _group_of(scn: Scenario, kind: str, rank: int) -> list[int]:
    """The ranks of ``rank``'s group of ``kind`` ('tp', 'dp', 'pp' in stage order, 'ep', 'mp')."""
    s, d, t = _coords(scn, rank)

    def at(s_: int, d_: int, t_: int) -> int:
        return s_ * scn.stage_size + d_ * scn.tp + t_

    if kind == "tp":
        return [at(s, d, x) for x in range(scn.tp)]
    if kind == "dp":
        return [at(s, x, t) for x in range(scn.dp)]
    if kind == "pp":
        return [at(x, d, t) for x in range(scn.pp)]
    if kind == "ep":
        base = (d // scn.ep) * scn.ep
        return [at(s, base + x, t) for x in range(scn.ep)]
    if kind == "mp":
        return sorted(at(x, d, y) for x in range(scn.pp) for y in range(scn.tp))
    raise ValueError(kind)


# -- programs: the kernel sequence of one forward / backward chunk -----------------------------------------


@dataclass
class _Seg:
    """A run of compute kernels (``coll`` empty) or one collective on the stage."""

    names: list[int] = field(default_factory=list)
    base: list[float] = field(default_factory=list)
    fams: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    cats: list[int] = field(default_factory=list)
    args: list[int] = field(default_factory=list)
    coll: str = ""  # 'tp' | 'ep'
    coll_key: str = ""
    # Arrays, filled by _Prog.freeze().
    a_names: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    a_base: F64 = field(default_factory=lambda: np.zeros(0))
    gemm: B8 = field(default_factory=lambda: np.zeros(0, bool))
    compute: B8 = field(default_factory=lambda: np.zeros(0, bool))
    expert: B8 = field(default_factory=lambda: np.zeros(0, bool))
    mode: B8 = field(default_factory=lambda: np.zeros(0, bool))
    meta: I64 = field(default_factory=lambda: np.zeros((0, 3), np.int64))


class _Catalog:
    """Kernel names (ids), their launch args, and the scenario's durations (µs)."""

    def __init__(self, scn: Scenario) -> None:
        self.scn = scn
        arch = "sm90" if scn.name_style == "sm90" else "sm80"
        self.arch = arch
        legacy = scn.name_style == "sm80_legacy"
        c = "c10::Half" if legacy else "c10::BFloat16"
        dt = "fp16" if legacy else "bf16"
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        self.args: list[str] = []
        self.arg_ids: dict[tuple[Any, ...], int] = {}
        self.key_name: dict[str, str] = {}
        flops, bw = _PEAK[arch]
        h, t, tp = scn.hidden, scn.tokens, scn.tp
        #: one hidden x hidden GEMM on the rank's share (µs)
        self.u = 2.0 * t * h * h / tp / flops * 1e6
        #: an elementwise pass over the activations (µs)
        self.ew = t * h * 4.0 / bw * 1e6
        self.attn = 2.0 * t * min(t, 4096) * h / tp / (flops * 0.6) * 1e6
        tiles = _SM90_TILES if arch == "sm90" else _SM80_TILES

        def gemm(layout: str, i: int) -> str:
            if arch == "sm90":
                wg = "2x1x1" if tiles[i].startswith(("256", "192")) else "1x1x1"
                return _SM90_GEMM.format(l=layout, t=tiles[i], w=wg)
            return _SM80_GEMM.format(d=dt, t=tiles[i], l=layout)

        gemm_names = {"gemm_fwd": gemm("tn", 0), "gemm_fwd2": gemm("tn", 1), "gemm_dgrad": gemm("nn", 2),
                      "gemm_wgrad": gemm("nt", 0), "gemm_router": gemm("tn", 7),
                      "gemm_head": gemm("tn", 0) if scn.lm_head_shared else gemm("tn", 5),
                      "gemm_head_dgrad": gemm("nn", 2) if scn.lm_head_shared else gemm("nn", 5),
                      "gemm_head_wgrad": gemm("nt", 0) if scn.lm_head_shared else gemm("nt", 6)}
        if scn.distinct_gemm_names:
            for i, shape in enumerate(("qkv", "proj", "fc1", "fc2")):
                gemm_names[f"gemm_fwd:{shape}"] = gemm("tn", i)
                gemm_names[f"gemm_dgrad:{shape}"] = gemm("nn", (i + 2) % len(tiles))
                gemm_names[f"gemm_wgrad:{shape}"] = gemm("nt", (i + 4) % len(tiles))
        # Grouped GEMMs: CUTLASS 3 grouped problem shapes on Hopper, CUTLASS 2 GemmGrouped (the grouped_gemm
        # package) on Ampere.
        expert = (_CUTLASS90.format(s=2, t=256) if arch == "sm90" else _GROUPED80.format(m=128, n=128, k=32))
        expert_bwd = (_CUTLASS90.format(s=3, t=128) if arch == "sm90" else _GROUPED80.format(m=128, n=64, k=64))
        self.key_name.update(gemm_names)
        self.key_name.update({"gemm_expert": expert, "gemm_expert_bwd": expert_bwd})
        flash = {"attn_fwd": _FLASH_FWD, "attn_bwd": _FLASH_BWD, "attn_dot": _FLASH_DOT, "attn_cvt": _FLASH_CVT}
        for key, text in flash.items():
            self.key_name[key] = text.format(c="cutlass::half_t" if legacy else "cutlass::bfloat16_t")
        for key, tmpl in _NAMES_COMMON.items():
            self.key_name[key] = tmpl.replace("{c}", c).replace("{{", "{").replace("}}", "}")
        nccl = _NCCL_LEGACY if legacy else _NCCL_DEV
        for key, tmpl in nccl.items():
            self.key_name[key] = tmpl.format(d="half" if legacy else "bf16")
        self.key_name["memset"] = "Memset (Device)"
        self.key_name["memcpy"] = "Memcpy HtoD (Pinned -> Device)"
        self.num_sms = int(_DEVICES[arch]["numSms"])  # type: ignore[call-overload]

    def name_id(self, key: str) -> int:
        name = self.key_name[key]
        if name not in self.ids:
            self.ids[name] = len(self.names)
            self.names.append(name)
        return self.ids[name]

    def args_id(self, fam: str, work_us: float, key: str) -> int:
        """Launch configuration of a kernel (grid from its size), rendered once as the tail of ``args``."""
        if fam == "nccl":
            threads = 640 if "LL" in key else 512
            grid, block, regs, smem = (int(min(32, 2 + work_us // 20)), 1, 1), (threads, 1, 1), 96, 0
        elif fam == "gemm":
            tiles = max(1, int(work_us * 6))
            grid, block, regs, smem = (min(tiles, 65535), max(1, tiles // 65535 + 1), 1), (384, 1, 1), 168, 213_000
        elif fam == "attn":
            grid, block, regs, smem = (max(1, int(work_us)), 32, 1), (128, 1, 1), 255, 98_304
        else:
            grid, block, regs, smem = (max(1, int(work_us * 40)), 1, 1), (256, 1, 1), 32, 0
        k = (grid, block, regs, smem)
        if k not in self.arg_ids:
            blocks = grid[0] * grid[1] * grid[2]
            per_sm = blocks / self.num_sms
            warps = per_sm * block[0] / 32
            occ = int(min(100, max(1, warps / 64 * 100)))
            self.arg_ids[k] = len(self.args)
            self.args.append(f'"registers per thread":{regs},"shared memory":{smem},"blocks per SM":{per_sm:.6f},'
                             f'"warps per SM":{warps:.6f},"grid":[{grid[0]},{grid[1]},{grid[2]}],'
                             f'"block":[{block[0]},{block[1]},{block[2]}],"est. achieved occupancy %":{occ}')
        return self.arg_ids[k]


class _Prog:
    """A sequence of kernels and blocking collectives, grouped into segments."""

    def __init__(self, cat: _Catalog) -> None:
        self.cat = cat
        self.segs: list[_Seg] = [_Seg()]

    def k(self, key: str, fam: str, us: float, shape: str = "", cat: int = _CAT_KERNEL) -> None:
        s = self.segs[-1]
        scn = self.cat.scn
        if scn.distinct_gemm_names and f"{key}:{shape}" in self.cat.key_name:
            key = f"{key}:{shape}"
        s.names.append(self.cat.name_id(key))
        s.base.append(max(us, 1.5))
        s.fams.append(fam)
        s.shapes.append(shape)
        s.keys.append(key.split(":")[0])
        s.cats.append(cat)
        s.args.append(self.cat.args_id(fam, us, key))

    def coll(self, group: str, key: str, transfer_us: float) -> None:
        seg = _Seg(coll=group, coll_key=key)
        seg.names.append(self.cat.name_id(key))
        seg.base.append(max(transfer_us, 4.0))
        seg.fams.append("nccl")
        seg.shapes.append(group)
        seg.keys.append(key)
        seg.cats.append(_CAT_KERNEL)
        seg.args.append(self.cat.args_id("nccl", transfer_us, self.cat.key_name[key]))
        self.segs.extend([seg, _Seg()])

    def freeze(self, fault_shape: str, seen: set[int] | None = None) -> _Prog:
        """Arrays per segment; drops empty segments (and with ``seen``, names already used this step)."""
        out: list[_Seg] = []
        key, _, shape = fault_shape.partition(":")
        for s in self.segs:
            if seen is not None:
                keep = []
                for i, n in enumerate(s.names):
                    if n not in seen:
                        keep.append(i)
                        seen.add(n)
                for attr in ("names", "base", "fams", "shapes", "keys", "cats", "args"):
                    setattr(s, attr, [getattr(s, attr)[i] for i in keep])
            if not s.names:
                continue
            s.a_names = np.array(s.names, np.int64)
            s.a_base = np.array(s.base, np.float64)
            s.gemm = np.array([f == "gemm" for f in s.fams])
            s.compute = np.array([f in _COMPUTE_FAMILIES for f in s.fams])
            s.expert = np.array([k == "gemm_expert" or k == "gemm_expert_bwd" for k in s.keys])
            s.mode = np.array([k == key and sh == shape for k, sh in zip(s.keys, s.shapes, strict=True)])
            s.meta = np.stack([s.a_names, np.array(s.cats, np.int64), np.array(s.args, np.int64)], axis=1)
            out.append(s)
        self.segs = out
        return self

    def count(self) -> int:
        return sum(len(s.names) for s in self.segs)

    def compute_us(self) -> float:
        return float(sum(sum(b for b, f in zip(s.base, s.fams, strict=True) if f != "nccl") for s in self.segs))


@dataclass
class _Programs:
    fwd: list[_Prog]
    bwd: list[_Prog]
    head: list[_Prog]  # per stage: memset/memcpy at the step start
    cat: _Catalog
    #: per stage: kernels per step outside fwd/bwd chunks (head, p2p, DP buckets, optimizer)
    extra: list[int]
    compute_us: list[float]


def _programs(scn: Scenario) -> _Programs:
    cat = _Catalog(scn)
    u, ew, attn = cat.u, cat.ew, cat.attn
    h, t, tp, v = scn.hidden, scn.tokens, scn.tp, scn.vocab
    act_bytes = t * h * 2.0
    tp_ar = act_bytes * 2 * (tp - 1) / tp / (scn.tp_bw * 1e9) * 1e6 + 8.0
    norm_f, norm_b = ("rms_fwd", "rms_bwd") if scn.norm == "rmsnorm" else ("norm_fwd", "norm_bwd")
    gelu_f = "gelu" if scn.name_style != "sm80_legacy" else "mul"

    def tp_coll(p: _Prog, fwd: bool, first: bool) -> None:
        if tp < 2:
            return
        if scn.sequence_parallel:
            key = ("allgather" if first else "reducescatter") if fwd else ("reducescatter" if first else "allgather")
            p.coll("tp", key, tp_ar / 2 + 4.0)
        elif not first:
            p.coll("tp", "allreduce", tp_ar)

    def moe_fwd(p: _Prog) -> None:
        p.k("gemm_router", "gemm", 0.02 * u * tp + 6, "router")
        p.k("softmax", "softmax", 0.05 * ew + 5)
        p.k("topk", "softmax", 0.05 * ew + 8)
        p.k("permute", "ew", scn.topk * ew)
        if scn.ep > 1:
            p.coll("ep", "sendrecv", act_bytes * scn.topk * (scn.ep - 1) / scn.ep / (scn.ep_bw * 1e9) * 1e6 + 10)
        p.k("gemm_expert", "gemm", 2 * scn.topk * u * tp / 2, "expert_fc1")
        p.k(gelu_f, "ew", 2 * scn.topk * ew)
        p.k("gemm_expert", "gemm", 2 * scn.topk * u * tp / 2, "expert_fc2")
        if scn.ep > 1:
            p.coll("ep", "sendrecv", act_bytes * scn.topk * (scn.ep - 1) / scn.ep / (scn.ep_bw * 1e9) * 1e6 + 10)
        p.k("unpermute", "ew", scn.topk * ew)

    def moe_bwd(p: _Prog) -> None:
        p.k("permute", "ew", scn.topk * ew)
        if scn.ep > 1:
            p.coll("ep", "sendrecv", act_bytes * scn.topk * (scn.ep - 1) / scn.ep / (scn.ep_bw * 1e9) * 1e6 + 10)
        p.k("gemm_expert_bwd", "gemm", 2 * scn.topk * u * tp / 2, "expert_fc2_dgrad")
        p.k("gemm_expert_bwd", "gemm", 2 * scn.topk * u * tp / 2, "expert_fc2_wgrad")
        p.k("gelu_bwd" if gelu_f == "gelu" else "mul", "ew", 3 * scn.topk * ew)
        p.k("gemm_expert_bwd", "gemm", 2 * scn.topk * u * tp / 2, "expert_fc1_dgrad")
        p.k("gemm_expert_bwd", "gemm", 2 * scn.topk * u * tp / 2, "expert_fc1_wgrad")
        if scn.ep > 1:
            p.coll("ep", "sendrecv", act_bytes * scn.topk * (scn.ep - 1) / scn.ep / (scn.ep_bw * 1e9) * 1e6 + 10)
        p.k("unpermute", "ew", scn.topk * ew)
        p.k("gemm_router", "gemm", 0.04 * u * tp + 8, "router")

    def layer_fwd(p: _Prog) -> None:
        p.k(norm_f, "norm", 1.2 * ew)
        tp_coll(p, True, True)
        p.k("gemm_fwd", "gemm", 3 * u, "qkv")
        p.k("attn_fwd", "attn", attn)
        p.k("gemm_fwd", "gemm", u, "proj")
        tp_coll(p, True, False)
        if scn.dropout:
            p.k("dropout", "ew", 1.3 * ew)
        p.k("add", "ew", 1.5 * ew)
        p.k(norm_f, "norm", 1.2 * ew)
        if scn.moe:
            moe_fwd(p)
        else:
            tp_coll(p, True, True)
            p.k("gemm_fwd", "gemm", 4 * u, "fc1")
            p.k(gelu_f, "ew", 4 * ew / tp)
            p.k("gemm_fwd2", "gemm", 4 * u, "fc2")
            tp_coll(p, True, False)
        if scn.dropout:
            p.k("dropout", "ew", 1.3 * ew)
        p.k("add", "ew", 1.5 * ew)

    def layer_bwd(p: _Prog) -> None:
        p.k("add", "ew", 1.5 * ew)
        if scn.dropout:
            p.k("mul", "ew", 1.3 * ew)
        if scn.moe:
            moe_bwd(p)
        else:
            tp_coll(p, False, False)
            p.k("gemm_dgrad", "gemm", 4 * u, "fc")
            p.k("gemm_wgrad", "gemm", 4 * u, "fc")
            p.k("gelu_bwd" if gelu_f == "gelu" else "mul", "ew", 6 * ew / tp)
            p.k("gemm_dgrad", "gemm", 4 * u, "fc")
            p.k("gemm_wgrad", "gemm", 4 * u, "fc")
            tp_coll(p, False, True)
        p.k(norm_b, "norm", 2 * ew)
        if norm_b == "norm_bwd":
            p.k("norm_gamma", "norm", 0.6 * ew)
        p.k("add", "ew", 1.5 * ew)
        tp_coll(p, False, False)
        p.k("gemm_dgrad", "gemm", u, "proj")
        p.k("gemm_wgrad", "gemm", u, "proj")
        p.k("attn_dot", "attn", 0.04 * attn + 4)
        p.k("attn_bwd", "attn", 2.5 * attn)
        p.k("attn_cvt", "attn", 0.05 * attn + 4)
        p.k("gemm_dgrad", "gemm", 3 * u, "qkv")
        p.k("gemm_wgrad", "gemm", 3 * u, "qkv")
        tp_coll(p, False, True)
        p.k(norm_b, "norm", 2 * ew)
        if norm_b == "norm_bwd":
            p.k("norm_gamma", "norm", 0.6 * ew)

    fwd, bwd, head, extra, comp = [], [], [], [], []
    full_head_u = 2.0 * t * h * v / tp / _PEAK[cat.arch][0] * 1e6
    head_u = scn.head_ratio * 12.0 * u * scn.layers
    loss_ew = t * v / tp * 8.0 / _PEAK[cat.arch][1] * 1e6 * head_u / full_head_u
    for s in range(scn.pp):
        first, last = s == 0, s == scn.pp - 1
        seen: set[int] | None = set() if scn.unique_names else None
        hd = _Prog(cat)
        hd.k("memset", "mem", 0.4 * ew + 2, cat=_CAT_MEMSET)
        if first or last:
            hd.k("memcpy", "mem", t * 8 / 20e9 * 1e6 + 3, cat=_CAT_MEMCPY)
        f = _Prog(cat)
        if first:
            f.k("embed_fwd", "embed", 1.0 * ew)
            if scn.dropout:
                f.k("dropout", "ew", 1.3 * ew)
        for _ in range(scn.layers):
            layer_fwd(f)
        if last:
            f.k(norm_f, "norm", 1.2 * ew)
            f.k("gemm_head", "gemm", head_u, "lm_head")
            f.k("loss_softmax", "loss", loss_ew)
            if tp > 1:
                f.coll("tp", "allreduce_max", 12.0)
                f.coll("tp", "allreduce_f32", 14.0)
            f.k("loss_nll", "loss", 6.0)
        b = _Prog(cat)
        if last:
            b.k("loss_nll_bwd", "loss", 6.0)
            b.k("loss_softmax_bwd", "loss", 1.5 * loss_ew)
            b.k("gemm_head_dgrad", "gemm", head_u, "lm_head")
            b.k("gemm_head_wgrad", "gemm", head_u, "lm_head")
            b.k(norm_b, "norm", 2 * ew)
        for _ in range(scn.layers):
            layer_bwd(b)
        if first:
            b.k("embed_bwd", "embed", 3.0 * ew)
        hd.freeze(scn.fault_shape, seen)
        f.freeze(scn.fault_shape, seen)
        b.freeze(scn.fault_shape, seen)
        compute = scn.microbatches * (f.compute_us() + b.compute_us())
        n_p2p = (0 if first else 2) + (0 if last else 2)
        n_dp = scn.dp_buckets * (2 if scn.distributed_optimizer else 1)
        n_opt = 6 if not scn.unique_names else 3
        extra.append(hd.count() + scn.microbatches * n_p2p + n_dp + n_opt + (1 if scn.grad_norm_allreduce else 0))
        fwd.append(f)
        bwd.append(b)
        head.append(hd)
        comp.append(compute)
    return _Programs(fwd, bwd, head, cat, extra, comp)


def estimate_kernel_events(scn: Scenario) -> int:
    """Kernel events (all ranks, all steps) the scenario will write."""
    progs = _programs(scn)
    per_step = sum(scn.stage_size * (scn.microbatches * (progs.fwd[s].count() + progs.bwd[s].count())
                                     + progs.extra[s]) for s in range(scn.pp))
    return per_step * scn.steps


# -- simulation --------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    """The simulated job: one row per kernel (all ranks), times in µs from the trace start."""

    scn: Scenario
    names: list[str]
    args: list[str]
    rank: I64
    name: I64
    stream: I64
    cat: I64
    argid: I64
    step: I64  # step index (0-based)
    chunk: I64  # id of the forward/backward/optimizer chunk (-1: none)
    phase: I64  # 0 none, 1 forward, 2 backward, 3 optimizer
    coll: I64  # collective kind id (-1 for compute), see COLL_KINDS
    start: F64
    dur: F64
    #: per (step, rank): host ProfilerStep start and where the host starts launching (µs)
    cpu_start: F64
    launch_base: F64
    #: per rank: where the host leaves the last step (its ProfilerStep end, µs)
    cpu_end: F64
    #: per kernel: tokens routed to the rank's experts in a forward grouped GEMM (-1 for other kernels)
    tokens: I64 = field(default_factory=lambda: np.zeros(0, np.int64))

    COLL_KINDS = ("allreduce", "allreduce_f32", "allreduce_max", "reducescatter", "reducescatter_f32", "allgather",
                  "alltoall", "send", "recv")

    def iteration_us(self) -> F64:
        """Per step: the job's iteration time (max over ranks of the host step span), µs."""
        nxt = np.vstack([self.cpu_start[1:], self.cpu_end[None, :]])
        return np.asarray((nxt - self.cpu_start).max(axis=1), dtype=np.float64)

    def select(self, rank: int) -> npt.NDArray[np.intp]:
        """Indices of one rank's kernels, by start time."""
        idx = np.flatnonzero(self.rank == rank)
        return idx[np.argsort(self.start[idx], kind="stable")]


class _Sim:
    def __init__(self, scn: Scenario) -> None:
        self.scn = scn
        self.rng = np.random.default_rng(scn.seed)
        self.progs = _programs(scn)
        self.cat = self.progs.cat
        w, ns = scn.world, scn.stage_size
        self.ns = ns
        sig = scn.noise
        self.persist = self.rng.lognormal(0.0, sig / 4, w)
        self.rank_step = self.rng.lognormal(0.0, sig / 5, (scn.steps, w))
        self.step_shared = self.rng.lognormal(0.0, sig / 4, scn.steps)
        self.t = np.zeros(w)
        #: (stage, micro-batch) -> its forward's routed load, until its backward reads it
        self.mb_load: dict[tuple[int, int], F64] = {}
        self.streams = {kind: scn.nccl_stream_base + off for kind, off in NCCL_STREAMS.items()}
        self.free = {k: np.zeros(w) for k in self.streams}
        self.blocks: list[tuple[I64, I64, F64, F64]] = []  # (ranks, meta rows [n, 8], start, dur)
        #: per block (by index) whose kernels route tokens: tokens per kernel and rank (-1: none)
        self.tokens: dict[int, I64] = {}
        self.chunk_id = 0
        # Link degradation multipliers per stage (shape of the group reduction), from the onset.
        self.link: dict[tuple[str, int], npt.NDArray[np.float64]] = {}
        if scn.fault in LINK_FAULTS:
            m: npt.NDArray[np.float64]
            r0 = scn.fault_ranks[0]
            s, d, t_ = _coords(scn, r0)
            if scn.fault_group == "tp":
                m = np.ones((scn.dp, 1))
                m[d, 0] = scn.magnitude
            elif scn.fault_group == "dp":
                m = np.ones((1, scn.tp))
                m[0, t_] = scn.magnitude
            elif scn.fault_group == "ep":
                m = np.ones((scn.dp // scn.ep, 1, scn.tp))
                m[d // scn.ep, 0, t_] = scn.magnitude
            else:
                m = np.ones(ns)
                m[r0 % ns] = scn.magnitude
            self.link[(scn.fault_group, s)] = m
        self.coll_code = {k: i for i, k in enumerate(Timeline.COLL_KINDS)}
        # Its own stream: every other draw of a seed stays what it was before members' ends were spread.
        self.coend_rng = np.random.default_rng([scn.seed, 13])

    # -- recording --

    def _record(self, ranks: I64, meta: I64, start: F64, dur: F64) -> None:
        self.blocks.append((ranks, meta, start, dur))

    def _meta(self, names: I64, cats: I64, args: I64, stream: int, step: int, chunk: int, phase: int,
              coll: int) -> I64:
        n = names.shape[0]
        m = np.empty((n, 8), np.int64)
        m[:, 0], m[:, 1], m[:, 2], m[:, 3] = names, cats, args, stream
        m[:, 4], m[:, 5], m[:, 6], m[:, 7] = step, chunk, phase, coll
        return m

    # -- fault multipliers --

    def _fault(self, seg: _Seg, s: int, n: int, bwd: bool) -> F64 | None:
        scn = self.scn
        if scn.fault in ("healthy", "host_stall", "token_imbalance", *LINK_FAULTS) or n < scn.onset:
            return None
        ranks = np.arange(s * self.ns, (s + 1) * self.ns)
        if scn.fault in ("compute_straggler", "short_trace", "one_mode", "slow_host", "ep_straggler"):
            rmask = np.isin(ranks, scn.fault_ranks)
            if not rmask.any():
                return None
            omask = (seg.mode if scn.fault == "one_mode" else seg.expert if scn.fault == "ep_straggler"
                     else seg.compute if scn.all_compute else seg.gemm)
        elif scn.fault == "stage_slow":
            if s != scn.fault_stage or not bwd:
                return None
            rmask, omask = np.ones(self.ns, bool), seg.compute
        elif scn.fault == "job_regression":
            rmask, omask = np.ones(self.ns, bool), seg.compute
        else:  # pragma: no cover
            return None
        if not omask.any():
            return None
        return np.where(omask[:, None] & rmask[None, :], scn.magnitude, 1.0)

    def _link(self, kind: str, s: int, n: int, shape: tuple[int, ...]) -> F64 | float:
        m = self.link.get((kind, s))
        if m is None or n < self.scn.onset:
            return 1.0
        return m.reshape(shape)

    # -- collectives --

    def _collective(self, kind: str, key: str, transfer: float, s: int | None, n: int, arrive: F64,
                    chunk: int, phase: int, coll: str) -> F64:
        """Members of each group of ``kind`` arrive at ``arrive`` (stage ``s`` slice, or the world for s None);
        returns the common end per rank and records the kernels."""
        scn = self.scn
        dp, tp, ep, pp = scn.dp, scn.tp, scn.ep, scn.pp
        lead = 1 if s is not None else pp
        a = arrive.reshape(lead, dp, tp)
        if kind == "tp":
            g = a.max(axis=2, keepdims=True)
        elif kind == "dp":
            g = a.max(axis=1, keepdims=True)
        elif kind == "ep":
            g = a.reshape(lead, dp // ep, ep, tp).max(axis=2, keepdims=True)
        else:  # 'mp': same dp index across stages and TP ranks
            g = a.max(axis=(0, 2), keepdims=True)
        jit = self.rng.lognormal(0.0, scn.noise / 2, g.shape)
        mult: Any = 1.0
        if s is not None:
            if kind == "tp":
                mult = self._link("tp", s, n, (1, dp, 1))
            elif kind == "dp":
                mult = self._link("dp", s, n, (1, 1, tp))
            elif kind == "ep":
                mult = self._link("ep", s, n, (1, dp // ep, 1, tp))
        elif kind == "dp":
            mult = np.ones((pp, 1, tp))
            for st in range(pp):
                mult[st] = self._link("dp", st, n, (1, tp))
        end_g = g + transfer * jit * mult
        if kind == "ep":
            end = np.broadcast_to(end_g, (lead, dp // ep, ep, tp)).reshape(-1)
        else:
            end = np.broadcast_to(end_g, a.shape).reshape(-1)
        if scn.coend_jitter_us > 0:  # the members' last hops: each ends within the jitter of the group's end
            end = end + self.coend_rng.uniform(0.0, scn.coend_jitter_us, end.shape)
        ranks = (np.arange(s * self.ns, (s + 1) * self.ns) if s is not None else np.arange(scn.world))
        name = self.cat.name_id(key)
        argid = self.cat.args_id("nccl", transfer, self.cat.key_name[key])
        meta = self._meta(np.array([name]), np.array([_CAT_KERNEL]), np.array([argid]),
                          self.streams[kind], n, chunk, phase, self.coll_code[coll])
        self._record(ranks, meta, arrive[None, :].copy(), (end - arrive)[None, :])
        return end

    # -- a chunk (forward or backward of one microbatch on one stage) --

    def _chunk(self, prog: _Prog, s: int, n: int, bwd: bool, phase: int, mb: int = -1) -> tuple[F64, F64]:
        scn = self.scn
        sl = slice(s * self.ns, (s + 1) * self.ns)
        ranks = np.arange(sl.start, sl.stop)
        t = self.t[sl].copy()
        t0 = t.copy()
        chunk = self.chunk_id
        self.chunk_id += 1
        rank_f = self.persist[sl] * self.rank_step[n, sl] * self.step_shared[n]
        load = self._routing() if scn.moe else None
        if load is not None and mb >= 0:
            # A micro-batch's backward runs the experts on the tokens its forward routed them (the draw is made
            # all the same, so that every other draw of a scenario stays what it was).
            load = self.mb_load.pop((s, mb)) if bwd else self.mb_load.setdefault((s, mb), load)
        tokens = np.rint(scn.tokens * scn.topk * load).astype(np.int64) if load is not None else None
        for seg in prog.segs:
            if seg.coll:
                arrive = np.maximum(t, self.free[seg.coll][sl])
                key = seg.coll_key
                coll = "alltoall" if seg.coll == "ep" else key
                end = self._collective(seg.coll, key, float(seg.a_base[0]), s, n, arrive, chunk, phase, coll)
                self.free[seg.coll][sl] = end
                t = end + self.rng.lognormal(np.log(2.0), 0.3, self.ns)
                continue
            k = seg.a_names.shape[0]
            d = seg.a_base[:, None] * rank_f[None, :] * self.rng.lognormal(0.0, scn.noise, (k, self.ns))
            fm = self._fault(seg, s, n, bwd)
            if fm is not None:
                d *= fm
            if load is not None and seg.expert.any():
                d *= np.where(seg.expert[:, None], load[None, :], 1.0)
            if scn.outlier_rate:
                hit = self.rng.random((k, self.ns)) < scn.outlier_rate
                if hit.any():
                    d = np.where(hit, d * self.rng.uniform(2.0, 5.0, (k, self.ns)), d)
            gap = self.rng.lognormal(np.log(2.5), 0.35, (k, self.ns))
            inc = d + gap
            cum = np.cumsum(inc, axis=0)
            starts = t[None, :] + cum - inc
            meta = np.empty((k, 8), np.int64)
            meta[:, :3] = seg.meta
            meta[:, 3], meta[:, 4], meta[:, 5], meta[:, 6], meta[:, 7] = COMPUTE_STREAM, n, chunk, phase, -1
            self._record(ranks, meta, starts, d)
            if tokens is not None and seg.expert.any():
                fwd = seg.expert & np.array([k == "gemm_expert" for k in seg.keys])
                self.tokens[len(self.blocks) - 1] = np.where(fwd[:, None], tokens[None, :], -1)
            t = t + cum[-1]
        self.t[sl] = t
        return t0, t

    def _routing(self) -> F64:
        """Per rank of a stage: the tokens its experts get in one chunk over an even share. Each expert group
        routes its tokens among its members (``expert_skew`` persistently, wandering per chunk), so the shares
        of a group average 1: tokens are conserved."""
        scn = self.scn
        dp, tp, ep = scn.dp, scn.tp, scn.ep
        raw = self.rng.lognormal(0.0, scn.routing_noise, self.ns).reshape(dp // ep, ep, tp)
        if scn.expert_skew:
            raw = raw * np.asarray(scn.expert_skew)[None, :, None]
        return np.asarray((raw / raw.mean(axis=1, keepdims=True)).reshape(-1), dtype=np.float64)

    def _p2p(self, s_from: int, s_to: int, post_send: F64, n: int, m: int) -> None:
        """Send/recv of microbatch ``m`` from stage ``s_from`` to the adjacent ``s_to``; the receiver blocks."""
        scn = self.scn
        to, fr = slice(s_to * self.ns, (s_to + 1) * self.ns), slice(s_from * self.ns, (s_from + 1) * self.ns)
        fwd = s_to > s_from
        rs, ss = ("pp_prev", "pp_next") if fwd else ("pp_next", "pp_prev")
        recv_post = np.maximum(self.t[to], self.free[rs][to])
        send_eff = np.maximum(post_send, self.free[ss][fr])
        pair = min(s_from, s_to)
        mult = self._link("pp", pair, n, (self.ns,))
        transfer = scn.tokens * scn.hidden * 2.0 / (scn.pp_bw * 1e9) * 1e6 + 6.0
        end = np.maximum(recv_post, send_eff) + transfer * self.rng.lognormal(0.0, scn.noise / 2, self.ns) * mult
        name = self.cat.name_id("sendrecv")
        argid = self.cat.args_id("nccl", transfer, self.cat.key_name["sendrecv"])
        for sl, post, stream_kind, coll in ((to, recv_post, rs, "recv"), (fr, send_eff, ss, "send")):
            ranks = np.arange(sl.start, sl.stop)
            meta = self._meta(np.array([name]), np.array([_CAT_KERNEL]), np.array([argid]),
                              self.streams[stream_kind], n, -1, _PH_NONE, self.coll_code[coll])
            self._record(ranks, meta, post[None, :].copy(), (end - post)[None, :])
            self.free[stream_kind][sl] = end
        self.t[to] = end + self.rng.lognormal(np.log(3.0), 0.3, self.ns)

    def _schedule(self, s: int) -> list[tuple[str, int]]:
        scn = self.scn
        mb = scn.microbatches
        if scn.schedule == "gpipe":
            return [("F", m) for m in range(mb)] + [("B", m) for m in range(mb)]
        warm = min(scn.pp - s - 1, mb)
        ops = [("F", m) for m in range(warm)]
        f, b = warm, 0
        while f < mb:
            ops += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        ops += [("B", m) for m in range(b, mb)]
        return ops

    def _step(self, n: int) -> None:
        scn = self.scn
        pp, ns = scn.pp, self.ns
        for s in range(pp):  # memset / memcpy at the step start
            self._chunk(self.progs.head[s], s, n, False, _PH_NONE)
        ops = [self._schedule(s) for s in range(pp)]
        ptr = [0] * pp
        done: set[tuple[str, int, int]] = set()
        sent: dict[tuple[str, int, int], F64] = {}
        last_b: dict[int, tuple[F64, F64]] = {}
        while any(ptr[s] < len(ops[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                while ptr[s] < len(ops[s]):
                    kind, m = ops[s][ptr[s]]
                    dep = (("F", s - 1, m) if kind == "F" and s > 0 else ("B", s + 1, m)
                           if kind == "B" and s < pp - 1 else None)
                    if dep is not None and dep not in done:
                        break
                    if dep is not None:
                        self._p2p(dep[1], s, sent.pop(dep), n, m)
                    if kind == "F":
                        self._chunk(self.progs.fwd[s], s, n, False, _PH_FWD, m)
                    else:
                        last_b[s] = self._chunk(self.progs.bwd[s], s, n, True, _PH_BWD, m)
                    sl = slice(s * ns, (s + 1) * ns)
                    if (kind == "F" and s < pp - 1) or (kind == "B" and s > 0):
                        sent[(kind, s, m)] = self.t[sl].copy()
                    done.add((kind, s, m))
                    ptr[s] += 1
                    progressed = True
            if not progressed:  # pragma: no cover - a valid schedule never deadlocks
                raise RuntimeError("pipeline schedule deadlocked")
        self._step_end(n, last_b)

    def _step_end(self, n: int, last_b: dict[int, tuple[F64, F64]]) -> None:
        scn = self.scn
        w, nb = scn.world, scn.dp_buckets
        b0 = np.concatenate([last_b[s][0] for s in range(scn.pp)])
        b1 = np.concatenate([last_b[s][1] for s in range(scn.pp)])
        comp = np.repeat(np.array(self.progs.compute_us), self.ns)
        dp_total = float(np.median(comp)) * scn.dp_ratio * (scn.dp - 1) / max(scn.dp, 1)
        rs_key = "reducescatter_f32" if scn.distributed_optimizer else "allreduce_f32"
        if scn.dp > 1:
            for b in range(nb):
                arrive = np.maximum(b0 + (b + 1) / nb * (b1 - b0), self.free["dp"])
                self.free["dp"] = self._collective("dp", rs_key, dp_total / nb, None, n, arrive, -1, _PH_NONE,
                                                   rs_key)
        self.t = np.maximum(self.t, self.free["dp"]) + self.rng.lognormal(np.log(4.0), 0.3, w)
        opt_total = float(np.median(comp)) * scn.opt_ratio
        chunk = self.chunk_id
        self.chunk_id += 1
        rank_f = self.persist * self.rank_step[n] * self.step_shared[n]
        meta_of = {key: (self.cat.name_id(key), self.cat.args_id("opt", opt_total * frac, key))
                   for key, frac in (("opt_l2norm", 0.15), ("opt_adam", 0.75 / 4), ("opt_scale", 0.1))}
        keys = ["opt_l2norm", "mp", "opt_adam", "opt_adam", "opt_adam", "opt_adam", "opt_scale"]
        if scn.unique_names:
            keys = ["opt_l2norm", "mp", "opt_adam", "opt_scale"]
        fracs = {"opt_l2norm": 0.15, "opt_adam": 0.75 / (keys.count("opt_adam")), "opt_scale": 0.1}
        if n >= scn.onset and scn.fault == "job_regression":
            rank_f = rank_f * scn.magnitude
        for key in keys:
            if key == "mp":
                if scn.grad_norm_allreduce:
                    end = self._collective("mp", "allreduce_f32", 15.0, None, n, np.maximum(self.t, self.free["mp"]),
                                           chunk, _PH_OPT, "allreduce_f32")
                    self.free["mp"] = end
                    self.t = end + 2.0
                continue
            name, argid = meta_of[key]
            d = opt_total * fracs[key] * rank_f * self.rng.lognormal(0.0, scn.noise, w)
            if scn.fault in ("compute_straggler", "slow_host") and scn.all_compute and n >= scn.onset:
                d = np.where(np.isin(np.arange(w), scn.fault_ranks), d * scn.magnitude, d)
            meta = self._meta(np.array([name]), np.array([_CAT_KERNEL]), np.array([argid]), COMPUTE_STREAM, n,
                              chunk, _PH_OPT, -1)
            self._record(np.arange(w), meta, self.t[None, :].copy(), d[None, :])
            self.t = self.t + d + self.rng.lognormal(np.log(2.5), 0.3, w)
        if scn.distributed_optimizer and scn.dp > 1:
            for _ in range(nb):
                arrive = np.maximum(self.t, self.free["dp"])
                self.free["dp"] = self._collective("dp", "allgather", dp_total / nb / 2, None, n, arrive, -1,
                                                   _PH_NONE, "allgather")
            self.t = np.maximum(self.t, self.free["dp"])

    def run(self) -> Timeline:
        scn = self.scn
        w = scn.world
        cpu_start = np.zeros((scn.steps, w))
        launch_base = np.zeros((scn.steps, w))
        host = np.full(w, 1000.0) + self.rng.uniform(0, 50, w)
        prev_iter = None
        for n in range(scn.steps):
            cpu_start[n] = host
            stall = 0.0
            if n in scn.stall_steps and prev_iter is not None:
                stall = (scn.magnitude - 1.0) * prev_iter
            launch_base[n] = host + stall + self.rng.lognormal(np.log(40.0), 0.4, w)
            self.t = launch_base[n] + self.rng.lognormal(np.log(12.0), 0.3, w)
            for k in self.free:
                self.free[k] = np.minimum(self.free[k], self.t)
            self._step(n)
            end = np.maximum.reduce([self.t, *self.free.values()])
            host = end + scn.host_overhead_us * self.rng.lognormal(0.0, 0.2, w)
            it = float((host - cpu_start[n]).max())
            prev_iter = it if prev_iter is None or n not in scn.stall_steps else prev_iter
        ranks = np.concatenate([np.tile(r, m.shape[0]) for r, m, _, _ in self.blocks])
        meta = np.concatenate([np.repeat(m, r.shape[0], axis=0) for r, m, _, _ in self.blocks])
        start = np.concatenate([s.reshape(-1) for _, _, s, _ in self.blocks])
        dur = np.concatenate([d.reshape(-1) for _, _, _, d in self.blocks])
        routed = np.concatenate([self.tokens[i].reshape(-1) if i in self.tokens else np.full(d.size, -1, np.int64)
                                 for i, (_, _, _, d) in enumerate(self.blocks)])
        return Timeline(scn=scn, names=list(self.cat.names), args=list(self.cat.args), rank=ranks,
                        name=meta[:, 0], cat=meta[:, 1], argid=meta[:, 2], stream=meta[:, 3], step=meta[:, 4],
                        chunk=meta[:, 5], phase=meta[:, 6], coll=meta[:, 7], start=start, dur=dur,
                        cpu_start=cpu_start, launch_base=launch_base, cpu_end=np.asarray(host, np.float64),
                        tokens=routed)


def simulate(scn: Scenario) -> Timeline:
    """Run the scenario's discrete-event timeline (deterministic for a scenario)."""
    return _Sim(scn).run()


# -- truth and scoring -------------------------------------------------------------------------------------


#: Least delay per step, as a share of the median iteration time, of a finding argus raises (its default
#: ``min_impact_fraction``): a rank-level fault costing less is not required (but tolerated).
MIN_IMPACT_FRACTION = 0.01


def fault_delay_fraction(scn: Scenario, tl: Timeline | None = None) -> float | None:
    """For a rank-level fault (compute_straggler, one_mode, short_trace): the GPU time the fault adds per step
    to its most affected rank, over the job's median iteration time, from a twin run without the fault (same
    seed: every other duration is identical). For a degraded link: the lesser of the collective time it adds
    per step to the group's least affected member (the transfer alone) and the growth of the median iteration
    time (a transfer hidden behind compute costs the job nothing). None for other classes."""
    link = scn.fault in LINK_FAULTS
    if scn.fault not in ("compute_straggler", "one_mode", "short_trace", "slow_host", "ep_straggler", *LINK_FAULTS) \
            or not scn.fault_ranks:
        return None
    tl = tl if tl is not None else simulate(scn)
    twin = simulate(dataclasses.replace(scn, magnitude=1.0))
    if twin.dur.shape != tl.dur.shape:
        return None
    extra = []
    for r in scn.fault_ranks:
        sel = (tl.rank == r) & ((tl.coll >= 0) if link else (tl.coll < 0)) & (tl.step >= scn.onset)
        steps = max(int(np.unique(tl.step[sel]).size), 1)
        extra.append(float(tl.dur[sel].sum() - twin.dur[sel].sum()) / steps)
    it = tl.iteration_us()
    if link:
        growth = float(np.median(it[scn.onset:]) - np.median(twin.iteration_us()[scn.onset:]))
        return min(min(extra), growth) / float(np.median(it))
    return max(extra) / float(np.median(it))


def expected_findings(scn: Scenario, iteration_us: Sequence[float] | None = None,
                      delay_fraction: float | None = None) -> dict[str, Any]:
    """The expected diagnosis of a scenario (what ``truth.json`` holds besides the scenario).

    ``expected``: findings that must be there, each ``{"kinds", "ranks", "steps", "onset"}`` (ranks ``[]`` for
    job-level findings; steps and onset in ``ProfilerStep`` numbers, or null). For a rank-level entry the union of
    the ranks named by findings of those kinds must equal ``ranks``; for ``step_regression`` one finding's onset
    must be within ``onset_tolerance`` steps; for ``iteration_spike`` every listed step must be within
    ``step_tolerance`` of a finding's step and no finding step may be farther from all of them.
    ``optional``: findings that may be there (not required, not false), among them a job regression whose
    iteration time grew by less than 5 %, and a step regression at the onset of any fault that slowed the
    job. ``tolerated``: rank-level findings of
    these kinds naming only these ranks are not false. Anything else is a false finding. ``max_incidents``: the
    most incidents (findings grouped by ``incident_id``, see ``docs/incidents.md``) the findings may form (a slow
    host: 1), None for no limit; an entry's ``hosts``: the hosts its finding must name. ``delay_fraction``
    (:func:`fault_delay_fraction`): a rank-level or link fault costing under :data:`MIN_IMPACT_FRACTION` of
    the step is below what argus raises (a finding must cost at least that), so it is tolerated, not required.
    """
    f = scn.fault
    exp: list[dict[str, Any]] = []
    opt: list[dict[str, Any]] = []
    tol: list[dict[str, Any]] = []
    incidents: int | None = None
    onset_step = scn.step_number(scn.onset)
    growth = None
    if iteration_us is not None and scn.onset > 0 and len(iteration_us) > scn.onset:
        it = np.asarray(iteration_us)
        growth = float(np.median(it[scn.onset:]) / np.median(it[:scn.onset]) - 1.0)
    regression_ok = growth is not None and growth >= 0.05
    if f in ("compute_straggler", "one_mode", "short_trace", "ep_straggler"):
        entry = {"kinds": list(RANK_KINDS), "ranks": list(scn.fault_ranks), "steps": None,
                 "onset": onset_step if f != "short_trace" else None}
        if delay_fraction is not None and delay_fraction < MIN_IMPACT_FRACTION:
            tol.append({"kinds": list(RANK_KINDS), "ranks": list(scn.fault_ranks)})  # below the impact threshold
        else:
            exp.append(entry)
    elif f == "slow_host":
        # One incident: the host (node_degraded naming its ranks), its ranks' and kernels' findings its members.
        if delay_fraction is not None and delay_fraction < MIN_IMPACT_FRACTION:
            tol.append({"kinds": ["node_degraded", *RANK_KINDS, "phase_straggler"], "ranks": list(scn.fault_ranks)})
        else:
            exp.append({"kinds": ["node_degraded"], "ranks": list(scn.fault_ranks), "steps": None, "onset": None,
                        "hosts": [host_name(scn, scn.fault_ranks[0])]})
            tol.append({"kinds": [*RANK_KINDS, "phase_straggler"], "ranks": list(scn.fault_ranks)})
            incidents = 1
    elif f == "stage_slow":
        exp.append({"kinds": ["pp_stage_slow"], "ranks": list(scn.fault_ranks), "steps": None, "onset": onset_step})
        tol.append({"kinds": [*RANK_KINDS, "phase_straggler"], "ranks": list(scn.fault_ranks)})
    elif f in LINK_FAULTS:
        entry = {"kinds": ["link_degraded"], "ranks": list(scn.fault_ranks), "steps": None, "onset": onset_step}
        if delay_fraction is not None and delay_fraction < MIN_IMPACT_FRACTION:
            tol.append({"kinds": ["link_degraded"], "ranks": list(scn.fault_ranks)})
        else:
            exp.append(entry)
    elif f == "job_regression":
        entry = {"kinds": ["step_regression"], "ranks": [], "steps": None, "onset": onset_step}
        # The contract is a sustained growth of 5 % or more; a smaller one (the drawn magnitude applies to
        # part of the step only) may be raised but is not required.
        (exp if growth is None or regression_ok else opt).append(entry)
    elif f == "host_stall":
        exp.append({"kinds": ["iteration_spike"], "ranks": [], "steps": [scn.step_number(s) for s in scn.stall_steps],
                    "onset": None})
    # The fault slows the job from its onset on: a step regression there names a real slowdown, whether or not
    # it reaches the 5 % that job_regression requires (as a smaller job_regression, it may be raised).
    if growth is not None and growth > 0.0 and f in ("compute_straggler", "one_mode", "stage_slow", "slow_host",
                                                        "ep_straggler", *LINK_FAULTS):
        opt.append({"kinds": ["step_regression"], "ranks": [], "steps": None, "onset": onset_step})
    return {"expected": exp, "optional": opt, "tolerated": tol, "onset_tolerance": 2, "step_tolerance": 1,
            "iteration_growth": growth, "fault_delay_fraction": delay_fraction, "max_incidents": incidents}


def host_name(scn: Scenario, rank: int) -> str:
    """The ``host_name`` the traces of ``rank`` carry (:data:`GPUS_PER_NODE` ranks a host)."""
    fmt = str(np.random.default_rng([scn.seed, 7, 1]).choice(_HOST_FORMATS))
    return fmt.format(rank // GPUS_PER_NODE)


def incident_ids(findings: Iterable[Mapping[str, Any]]) -> set[str]:
    """The incidents ``findings`` (``--json`` objects) form: their ``incident_id``s, a finding without one (written
    before incidents existed) its own incident."""
    return {str(f.get("incident_id") or f.get("finding_id") or id(f)) for f in findings}


def _job_match(entry: Mapping[str, Any], finding: Mapping[str, Any], truth: Mapping[str, Any]) -> bool:
    steps = [int(s) for s in finding.get("steps") or []]
    if entry.get("onset") is not None and entry.get("steps") is None:
        onset = int(entry["onset"])
        return bool(steps) and abs(steps[0] - onset) <= int(truth.get("onset_tolerance", 2))
    if entry.get("steps") is not None:
        tol = int(truth.get("step_tolerance", 1))
        return bool(steps) and all(any(abs(s - e) <= tol for e in entry["steps"]) for s in steps)
    return True


def score_findings(truth: Mapping[str, Any], findings: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Score a job's findings (``argus findings --json`` objects) against its truth (:func:`expected_findings`).

    Returns ``exact`` (every expected finding there, no false finding), ``false`` (the false findings),
    ``missing`` (expected entries not satisfied), and the (kind class, rank) pairs for precision/recall:
    ``tp``, ``fp`` and ``fn`` counts (job-level findings count as rank -1; optional/tolerated ones are neutral);
    more incidents than the truth's ``max_incidents`` is a missing entry ``{"max_incidents", "incidents"}``.
    """
    findings = list(findings)
    expected = list(truth.get("expected", []))
    optional = list(truth.get("optional", []))
    tolerated = list(truth.get("tolerated", []))
    named: list[set[int]] = [set() for _ in expected]
    hit = [False] * len(expected)
    false: list[dict[str, Any]] = []
    predicted: set[tuple[str, int]] = set()
    neutral: set[tuple[str, int]] = set()
    for f in findings:
        kind = str(f.get("kind"))
        ranks = {int(r) for r in f.get("ranks") or []}
        cls = KIND_CLASS.get(kind, kind)
        pairs = {(cls, r) for r in ranks} if ranks else {(cls, -1)}
        matched = False
        for i, e in enumerate(expected):
            if kind not in e["kinds"]:
                continue
            if e.get("hosts") and sorted(f.get("hosts") or []) != sorted(e["hosts"]):
                continue
            if e["ranks"] and ranks and ranks <= set(e["ranks"]):
                named[i] |= ranks
                matched = True
            elif not e["ranks"] and not ranks and _job_match(e, f, truth):
                hit[i] = True
                matched = True
        if matched:
            predicted |= pairs
            continue
        ok = any(kind in e["kinds"] and (ranks <= set(e["ranks"]) if e["ranks"] else
                                          (not ranks and _job_match(e, f, truth))) for e in optional)
        ok = ok or any(kind in e["kinds"] and ranks and ranks <= set(e["ranks"]) for e in tolerated)
        if ok:
            neutral |= pairs
            continue
        false.append({k: f.get(k) for k in ("level", "kind", "ranks", "phase", "kernel", "stream", "steps", "score")})
        predicted |= pairs
    missing = []
    truth_pairs: set[tuple[str, int]] = set()
    for i, e in enumerate(expected):
        cls = KIND_CLASS.get(e["kinds"][0], e["kinds"][0])
        if e["ranks"]:
            truth_pairs |= {(cls, int(r)) for r in e["ranks"]}
            ok = named[i] == set(e["ranks"])
        else:
            truth_pairs.add((cls, -1))
            ok = hit[i]
            if ok and e.get("steps") is not None:
                tol = int(truth.get("step_tolerance", 1))
                got = {int(s) for f in findings if f.get("kind") in e["kinds"] and not f.get("ranks")
                       for s in f.get("steps") or []}
                ok = all(any(abs(s - g) <= tol for g in got) for s in e["steps"])
        if not ok:
            missing.append({**e, "named": sorted(named[i])})
    incidents = len(incident_ids(findings))
    if truth.get("max_incidents") is not None and incidents > int(truth["max_incidents"]):
        missing.append({"max_incidents": int(truth["max_incidents"]), "incidents": incidents})
    predicted -= neutral - truth_pairs
    tp = len(predicted & truth_pairs)
    return {"exact": not false and not missing, "false": false, "missing": missing, "tp": tp,
            "fp": len(predicted - truth_pairs), "fn": len(truth_pairs - predicted)}


# -- writing -----------------------------------------------------------------------------------------------


def _pg_table(scn: Scenario) -> list[list[dict[str, Any]]]:
    """Per rank: the process groups it belongs to, numbered (``pg_name``, ``uid``) in the order every rank
    creates them (Megatron: all groups of a kind, by lowest member), ``default_pg`` first."""
    w = scn.world
    out: list[list[dict[str, Any]]] = [[{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                                         "pg_size": w, "ranks": list(range(w)), "uid": 0}] for _ in range(w)]
    kinds: list[tuple[str, str]] = [("dp", "DATA_PARALLEL_GROUP"), ("tp", "TENSOR_MODEL_PARALLEL_GROUP"),
                                    ("pp", "PIPELINE_MODEL_PARALLEL_GROUP")]
    if scn.extra_pgs:
        kinds.insert(1, ("dp", "DATA_PARALLEL_GROUP_WITH_CP"))
        kinds.insert(3, ("mp", "MODEL_PARALLEL_GROUP"))
    if scn.moe:
        kinds.append(("ep", "EXPERT_MODEL_PARALLEL_GROUP"))
    uid = 1
    for kind, desc in kinds:
        groups: dict[int, list[int]] = {}
        placed: set[int] = set()
        for r in range(w):
            if r not in placed:
                g = _group_of(scn, kind, r)
                groups[min(g)] = g
                placed.update(g)
        for _, g in sorted(groups.items()):
            pg = {"pg_name": str(uid), "pg_desc": desc, "backend_config": "cuda:nccl", "pg_size": len(g),
                  "ranks": g, "uid": uid}
            for r in g:
                out[r].append(pg)
            uid += 1
    if scn.extra_pgs and scn.pp > 1:
        for r in range(scn.stage_size):
            pipe = _group_of(scn, "pp", r)
            emb = [pipe[0], pipe[-1]]
            pg = {"pg_name": str(uid), "pg_desc": "EMBEDDING_GROUP", "backend_config": "cuda:nccl", "pg_size": 2,
                  "ranks": emb, "uid": uid}
            for x in emb:
                out[x].append(pg)
            uid += 1
    return out


def _ts(ns: I64) -> list[str]:
    """Integer ns to µs strings with exactly three decimals (exact at any magnitude)."""
    q, r = np.divmod(ns, 1000)
    return [f"{a}.{b:03d}" for a, b in zip(q.tolist(), r.tolist(), strict=True)]


def _spans(keys: I64, lo: I64, hi: I64) -> tuple[I64, I64, I64]:
    """Per distinct key: (key, min lo, max hi)."""
    uk, inv = np.unique(keys, return_inverse=True)
    a = np.full(uk.shape[0], np.iinfo(np.int64).max)
    b = np.full(uk.shape[0], np.iinfo(np.int64).min)
    np.minimum.at(a, inv, lo)
    np.maximum.at(b, inv, hi)
    return uk, a, b


#: Megatron's description of each process-group kind (``pg_config``), as the generator names them.
_PG_DESC = {"tp": "TENSOR_MODEL_PARALLEL_GROUP", "dp": "DATA_PARALLEL_GROUP", "ep": "EXPERT_MODEL_PARALLEL_GROUP",
            "pp": "PIPELINE_MODEL_PARALLEL_GROUP", "mp": "MODEL_PARALLEL_GROUP"}


def _stream_pg_args(scn: Scenario, r: int, pgs: list[dict[str, Any]]) -> dict[int, str]:
    """Per NCCL stream of rank ``r``: the process-group args PyTorch 2.3+ writes into its kernels (a JSON
    fragment), from the rank's ``pg_config`` entries ``pgs``."""
    out = {}
    for stream_kind, off in NCCL_STREAMS.items():
        kind = "pp" if stream_kind.startswith("pp_") else stream_kind
        if kind == "ep" and not scn.moe:
            continue
        stream, desc = scn.nccl_stream_base + off, _PG_DESC[kind]
        ranks = _group_of(scn, kind, r)
        name = next((str(g["pg_name"]) for g in pgs if g["pg_desc"] == desc), f"{kind}{min(ranks)}")
        out[stream] = (f'"Process Group Name":"{name}","Process Group Description":"{desc}",'
                       f'"Process Group Ranks":"{ranks}","Group size":{len(ranks)},')
    return out


def _rank_events(tl: Timeline, r: int, idx: npt.NDArray[np.intp], base_ns: int, pid: int,
                 rng: np.random.Generator, name_json: list[str], pgs: list[dict[str, Any]]) -> list[str]:
    """One rank's trace events as JSON texts; ``idx``: its kernels in ``tl``, by start time; ``pgs``: its
    ``pg_config`` entries."""
    scn = tl.scn
    pg_args = _stream_pg_args(scn, r, pgs) if scn.pg_args else {}
    dev = r % GPUS_PER_NODE
    tid = pid
    start = np.rint(tl.start[idx] * 1000).astype(np.int64)
    end = np.rint((tl.start[idx] + tl.dur[idx]) * 1000).astype(np.int64)
    dur = end - start
    step = tl.step[idx]
    # Host launches: from where the host starts launching, launch_us apart, never after the kernel's start.
    lb = np.rint(tl.launch_base[step, r] * 1000).astype(np.int64)
    first = np.searchsorted(step, step, side="left")
    pos = np.arange(idx.shape[0]) - first
    lc = int(scn.launch_us * 1000)
    launch = np.minimum(lb + pos * lc, start - 1000)
    launch = np.maximum.accumulate(launch)
    launch = np.minimum(launch, start - 300)
    ldur = np.clip(np.diff(launch, append=launch[-1] + lc) - 200, 300, int(lc * 0.7))
    corr0 = int(rng.integers(1_000, 500_000))
    corr = (corr0 + np.arange(idx.shape[0]) * 2).tolist()
    ext = [c // 2 for c in corr]
    shift = base_ns if scn.absolute_ts else 0
    s_ts, d_ts, l_ts, ld_ts = _ts(start + shift), _ts(dur), _ts(launch + shift), _ts(ldur)
    cats = tl.cat[idx].tolist()
    streams = tl.stream[idx].tolist()
    names = tl.name[idx].tolist()
    argid = tl.argid[idx].tolist()
    ev: list[str] = []
    # Host: ProfilerStep spans.
    cs = np.rint(tl.cpu_start[:, r] * 1000).astype(np.int64)
    ce = np.append(cs[1:], np.rint(tl.cpu_end[r] * 1000)).astype(np.int64)
    for n, (a, b) in enumerate(zip(_ts(cs + shift), _ts(ce - cs), strict=True)):
        ev.append(f'{{"ph":"X","cat":"user_annotation","name":"ProfilerStep#{scn.step_number(n)}","pid":{pid},'
                  f'"tid":{tid},"ts":{a},"dur":{b},"args":{{"External id":{n + 1}}}}}')
    rt = {_CAT_KERNEL: ("cudaLaunchKernel", 211), _CAT_MEMCPY: ("cudaMemcpyAsync", 41),
          _CAT_MEMSET: ("cudaMemsetAsync", 51)}
    for i in range(idx.shape[0]):
        rname, cbid = rt[cats[i]]
        ev.append(f'{{"ph":"X","cat":"cuda_runtime","name":"{rname}","pid":{pid},"tid":{tid},"ts":{l_ts[i]},'
                  f'"dur":{ld_ts[i]},"args":{{"External id":{ext[i]},"cbid":{cbid},"correlation":{corr[i]}}}}}')
    if scn.token_counts and tl.tokens.size:
        # The grouped GEMM's op around its launch, with its input shapes (record_shapes): tokens x hidden, the
        # rank's experts' weights, the tokens per expert (their values are not recorded, only their shape).
        tok = tl.tokens[idx]
        local = max(1, 8 // scn.ep)
        ffn = 4 * scn.hidden // scn.tp
        for i in np.flatnonzero(tok >= 0).tolist():
            a, b = _ts(np.array([launch[i] - 2000 + shift, int(ldur[i]) + 4000]))
            ev.append(f'{{"ph":"X","cat":"cpu_op","name":"GroupedGemm","pid":{pid},"tid":{tid},"ts":{a},"dur":{b},'
                      f'"args":{{"External id":{ext[i]},"Sequence number":{ext[i]},"Fwd thread id":0,'
                      f'"Input Dims":[[{int(tok[i])},{scn.hidden}],[{local},{scn.hidden},{ffn}],[{local}],[]],'
                      f'"Input type":["c10::BFloat16","c10::BFloat16","long int","Scalar"]}}}}')
    # Phase annotations (CPU around the launches, GPU mirror on the compute stream).
    if scn.annotate_phases:
        names3 = _PHASE_NAMES[scn.phase_style]
        ph = tl.phase[idx]
        sel = (ph > 0) & (tl.stream[idx] == COMPUTE_STREAM)
        if sel.any():
            ch = tl.chunk[idx][sel]
            uk, lo, hi = _spans(ch, launch[sel], launch[sel] + ldur[sel])
            _, glo, ghi = _spans(ch, start[sel], end[sel])
            kind = {int(c): int(p) for c, p in zip(ch.tolist(), ph[sel].tolist(), strict=True)}
            for c, a, b, ga, gb in zip(uk.tolist(), lo.tolist(), hi.tolist(), glo.tolist(), ghi.tolist(),
                                       strict=True):
                nm = names3[kind[c] - 1]
                (ta, tb), (gta, gtb) = _ts(np.array([a + shift, b - a])), _ts(np.array([ga + shift, gb - ga]))
                ev.append(f'{{"ph":"X","cat":"user_annotation","name":"{nm}","pid":{pid},"tid":{tid},"ts":{ta},'
                          f'"dur":{tb},"args":{{"External id":{c + 10_000_000}}}}}')
                ev.append(f'{{"ph":"X","cat":"gpu_user_annotation","name":"{nm}","pid":{dev},'
                          f'"tid":{COMPUTE_STREAM},"ts":{gta},"dur":{gtb},"args":{{"External id":{c + 10_000_000}}}}}')
    if scn.nccl_annotations:
        coll = tl.coll[idx]
        for i in np.flatnonzero(coll >= 0).tolist():
            kind_s = Timeline.COLL_KINDS[coll[i]]
            if kind_s in ("send", "recv"):
                nxt = scn.nccl_stream_base + NCCL_STREAMS["pp_next"]
                other = r + scn.stage_size if streams[i] == nxt else r - scn.stage_size
                nm = f"nccl:send {r}->{other}" if kind_s == "send" else f"nccl:recv {r}<-{other}"
            else:
                nm = _NCCL_ANN[kind_s]
            ev.append(f'{{"ph":"X","cat":"user_annotation","name":"{nm}","pid":{pid},"tid":{tid},"ts":{l_ts[i]},'
                      f'"dur":{ld_ts[i]},"args":{{"External id":{ext[i]}}}}}')
            ev.append(f'{{"ph":"X","cat":"gpu_user_annotation","name":"{nm}","pid":{dev},"tid":{streams[i]},'
                      f'"ts":{s_ts[i]},"dur":{d_ts[i]},"args":{{"External id":{ext[i]}}}}}')
    # GPU: kernels, memcpy, memset.
    for i in range(idx.shape[0]):
        c = cats[i]
        if c == _CAT_KERNEL:
            ev.append(f'{{"ph":"X","cat":"kernel","name":{name_json[names[i]]},"pid":{dev},"tid":{streams[i]},'
                      f'"ts":{s_ts[i]},"dur":{d_ts[i]},"args":{{"External id":{ext[i]},"queued":0,"device":{dev},'
                      f'"context":1,"stream":{streams[i]},"correlation":{corr[i]},{pg_args.get(streams[i], "")}'
                      f'{tl.args[argid[i]]}}}}}')
        else:
            nbytes = int(dur[i]) * (20 if c == _CAT_MEMCPY else 800)
            gbps = nbytes / max(int(dur[i]), 1)
            ev.append(f'{{"ph":"X","cat":"{"gpu_memcpy" if c == _CAT_MEMCPY else "gpu_memset"}",'
                      f'"name":{name_json[names[i]]},"pid":{dev},"tid":{streams[i]},"ts":{s_ts[i]},"dur":{d_ts[i]},'
                      f'"args":{{"External id":{ext[i]},"device":{dev},"context":1,"stream":{streams[i]},'
                      f'"correlation":{corr[i]},"bytes":{nbytes},"memory bandwidth (GB/s)":{gbps:.3f}}}}}')
    if scn.gpu_step_annotations:
        key = step * 1024 + tl.stream[idx]
        uk, lo, hi = _spans(key, start, end)
        for k, a, b in zip(uk.tolist(), lo.tolist(), hi.tolist(), strict=True):
            (ta, tb) = _ts(np.array([a + shift, b - a]))
            ev.append(f'{{"ph":"X","cat":"gpu_user_annotation","name":"ProfilerStep#{scn.step_number(k // 1024)}",'
                      f'"pid":{dev},"tid":{k % 1024},"ts":{ta},"dur":{tb},"args":{{"External id":{k // 1024 + 1}}}}}')
    if scn.flows:
        for i in range(idx.shape[0]):
            ev.append(f'{{"ph":"s","id":{corr[i]},"pid":{pid},"tid":{tid},"ts":{l_ts[i]},"cat":"ac2g",'
                      f'"name":"ac2g"}}')
            ev.append(f'{{"ph":"f","id":{corr[i]},"pid":{dev},"tid":{streams[i]},"ts":{s_ts[i]},"cat":"ac2g",'
                      f'"name":"ac2g","bp":"e"}}')
    first_ts = _ts(np.array([int(cs[0]) - 500_000 + shift, int(ce[-1] - cs[0]) + 1_000_000]))
    ev.append(f'{{"ph":"X","cat":"Trace","ts":{first_ts[0]},"dur":{first_ts[1]},"pid":"Spans",'
              f'"tid":"PyTorch Profiler","name":"PyTorch Profiler (0)","args":{{"Op count":0}}}}')
    ev.append(f'{{"name":"process_name","ph":"M","ts":{first_ts[0]},"pid":{pid},"tid":0,"args":{{"name":"python"}}}}')
    ev.append(f'{{"name":"process_name","ph":"M","ts":{first_ts[0]},"pid":{dev},"tid":0,'
              f'"args":{{"name":"python"}}}}')
    ev.append(f'{{"name":"process_labels","ph":"M","ts":{first_ts[0]},"pid":{dev},"tid":0,'
              f'"args":{{"labels":"GPU {dev}"}}}}')
    ev.append(f'{{"name":"thread_name","ph":"M","ts":{first_ts[0]},"pid":{pid},"tid":{tid},'
              f'"args":{{"name":"thread {tid} (python)"}}}}')
    for st in sorted(set(streams)):
        ev.append(f'{{"name":"thread_name","ph":"M","ts":{first_ts[0]},"pid":{dev},"tid":{st},'
                  f'"args":{{"name":"stream {st}"}}}}')
    return ev


def write_scenario(scn: Scenario, out_dir: Path, timeline: Timeline | None = None) -> Path:
    """Write ``out_dir/traces/rank-<r>.pt.trace.json[.gz]`` (one Kineto trace per rank) and
    ``out_dir/truth.json``; returns the traces folder (what ``argus import-kineto`` reads)."""
    out_dir = Path(out_dir)
    traces = out_dir / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    tl = timeline if timeline is not None else simulate(scn)
    rng = np.random.default_rng([scn.seed, 7])
    base_ns = 1_764_000_000_000_000_000 + int(rng.integers(0, 10**15))
    name_json = [json.dumps(n) for n in tl.names]
    arch = "sm90" if scn.name_style == "sm90" else "sm80"
    devices = [{"id": i, **_DEVICES[arch]} for i in range(GPUS_PER_NODE)]
    rng.choice(_HOST_FORMATS)  # drawn here before host_name() had its own stream: later draws stay as they were
    pids = rng.integers(1000, 4_000_000, scn.world)
    table = _pg_table(scn)
    order = np.lexsort((tl.start, tl.rank))
    bounds = np.searchsorted(tl.rank[order], np.arange(scn.world + 1))
    for r in range(scn.world):
        pgs = table[r]
        info: dict[str, Any] = {"backend": "nccl", "rank": r, "world_size": scn.world,
                                "nccl_version": "2.21.5" if arch == "sm90" else "2.18.3"}
        if scn.pg_config:
            info |= {"pg_count": len(pgs), "pg_config": pgs}
        head = {"schemaVersion": 1, "deviceProperties": devices, "distributedInfo": info,
                "record_shapes": int(scn.token_counts), "with_stack": 0, "host_name": host_name(scn, r),
                "trace_id": f"{scn.seed:08X}{r:08X}"}
        tail: dict[str, Any] = {"traceName": f"/tmp/trace/rank-{r}.pt.trace.json", "displayTimeUnit": "ms"}
        if not scn.absolute_ts:
            tail["baseTimeNanoseconds"] = base_ns
        ev = _rank_events(tl, r, order[bounds[r]:bounds[r + 1]], base_ns, int(pids[r]), rng, name_json, pgs)
        text = (json.dumps(head)[:-1] + ',\n  "traceEvents": [\n  ' + ",\n  ".join(ev) + "\n  ],\n"
                + json.dumps(tail)[1:] + "\n")
        path = traces / f"rank-{r}.pt.trace.json"
        if scn.compress:
            with gzip.open(path.with_suffix(".json.gz"), "wt", encoding="utf-8", compresslevel=1) as fh:
                fh.write(text)
        else:
            path.write_text(text, encoding="utf-8")
    truth = {"scenario": scn.to_json(), "kernel_events": int(tl.rank.shape[0]),
             "iteration_ms": [round(float(x) / 1000, 3) for x in tl.iteration_us()],
             **expected_findings(scn, tl.iteration_us().tolist(), fault_delay_fraction(scn, tl))}
    (out_dir / "truth.json").write_text(json.dumps(truth, indent=1), encoding="utf-8")
    return traces


def _cli() -> None:  # pragma: no cover - a convenience for looking at one scenario
    import argparse
    import time

    ap = argparse.ArgumentParser(description="write one randomized Kineto scenario")
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", choices=FAULT_CLASSES, default=None)
    ap.add_argument("--max-ranks", type=int, default=512)
    a = ap.parse_args()
    t0 = time.perf_counter()
    scn = Scenario.from_seed(a.seed, a.fault, a.max_ranks)
    tl = simulate(scn)
    t1 = time.perf_counter()
    write_scenario(scn, a.out, tl)
    print(json.dumps({"world": scn.world, "kernel_events": int(tl.rank.shape[0]), "simulate_s": round(t1 - t0, 2),
                      "write_s": round(time.perf_counter() - t1, 2), "scenario": scn.to_json()}))


if __name__ == "__main__":  # pragma: no cover
    _cli()
