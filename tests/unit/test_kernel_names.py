"""Kernel-name normalization: renames collapse, different kernels stay apart, the function is idempotent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.producers.kernel_names import MAX_LEN, demangle, memcpy_name, normalize

SAME = [
    # NCCL <= 2.18, >= 2.19 (plain, demangled with arguments, mangled) and 2.4-era spellings
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16", "nccl:AllReduce:Sum:bf16:RING:LL"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl:AllReduce:Sum:bf16:RING:LL"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl:AllReduce:Sum:bf16:RING:LL"),
    ("_Z40ncclDevKernel_AllReduce_Sum_bf16_RING_LL24ncclDevKernelArgsStorageILm4096EE",
     "nccl:AllReduce:Sum:bf16:RING:LL"),
    ("ncclAllReduceRingLLKernel_sum_bf16", "nccl:AllReduce:Sum:bf16:RING:LL"),
    ("void ncclKernel_AllReduce_TREE_LL128_Sum_float(ncclWorkElem)", "nccl:AllReduce:Sum:f32:TREE:LL128"),
    ("ncclDevKernel_AllReduce_Sum_f32_TREE_LL128", "nccl:AllReduce:Sum:f32:TREE:LL128"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "nccl:AllGather:RING:LL"),
    ("ncclDevKernel_AllGather_RING_LL", "nccl:AllGather:RING:LL"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", "nccl:SendRecv:RING:SIMPLE"),
    ("ncclDevKernel_Generic", "nccl:Generic"),
    ("ncclDevKernel_AllReduce_Sum_f16_COLLNET_DIRECT_SIMPLE", "nccl:AllReduce:Sum:f16:COLLNET_DIRECT:SIMPLE"),
    ("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_half", "nccl:ReduceScatter:Sum:f16:RING:SIMPLE"),
    # memory operations (Kineto spellings)
    ("Memcpy HtoD (Pageable -> Device)", "memcpy:HtoD"),
    ("Memcpy DtoD (Device -> Device)", "memcpy:DtoD"),
    ("Memset (Device)", "memset"),
    # C++: return type, argument list, literal suffixes and spacing go; template arguments stay
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)",
     "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1>>"),
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEENS_6detail5ArrayIPcLi1EEEEEviT0_T1_",
     "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1>>"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>"
     "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8::Params)",
     "cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>"),
    ("void foo<(unsigned int)4, 8ul, char *>(int)", "foo<4, 8, char*>"),
    ("void at::native::elementwise_kernel<128, 2, at::native::(anonymous namespace)::GeluCUDAKernelImpl("
     "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#1}::operator()() const::{lambda(float)#1}>"
     "(int, at::native::(anonymous namespace)::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)"
     "::{lambda()#1}::operator()() const::{lambda(float)#1})",
     "at::native::elementwise_kernel<128, 2, at::native::GeluCUDAKernelImpl::{lambda()#1}::{lambda(float)#1}>"),
    # plain identifiers are kept
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas",
     "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas"),
    ("triton_poi_fused_add_0", "triton_poi_fused_add_0"),
    ("  spaced \t name ", "spaced name"),
    ("", "<unnamed>"),
]

DIFFERENT = [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclDevKernel_AllReduce_Sum_bf16_TREE_LL"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL128"),
    ("ncclDevKernel_AllGather_RING_LL", "ncclDevKernel_AllGatherV_RING_LL"),
    ("ncclDevKernel_Reduce_Sum_f32_RING_LL", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
     "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_64x3_tn"),
    ("void cutlass::Kernel<cutlass_80_tensorop_s16816gemm_bf16_64x64_32x6_tn_align8>(Params)",
     "void cutlass::Kernel<cutlass_80_tensorop_s16816gemm_bf16_128x128_32x3_tn_align8>(Params)"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>, true>(Flash_fwd_params)",
     "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, false>, true>(Flash_fwd_params)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
     "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)",
     "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>, at::detail::Array<char*, 3> >"
     "(int, at::native::AddFunctor<float>, at::detail::Array<char*, 3>)"),
    ("void k<{lambda(float)#1}>(int)", "void k<{lambda(c10::BFloat16)#1}>(int)"),
    ("Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (Device -> Pageable)"),
    ("triton_poi_fused_add_0", "triton_poi_fused_add_1"),
]


@pytest.mark.parametrize(("raw", "expected"), SAME)
def test_known_spellings(raw: str, expected: str) -> None:
    assert normalize(raw) == expected
    assert normalize(expected) == expected


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_different_kernels_stay_apart(a: str, b: str) -> None:
    assert normalize(a) != normalize(b)


def test_memcpy_names_match_the_kineto_spelling() -> None:
    assert memcpy_name(1) == normalize("Memcpy HtoD (Pinned -> Device)") == "memcpy:HtoD"
    assert memcpy_name(8) == "memcpy:DtoD"
    assert memcpy_name(99) == "memcpy:unknown"


def test_demangle_passes_non_symbols_through() -> None:
    assert demangle("not_mangled") == "not_mangled"
    assert demangle("_Zgarbage!") == "_Zgarbage!"


def test_long_names_are_capped_and_distinct() -> None:
    a = "k<" + ", ".join(str(i) for i in range(400)) + ">"
    b = "k<" + ", ".join(str(i) for i in range(401)) + ">"
    na, nb = normalize(a), normalize(b)
    assert len(na) <= MAX_LEN and len(nb) <= MAX_LEN
    assert na != nb
    assert normalize(na) == na


_ALPHABET = st.sampled_from([
    *"abcXYZ_019 <>(),:*&#{}~",
    "nccl", "Kernel", "ncclDevKernel_", "ncclKernel_", "AllReduce", "Sum", "bf16", "RING", "LL", "void ",
    "lambda", "operator()", " const", "(anonymous namespace)::", "ul", "Memcpy ", "Memset", "_Z", "::", "nccl:",
])
NAMES = st.lists(_ALPHABET, max_size=30).map("".join)


@settings(max_examples=800, deadline=None)
@given(NAMES)
def test_idempotent(name: str) -> None:
    once = normalize(name)
    assert normalize(once) == once
    assert isinstance(once, str) and once


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_idempotent_on_any_text(name: str) -> None:
    once = normalize(name)
    assert normalize(once) == once


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["AllReduce", "ReduceScatter", "Reduce"]), st.sampled_from(["Sum", "Max", "Min", "Prod"]),
       st.sampled_from([("bfloat16", "bf16"), ("half", "f16"), ("float", "f32"), ("double", "f64"),
                        ("int8_t", "i8"), ("uint64_t", "u64")]),
       st.sampled_from(["RING", "TREE", "NVLS", "COLLNET_DIRECT"]), st.sampled_from(["LL", "LL128", "SIMPLE"]))
def test_nccl_renames_agree(coll: str, op: str, dtype: tuple[str, str], algo: str, proto: str) -> None:
    old = f"ncclKernel_{coll}_{algo}_{proto}_{op}_{dtype[0]}"
    new = f"ncclDevKernel_{coll}_{op}_{dtype[1]}_{algo}_{proto}"
    assert normalize(old) == normalize(new) == f"nccl:{coll}:{op}:{dtype[1]}:{algo}:{proto}"
