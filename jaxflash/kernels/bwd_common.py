"""Conventions the three backward kernels share: warpgroup split, dQ accumulator layout, sync.

Imports cutlass only. The fp32 dQ accumulator (batch, num_heads, seqlen_q_rounded, head_dim) is
scratch that the caller allocates (jaxflash.config.bwd_scratch_shapes). Its tile_m * head_dim
floats of m block `m` (of one batch and head) are kept in *fragment order*, so that the main
kernel can dump a WGMMA accumulator to shared memory with conflict-free stores and reduce it
into global memory with one bulk copy per warpgroup:
  - warpgroup w (of NUM_MMA_WARPGROUPS) owns columns [w * head_dim / 2, (w + 1) * head_dim / 2)
    and the floats [w * tile_m * head_dim / 2, (w + 1) * tile_m * head_dim / 2) of the block;
  - values 4j..4j+3 of thread t (0..127) of that warpgroup sit at floats 512j + 4t .. 512j + 4t
    + 3 of its half (fragment_chunks): one 128-bit access per chunk, and the 32 chunks of a warp
    are 512 consecutive bytes;
  - its (row, col) in the tile is dq_tiled_mma(...).get_slice(w * 128 + t).partition_C(
    identity (tile_m, head_dim))[i].
The postprocess kernel inverts this mapping with the same tiled MMA. A main kernel with a larger
query block (tile_m = 128 at head_dim 64) keeps this 64-row layout: its m block is tile_m / 64
consecutive 64-row blocks (zeroing, first stores and the dQ semaphores cover whole m blocks).
bwd_sm90's swap_sdp schedule with tile_m = 80 (hdim 128) computes dQ^T: its blocks
are 80 rows, the coordinates those of dq_tiled_mma(..., rows=80, transposed=True) over
(head_dim, 80).
"""

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jaxflash.kernels import sm90_gemm

# Two consumer warpgroups: each owns half of the head_dim of dQ, and 64 key rows of dK/dV (or,
# above head_dim 128, half of the head_dim of dK/dV for 64 key rows: bwd_sm90's head-dim split).
NUM_MMA_WARPGROUPS = 2
# WGMMA's M is 64 per warpgroup: the dQ accumulator layout and the postprocess work in 64-row
# blocks (one WGMMA row block; the main kernel's query tile is one or two of them).
TILE_M = 64


# Floats per 128-bit access: the accumulator's fragment order keeps a thread's values in chunks
# of CHUNK consecutive floats.
CHUNK = 4


def fragment_chunks(half: cute.Tensor, wg_tidx) -> cute.Tensor:
  """Thread wg_tidx's values of a warpgroup's `half` (1-D float32, fragment order, a multiple of
  512 floats): ((CHUNK, 1), chunks) with value i = (i % CHUNK, i // CHUNK); copy it with
  cute.autovec_copy (128-bit accesses)."""
  tiled_copy = cute.make_tiled_copy_tv(
      cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
      cute.make_layout(sm90_gemm.WARPGROUP_THREADS), cute.make_layout(CHUNK))
  return tiled_copy.get_slice(wg_tidx).partition_D(half)


def dq_tiled_mma(dtype, head_dim: int, rows: int = TILE_M, transposed: bool = False,
                 split_rows: bool = False) -> cute.TiledMma:
  """dQ = dS K: both warpgroups cover the `rows` (64) query rows, each half of head_dim (N).

  transposed (the backward schedule's dq_transposed, 80-row tiles): dQ^T = K^T dS^T,
  warpgroup w computes head_dim rows [w * head_dim / 2, (w + 1) * head_dim / 2) (M) for all
  `rows` queries (N): the same head_dim halves per warpgroup, coordinates (head_dim, query).
  split_rows (the backward schedule's dq_split_m, rows = 128): warpgroup w computes 64-row
  block w for all of head_dim (WGMMA N = head_dim instead of head_dim / 2; FA-4's
  AtomLayoutMdQ = 2). Its thread t holds, in value order, what thread t of warpgroups 0 and 1
  hold in the 64-row layout above (values 0..15 the first head_dim half), so staged whole into
  one buffer it is block w of the accumulator layout unchanged (tests/test_kernels_bwd_sm90.py
  checks it).
  """
  if split_rows:
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
        (NUM_MMA_WARPGROUPS, 1, 1), (rows // NUM_MMA_WARPGROUPS, head_dim))
  if transposed:
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.K, Float32,
        (NUM_MMA_WARPGROUPS, 1, 1), (head_dim // NUM_MMA_WARPGROUPS, rows))
  return sm90_utils.make_trivial_tiled_mma(
      dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
      (1, NUM_MMA_WARPGROUPS, 1), (rows, head_dim // NUM_MMA_WARPGROUPS))


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int, *,
                        loc=None, ip=None) -> None:
  """gmem[0:num_bytes] += smem[0:num_bytes] (float32) by the bulk copy engine (bulk_group).

  num_bytes must be a multiple of 16 and both addresses 16-byte aligned. Commit and wait with
  cute.arch.cp_async_bulk_commit_group / cp_async_bulk_wait_group in the issuing thread.
  """
  gaddr = gmem_ptr.toint(loc=loc, ip=ip).ir_value()
  saddr = smem_ptr.toint(loc=loc, ip=ip).ir_value()
  llvm.inline_asm(
      None, [gaddr, saddr, Int32(num_bytes).ir_value(loc=loc, ip=ip)],
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
      "l,r,r", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_store_or_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int,
                          store, *, loc=None, ip=None) -> None:
  """gmem[0:num_bytes] = smem[0:num_bytes] where `store` is true, else += (bulk_reduce_add_f32).

  One predicated pair of bulk copies (no branch): the deterministic dQ writer stores the first
  contribution to an accumulator block, so the block needs no zeroing first.
  """
  gaddr = gmem_ptr.toint(loc=loc, ip=ip).ir_value()
  saddr = smem_ptr.toint(loc=loc, ip=ip).ir_value()
  llvm.inline_asm(
      None, [gaddr, saddr, Int32(num_bytes).ir_value(loc=loc, ip=ip),
             Int32(store).ir_value(loc=loc, ip=ip)],
      "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n"
      "@p cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;\n"
      "@!p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;\n}",
      "l,r,r,r", has_side_effects=True, is_align_stack=False,
      asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def load_acquire(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
  """ld.acquire.gpu of an int32 in global memory (a semaphore read that orders later accesses)."""
  value = llvm.inline_asm(
      T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value()], "ld.acquire.gpu.global.b32 $0, [$1];",
      "=r,l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
  return Int32(value)


@dsl_user_op
def add_release(ptr: cute.Pointer, value: int, *, loc=None, ip=None) -> None:
  """red.release.gpu.add of an int32 in global memory (publishes the writes before it)."""
  llvm.inline_asm(
      None, [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
      "red.release.gpu.global.add.s32 [$0], $1;", "l,r", has_side_effects=True,
      is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def fresh_thread_idx(*, loc=None, ip=None) -> Int32:
  """threadIdx.x read anew (inline asm with side effects: not merged with earlier reads).

  For code after the main loop: values derived from a thread index read before the loop stay
  live across it (ptxas spilled one in a kernel at the 240-register limit); from a new read
  they are recomputed where they are used.
  """
  return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def dq_copy_count(mdQaccum: cute.Tensor, copy_rows):
  """Copies in this call's dQ accumulator (kernel order: rows first).

  Copy c holds rows [c * copy_rows, (c + 1) * copy_rows), copy_rows = seqlen_q rounded up to
  the main kernel's tile_m (kernel_abi.h, config.bwd_scratch_shapes). A kernel built for more
  than one copy reads the count from the shape: config.dq_accum_copies picks it per call.
  """
  return mdQaccum.shape[0] // copy_rows


@cute.jit
def wait_at_least(ptr: cute.Pointer, target: Int32):
  """Spins until the int32 semaphore at ptr is >= target (one thread calls this).

  Every poll is an acquire: polling with relaxed loads and acquiring once was 4-9 % slower on
  the H200.
  """
  seen = load_acquire(ptr)
  while seen < target:
    seen = load_acquire(ptr)
