# AOT ID: ['1_inference']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
import triton
import triton.language as tl
from torch._inductor.runtime.triton_heuristics import start_graph, end_graph
from torch._C import _cuda_getCurrentRawStream as get_raw_stream

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p


# kernel path: /tmp/torchinductor_root/nm/cnmtg4cq4c2t3hkzbegypxxwvr74gpnies6ps5afjwybmmiiu56s.py
# Topologically Sorted Source Nodes: [reshape, rshift, stack, and_, reshape_1, long_1, levels, view_1, long, getitem_2, repeat_interleave, mul, absmax, getitem_4, mul_1, reshape_2, to], Original ATen: [aten.view, aten.__rshift__, aten.stack, aten.bitwise_and, aten._to_copy, aten.index, aten.unsqueeze, aten.expand, aten.clone, aten.mul, aten.add]
# Source node to ATen node mapping:
#   absmax => add
#   and_ => bitwise_and
#   getitem_2 => index
#   getitem_4 => unsqueeze_3
#   levels => index_1
#   long => convert_element_type
#   long_1 => convert_element_type_1
#   mul => mul
#   mul_1 => mul_1
#   repeat_interleave => clone, expand, unsqueeze_2, view_3
#   reshape => view
#   reshape_1 => view_2
#   reshape_2 => view_5
#   rshift => rshift
#   stack => cat, unsqueeze, unsqueeze_1
#   to => convert_element_type_2
#   view_1 => view_4
# Graph fragment:
#   %arg0_1 : Tensor "u8[2097152, 1][1, 1]cuda:0" = PlaceHolder[target=arg0_1]
#   %arg5_1 : Tensor "f32[16][1]cuda:0" = PlaceHolder[target=arg5_1]
#   %arg2_1 : Tensor "u8[65536][1]cuda:0" = PlaceHolder[target=arg2_1]
#   %arg3_1 : Tensor "f32[256][1]cuda:0" = PlaceHolder[target=arg3_1]
#   %arg1_1 : Tensor "f32[256][1]cuda:0" = PlaceHolder[target=arg1_1]
#   %arg4_1 : Tensor "f32[][]cuda:0" = PlaceHolder[target=arg4_1]
#   %view : Tensor "u8[2097152][1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.reshape.default](args = (%arg0_1, [-1]), kwargs = {})
#   %rshift : Tensor "u8[2097152][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.__rshift__.Scalar](args = (%view, 4), kwargs = {})
#   %unsqueeze : Tensor "u8[2097152, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%rshift, 1), kwargs = {})
#   %bitwise_and : Tensor "u8[2097152][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.bitwise_and.Scalar](args = (%view, 15), kwargs = {})
#   %unsqueeze_1 : Tensor "u8[2097152, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%bitwise_and, 1), kwargs = {})
#   %cat : Tensor "u8[2097152, 2][2, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%unsqueeze, %unsqueeze_1], -1), kwargs = {})
#   %view_2 : Tensor "u8[4194304][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%cat, [-1]), kwargs = {})
#   %convert_element_type_1 : Tensor "i64[4194304][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%view_2, torch.int64), kwargs = {})
#   %index_1 : Tensor "f32[4194304][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.index.Tensor](args = (%arg5_1, [%convert_element_type_1]), kwargs = {})
#   %view_4 : Tensor "f32[65536, 64][64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%index_1, [65536, 64]), kwargs = {})
#   %convert_element_type : Tensor "i64[65536][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%arg2_1, torch.int64), kwargs = {})
#   %index : Tensor "f32[65536][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.index.Tensor](args = (%arg3_1, [%convert_element_type]), kwargs = {})
#   %unsqueeze_2 : Tensor "f32[256, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%arg1_1, 1), kwargs = {})
#   %expand : Tensor "f32[256, 256][1, 0]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.expand.default](args = (%unsqueeze_2, [256, 256]), kwargs = {})
#   %clone : Tensor "f32[256, 256][256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.clone.default](args = (%expand,), kwargs = {memory_format: torch.contiguous_format})
#   %view_3 : Tensor "f32[65536][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%clone, [65536]), kwargs = {})
#   %mul : Tensor "f32[65536][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%index, %view_3), kwargs = {})
#   %add : Tensor "f32[65536][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul, %arg4_1), kwargs = {})
#   %unsqueeze_3 : Tensor "f32[65536, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%add, 1), kwargs = {})
#   %mul_1 : Tensor "f32[65536, 64][64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%view_4, %unsqueeze_3), kwargs = {})
#   %view_5 : Tensor "f32[4194304][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mul_1, [-1]), kwargs = {})
#   %convert_element_type_2 : Tensor "bf16[4194304][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%view_5, torch.bfloat16), kwargs = {})
#   return %convert_element_type_2
triton_poi_fused___rshift____to_copy_add_bitwise_and_clone_expand_index_mul_stack_unsqueeze_view_0 = async_compile.triton('triton_poi_fused___rshift____to_copy_add_bitwise_and_clone_expand_index_mul_stack_unsqueeze_view_0', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 4194304}, 
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*u8', 'in_ptr1': '*fp32', 'in_ptr2': '*u8', 'in_ptr3': '*fp32', 'in_ptr4': '*fp32', 'in_ptr5': '*fp32', 'out_ptr0': '*bf16', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused___rshift____to_copy_add_bitwise_and_clone_expand_index_mul_stack_unsqueeze_view_0', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 5, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 18940928}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused___rshift____to_copy_add_bitwise_and_clone_expand_index_mul_stack_unsqueeze_view_0(in_ptr0, in_ptr1, in_ptr2, in_ptr3, in_ptr4, in_ptr5, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 4194304
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = tl.full([XBLOCK], True, tl.int1)[:]
    x0 = xindex
    tmp26 = tl.load(in_ptr2 + (x0 // 64), None, eviction_policy='evict_last')
    tmp34 = tl.load(in_ptr4 + (x0 // 16384), None, eviction_policy='evict_last')
    tmp36 = tl.load(in_ptr5 + (0))
    tmp37 = tl.broadcast_to(tmp36, [XBLOCK])
    tmp0 = (((x0 % 64)) % 2)
    tmp1 = tl.full([1], 0, tl.int64)
    tmp2 = tmp0 >= tmp1
    tmp3 = tl.full([1], 1, tl.int64)
    tmp4 = tmp0 < tmp3
    tmp5 = tl.load(in_ptr0 + (32*(x0 // 64) + (((x0 % 64)) // 2)), tmp4, eviction_policy='evict_last', other=0.0)
    tmp6 = tl.full([1], 4, tl.uint8)
    tmp7 = tmp5 >> tmp6
    tmp8 = tl.full(tmp7.shape, 0.0, tmp7.dtype)
    tmp9 = tl.where(tmp4, tmp7, tmp8)
    tmp10 = tmp0 >= tmp3
    tmp11 = tl.full([1], 2, tl.int64)
    tmp12 = tmp0 < tmp11
    tmp13 = tl.load(in_ptr0 + (32*(x0 // 64) + (((x0 % 64)) // 2)), tmp10, eviction_policy='evict_last', other=0.0)
    tmp14 = tl.full([1], 15, tl.uint8)
    tmp15 = tmp13 & tmp14
    tmp16 = tl.full(tmp15.shape, 0.0, tmp15.dtype)
    tmp17 = tl.where(tmp10, tmp15, tmp16)
    tmp18 = tl.where(tmp4, tmp9, tmp17)
    tmp19 = tmp18.to(tl.int64)
    tmp20 = tl.full([XBLOCK], 16, tl.int32)
    tmp21 = tmp19 + tmp20
    tmp22 = tmp19 < 0
    tmp23 = tl.where(tmp22, tmp21, tmp19)
    tl.device_assert((0 <= tmp23) & (tmp23 < 16), "index out of bounds: 0 <= tmp23 < 16")
    tmp25 = tl.load(in_ptr1 + (tmp23), None, eviction_policy='evict_last')
    tmp27 = tmp26.to(tl.int64)
    tmp28 = tl.full([XBLOCK], 256, tl.int32)
    tmp29 = tmp27 + tmp28
    tmp30 = tmp27 < 0
    tmp31 = tl.where(tmp30, tmp29, tmp27)
    tl.device_assert((0 <= tmp31) & (tmp31 < 256), "index out of bounds: 0 <= tmp31 < 256")
    tmp33 = tl.load(in_ptr3 + (tmp31), None, eviction_policy='evict_last')
    tmp35 = tmp33 * tmp34
    tmp38 = tmp35 + tmp37
    tmp39 = tmp25 * tmp38
    tmp40 = tmp39.to(tl.float32)
    tl.store(out_ptr0 + (x0), tmp40, None)
''', device_str='cuda')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1 = args
        args.clear()
        assert_size_stride(arg0_1, (2097152, 1), (1, 1))
        assert_size_stride(arg1_1, (256, ), (1, ))
        assert_size_stride(arg2_1, (65536, ), (1, ))
        assert_size_stride(arg3_1, (256, ), (1, ))
        assert_size_stride(arg4_1, (), ())
        assert_size_stride(arg5_1, (16, ), (1, ))
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf0 = empty_strided_cuda((4194304, ), (1, ), torch.bfloat16)
            # Topologically Sorted Source Nodes: [reshape, rshift, stack, and_, reshape_1, long_1, levels, view_1, long, getitem_2, repeat_interleave, mul, absmax, getitem_4, mul_1, reshape_2, to], Original ATen: [aten.view, aten.__rshift__, aten.stack, aten.bitwise_and, aten._to_copy, aten.index, aten.unsqueeze, aten.expand, aten.clone, aten.mul, aten.add]
            stream0 = get_raw_stream(0)
            triton_poi_fused___rshift____to_copy_add_bitwise_and_clone_expand_index_mul_stack_unsqueeze_view_0.run(arg0_1, arg5_1, arg2_1, arg3_1, arg1_1, arg4_1, buf0, 4194304, stream=stream0)
            del arg0_1
            del arg1_1
            del arg2_1
            del arg3_1
            del arg4_1
            del arg5_1
        return (buf0, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = rand_strided((2097152, 1), (1, 1), device='cuda:0', dtype=torch.uint8)
    arg1_1 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.float32)
    arg2_1 = rand_strided((65536, ), (1, ), device='cuda:0', dtype=torch.uint8)
    arg3_1 = rand_strided((256, ), (1, ), device='cuda:0', dtype=torch.float32)
    arg4_1 = rand_strided((), (), device='cuda:0', dtype=torch.float32)
    arg5_1 = rand_strided((16, ), (1, ), device='cuda:0', dtype=torch.float32)
    return [arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
