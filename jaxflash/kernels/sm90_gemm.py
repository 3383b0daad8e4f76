"""Hopper (sm_90a) kernel plumbing: variant checks, shared storage and tile layouts, tensor views,
TMA prefetch, WGMMA issue and smem stores.

Imports cutlass and jaxflash.config only. Shared by the forward and backward kernels.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import LayoutEnum

from jaxflash import config

# config.KERNEL_DTYPES -> the element types of the kernels.
DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16,
          "float8_e4m3fn": cutlass.Float8E4M3FN}
# Each shared buffer starts on a 1 KiB boundary: the 128B swizzle pattern repeats every 1 KiB.
SMEM_ALIGN = 1024
# sm_90 opt-in shared memory per block: 227 KiB (the schedule table sizes tiles by it too).
SMEM_CAPACITY = config.SMEM_BYTES
WARPGROUP_THREADS = 128
WARP_THREADS = 32
# The directions of the 16-bit kernels, as their can_implement names them.
_DIRECTION_NAMES = {"fwd": "forward", "bwd": "backward", "decode": "decode"}


def variant_support(variant: config.KernelVariant, direction: str) -> tuple[bool, str]:
  """can_implement of a 16-bit kernel of `direction`: (ok, reason) for the variant, whose
  direction must be that one; config.kernel_support decides the rest."""
  if variant.direction != direction:
    return False, f"variant {variant.key} is not a {_DIRECTION_NAMES[direction]} variant"
  return config.kernel_support(direction, variant.dtype, variant.head_dim, variant.head_dim_v)


def mma_slices(tiled_mmas, mma_tidx, wg_idx):
  """(per-thread slices, warpgroup slices) of the consumers' tiled MMAs; mma_tidx: the thread's
  index among the consumer warpgroups, wg_idx: its warpgroup's (warp-uniform).

  Shared-memory operand descriptors are the same for every thread of a warpgroup: slicing the
  operands with the warpgroup's first thread, a warp-uniform value, keeps their address math on
  the uniform datapath (no R2UR before each HGMMA). Accumulators take the per-thread slices.
  """
  per_thread = tuple(t.get_slice(mma_tidx) for t in tiled_mmas)
  return per_thread, tuple(t.get_slice(wg_idx * WARPGROUP_THREADS) for t in tiled_mmas)


def smem_aligned(num_bytes: int) -> int:
  """num_bytes rounded up to SMEM_ALIGN (a buffer's footprint in the shared-memory budget)."""
  return (num_bytes + SMEM_ALIGN - 1) // SMEM_ALIGN * SMEM_ALIGN


def smem_buffer(dtype, count: int, alignment: int = SMEM_ALIGN):
  """A cute.struct field of `count` elements starting on an `alignment`-byte boundary."""
  return cute.struct.Align[cute.struct.MemRange[dtype, count], alignment]


def smem_fields(buffers: dict) -> dict:
  """The cute.struct fields of `buffers` ({name: (element type, count, alignment)}, in order)."""
  return {name: smem_buffer(*buffer) for name, buffer in buffers.items()}


def shared_storage(pipeline_stages: dict, buffers: dict, tiles: dict = None):
  """A kernel's shared storage struct: first a full and an empty mbarrier per stage of each
  pipeline ({name: stages}, in order), then `buffers` ({name: (element type, count,
  alignment)}, in order), the bytes smem_bytes counts.

  tiles ({name: layouts}): the buffers are what smem_bytes counts, so each named buffer must
  hold exactly the largest of the layouts it holds.
  """
  for name, layouts in (tiles or {}).items():
    assert buffers[name][1] == max(cute.cosize(layout) for layout in layouts), name
  fields = {name: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            for name, stages in pipeline_stages.items()}
  fields.update(smem_fields(buffers))
  # cute.struct reads the class annotations in order.
  return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def smem_bytes(buffers: dict) -> int:
  """Shared memory that a storage struct's mbarriers (first, less than SMEM_ALIGN bytes) and
  then `buffers` ({name: (element type, count, alignment)}) take: SMEM_ALIGN, then each
  buffer's bytes rounded up to its alignment."""
  return SMEM_ALIGN + sum((count * dtype.width // 8 + alignment - 1) // alignment * alignment
                          for dtype, count, alignment in buffers.values())


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
  """The same memory with its modes reordered (e.g. (batch, seq, heads, dim) -> seq first)."""
  return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def smem_layout(dtype, rows: int, cols: int, stages=None, major_size=None, col_major=False):
  """Swizzled layout of a (rows, cols[, stages]) tile: cols contiguous, or rows if col_major.

  `major_size` (default: the contiguous mode's size) picks the swizzle width: a WGMMA that reads
  the tile transposed (MN-major) and splits the contiguous mode between warpgroups needs each
  warpgroup's slice to be whole swizzle atoms, e.g. 32 columns of 16-bit -> 64-byte swizzle.
  col_major: e.g. the forward's V^T tile (head_dim_v, tile_n), head_dim_v contiguous.
  """
  layout = LayoutEnum.COL_MAJOR if col_major else LayoutEnum.ROW_MAJOR
  atom = warpgroup.make_smem_layout_atom(
      sm90_utils.get_smem_layout_atom(layout, dtype, major_size or (rows if col_major else cols)),
      dtype)
  order = (1, 0) if col_major else (0, 1)
  if stages is None:
    return cute.tile_to_shape(atom, (rows, cols), order)
  return cute.tile_to_shape(atom, (rows, cols, stages), order + (2,))


def swizzled_byte_offset(layout: cute.ComposedLayout, crd, elem_bytes: int) -> Int32:
  """Byte offset of coordinate crd in a swizzled shared-memory layout (smem_layout) of
  elem_bytes-byte elements: its swizzle (Swizzle<B, M, S>) acts on byte offsets, so the
  unswizzled element offset is scaled first. A ring's stages are whole swizzle periods apart,
  so crd may name any stage. For addresses of hand-written shared loads and stores (ldmatrix,
  ld.shared.v4)."""
  sw = layout.inner
  offset = Int32(cute.crd2idx(crd, layout.outer)) * elem_bytes
  mask = ((1 << sw.num_bits) - 1) << sw.num_base
  return offset ^ ((offset >> sw.num_shift) & mask)


def transpose_view(t: cute.Tensor) -> cute.Tensor:
  """Swaps the first two modes of a shared tensor (same bytes): A^T for WGMMA operands."""
  shape = (t.shape[1], t.shape[0], *t.shape[2:])
  order = (1, 0, *range(2, cute.rank(t)))
  return cute.composition(t, cute.make_ordered_layout(shape, order=order))


@cute.jit
def prefetch_descriptors(warp_idx: Int32, atoms):
  """Warp 0 prefetches the TMA descriptors of `atoms`."""
  if warp_idx == 0:
    for atom in atoms:
      cpasync.prefetch_descriptor(atom)


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
         zero_init: cutlass.Constexpr):
  """Issues acc (+)= a @ b over the k blocks (mode 2) as one WGMMA group; does not wait.

  A fresh atom carries the ACCUMULATE flag: setting it on the shared TiledMma inside a loop
  would leak a loop-body value out of the loop ("operand does not dominate this use").
  """
  atom = cute.make_mma_atom(tiled_mma.op)
  warpgroup.fence()
  for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init or k != 0)
    cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
  warpgroup.commit_group()


@cute.jit
def store_acc_to_smem(tiled_mma: cute.TiledMma, tidx, acc: cute.Tensor, dst: cute.Tensor,
                      dtype: cutlass.Constexpr):
  """Converts an fp32 WGMMA accumulator to `dtype` and writes it to a row-major smem tile.

  Uses stmatrix (16-byte rows per lane). `tidx` is the thread index among the MMA threads;
  each thread writes exactly the tile positions its accumulator holds (one row block per
  thread: MMA_M == 1). Converts one stmatrix worth of values at a time, so the converted copy
  never occupies more than a few registers (the backward kernel runs at the 240-register
  limit).
  """
  assert cute.size(acc, mode=[1]) == 1, "one row block per thread"
  _store_block(tiled_mma, tidx, acc, dst, dtype)


@cute.jit
def store_frag_transposed(tiled_mma: cute.TiledMma, tidx, frag: cute.Tensor, dst_t: cute.Tensor):
  """Writes an accumulator-layout fragment (already in dst's dtype) to a transposed smem view.

  `frag` has the layout of a one-row-block fragment of `tiled_mma` over an (M, N) tile;
  `dst_t` is that (M, N) tile as a view whose mode 0 is contiguous (transpose_view of a
  row-major (N, M) tile), written with stmatrix.trans. Used for dS^T of the swapped backward:
  the accumulator holds keys x queries, the dQ GEMM reads dS as queries x keys.
  """
  _store_block(tiled_mma, tidx, frag, dst_t, frag.element_type, transposed=True)


@cute.jit
def _store_block(tiled_mma: cute.TiledMma, tidx, acc: cute.Tensor, dst: cute.Tensor,
                 dtype: cutlass.Constexpr, transposed: cutlass.Constexpr = False):
  """store_acc_to_smem of an accumulator with one row block (MMA_M == 1).

  `transposed`: dst's mode 0 is contiguous (stmatrix.trans) and acc is already in `dtype`.
  """
  layout = LayoutEnum.COL_MAJOR if cutlass.const_expr(transposed) else LayoutEnum.ROW_MAJOR
  store_atom = sm90_utils.get_smem_store_op(layout, dtype, Float32)
  tiled_copy = cute.make_tiled_copy_S(store_atom,
                                      cute.make_tiled_copy_C_atom(store_atom, tiled_mma))
  thr_copy = tiled_copy.get_slice(tidx)
  # (values per stmatrix, stmatrix calls) views of the source and destination partitions.
  src_part = thr_copy.partition_S(dst)
  src_chunks = cute.group_modes(src_part, 1, cute.rank(src_part))
  dst_part = thr_copy.partition_D(dst)
  dst_chunks = cute.group_modes(dst_part, 1, cute.rank(dst_part))
  # retile() orders the values as the copy consumes them but nests the modes differently from
  # the partition: flat value k of the retiled view is flat value k of a partition_S-shaped
  # fragment, so stmatrix call c takes values [c * per_copy, (c + 1) * per_copy).
  retiled = tiled_copy.retile(acc)
  per_copy = cute.size(src_chunks, mode=[0])
  for c in cutlass.range_constexpr(cute.size(src_chunks, mode=[1])):
    if cutlass.const_expr(transposed):
      # Already converted (the same registers feed an RS WGMMA): only gathered, into a flat
      # chunk. A chunk shaped like the partition (((2, 2, 2), 1) for the .trans atom) is
      # packed into the stmatrix registers in another order (PTX: value pairs (0, 2), (1, 3),
      # ...), which puts key r + 8 of query q at query q + 1, key r; flat, pair k is values
      # (2k, 2k + 1) as the copy's partition assumes (seen in the PTX).
      chunk = cute.make_rmem_tensor(per_copy, dtype)
      for v in cutlass.range_constexpr(per_copy):
        chunk[v] = retiled[c * per_copy + v]
    else:
      chunk = cute.make_rmem_tensor_like(src_chunks[None, c], dtype)
      chunk32 = cute.make_rmem_tensor(per_copy, Float32)
      for v in cutlass.range_constexpr(per_copy):
        chunk32[v] = retiled[c * per_copy + v]
      chunk.store(chunk32.load().to(dtype))
    cute.copy(tiled_copy, chunk, dst_chunks[None, c])


def release_after_lane_loads(pipe, state) -> None:
  """Releases a pipeline slot whose shared memory the warp's lanes read with ordinary loads
  (LDS / LDSM, not WGMMA): a bulk-copied side buffer, or a tile that warps transpose.

  One elected lane per warp arrives on the slot's empty barrier. The warp synchronises first:
  bar.warp.sync orders memory among the warp's lanes, so that lane's arrive (a release) covers
  every lane's loads, and the producer's next copy into the slot (after its acquire of the
  barrier) cannot overtake any of them. compute-sanitizer's racecheck still reports these
  hand-offs (it credits a release only to the arriving thread): docs/kernels.md, "Sanitizer".
  """
  cute.arch.sync_warp()
  pipe.consumer_release(state)


@dsl_user_op
def thread_index_here(*, loc=None, ip=None) -> Int32:
  """%tid.x read where it is called (a volatile read): addresses derived from it are computed
  there, not hoisted to the kernel's start and kept live (or spilled) across the main loop."""
  return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def bulk_copy_g2s(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, num_bytes: int,
                  mbar_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
  """smem[0:num_bytes] = gmem[0:num_bytes] by the bulk copy engine; completes on an mbarrier.

  The bytes count towards the mbarrier's transaction count (a TMA pipeline stage's tx_count
  must include them). num_bytes a multiple of 16, both addresses 16-byte aligned.
  """
  saddr = smem_ptr.toint(loc=loc, ip=ip).ir_value()
  gaddr = gmem_ptr.toint(loc=loc, ip=ip).ir_value()
  baddr = mbar_ptr.toint(loc=loc, ip=ip).ir_value()
  llvm.inline_asm(
      None, [saddr, gaddr, Int32(num_bytes).ir_value(loc=loc, ip=ip), baddr],
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
      "r,l,r,r", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)
