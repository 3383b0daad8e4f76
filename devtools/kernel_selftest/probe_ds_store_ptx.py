"""CPU check of the dS smem stores as compiled: PTX of the real store code, run by a tiny emulator.

devtools, no GPU. probe_swap_layouts.py checks the CuTe layouts (partitions, retile) but
assumes that cute.copy hands the stmatrix registers over in the chunk's flat value order; the
swap_sdp dQ bug sat exactly there (the lowering packed another order), so this probe looks at
the code the DSL emits instead. For each case it compiles a one-CTA kernel (256 threads, the
two consumer warpgroups) in which thread t loads its fragment value i from g[t * size + i] and
then calls the kernel's real store with the kernel object's own sPdS_layout (swizzled pointer,
as bwd_sm90 allocates it) and tiled_mma_sdp:
  swapped m64 / m80: sm90_gemm.store_frag_transposed(tiled_mma_sdp, t, dS^T fragment,
                     transpose_view(sdS[None, None, 1]))   (stage 1 of the ds_stages buffers)
  control:           sm90_gemm.store_acc_to_smem of the unswapped fp32 dS fragment into sdS,
                     the GPU-verified default path (validates the emulator and the model)
Then it emulates the PTX per thread (integer ops, ld.global -> element index, register
packing mov.b32 {lo, hi} / cvt.rn.bf16x2.f32 d, hi, lo) and applies the PTX ISA semantics of
stmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: register j of a lane is matrix j;
lane 8j + r gives the address of row r of matrix j; lane l holds (row l / 4, cols 2 (l % 4)
and + 1) in the low / high half; .trans stores element (row, col) at row col's address +
row. Every fragment value must land at the smem byte the dQ GEMM reads for its (query, key):
swizzle(2 * sPdS_layout.outer(query, key[, stage])), the layout the WGMMA descriptors come
from. Negative control (must mismatch): the swapped store with the chunk made by
make_rmem_tensor_like(partition_S chunk), the pre-fix formulation.

  .venv/bin/python devtools/kernel_selftest/probe_ds_store_ptx.py      # ~1 min, exit 1 on error
"""

import os
import pathlib
import re
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402

from jaxflash import config  # noqa: E402
from jaxflash.kernels import sm90_gemm  # noqa: E402
from jaxflash.kernels.bwd_sm90 import FlashAttentionBackwardSm90  # noqa: E402

THREADS = 256
STAGE = 1


@cute.jit
def _old_like_chunk_store(tiled_mma, tidx, frag, dst_t):
  """Negative control: the pre-fix transposed store (chunk shaped like the partition)."""
  atom = sm90_utils.get_smem_store_op(cutlass.utils.LayoutEnum.COL_MAJOR, frag.element_type,
                                      Float32)
  tiled_copy = cute.make_tiled_copy_S(atom, cute.make_tiled_copy_C_atom(atom, tiled_mma))
  thr_copy = tiled_copy.get_slice(tidx)
  src_part = thr_copy.partition_S(dst_t)
  src_chunks = cute.group_modes(src_part, 1, cute.rank(src_part))
  dst_part = thr_copy.partition_D(dst_t)
  dst_chunks = cute.group_modes(dst_part, 1, cute.rank(dst_part))
  retiled = tiled_copy.retile(frag)
  per_copy = cute.size(src_chunks, mode=[0])
  for c in cutlass.range_constexpr(cute.size(src_chunks, mode=[1])):
    chunk = cute.make_rmem_tensor_like(src_chunks[None, c], frag.element_type)
    for v in cutlass.range_constexpr(per_copy):
      chunk[v] = retiled[c * per_copy + v]
    cute.copy(tiled_copy, chunk, dst_chunks[None, c])


class _StoreKernel:
  """One CTA: fragment value i of thread t = g[t * size + i], then the store under test."""

  def __init__(self, kernel, mode):
    self.k, self.mode = kernel, mode

  @cute.jit
  def __call__(self, g: cute.Tensor, out: cute.Tensor):
    self.k._setup_attributes()
    self.kern(g, out, self.k.sPdS_layout, self.k.tiled_mma_sdp).launch(
        grid=[1, 1, 1], block=[THREADS, 1, 1])

  @cute.kernel
  def kern(self, g: cute.Tensor, out: cute.Tensor, layout: cute.ComposedLayout,
           mma: cute.TiledMma):
    tidx, _, _ = cute.arch.thread_idx()

    @cute.struct
    class Storage:
      sdS: cute.struct.Align[cute.struct.MemRange[self.k.dtype, cute.cosize(layout)],
                             sm90_gemm.SMEM_ALIGN]

    storage = cutlass.utils.SmemAllocator().allocate(Storage)
    sdS = storage.sdS.get_tensor(layout.outer, swizzle=layout.inner)
    swapped = self.mode != "control"
    shape = (self.k.tile_n, self.k.tile_m) if swapped else (self.k.tile_m, self.k.tile_n)
    frag = cute.make_rmem_tensor(mma.get_slice(tidx).partition_shape_C(shape),
                                 self.k.dtype if swapped else Float32)
    for i in cutlass.range_constexpr(cute.size(frag)):
      frag[i] = g[tidx * cute.size(frag) + i]
    if cutlass.const_expr(self.mode == "swapped"):
      sm90_gemm.store_frag_transposed(mma, tidx, frag,
                                      sm90_gemm.transpose_view(sdS[None, None, STAGE]))
    elif cutlass.const_expr(self.mode == "old"):
      _old_like_chunk_store(mma, tidx, frag, sm90_gemm.transpose_view(sdS[None, None, STAGE]))
    else:
      sm90_gemm.store_acc_to_smem(mma, tidx, frag, sdS, self.k.dtype)
    cute.arch.sync_threads()
    # Keeps the stores alive.
    out[tidx] = sdS[(tidx % self.k.tile_m, 0, STAGE) if swapped else (tidx % self.k.tile_m, 0)]


def _compile_ptx(kernel, mode, work):
  swapped = mode != "control"
  elem = kernel.dtype if swapped else Float32
  g = make_fake_tensor(elem, (kernel.tile_m * kernel.tile_n,), (1,), assumed_align=16)
  out = make_fake_tensor(kernel.dtype, (THREADS,), (1,), assumed_align=16)
  d = pathlib.Path(tempfile.mkdtemp(dir=work))
  cute.compile(_StoreKernel(kernel, mode), g, out,
               options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}")
  (ptx,) = d.glob("*.ptx")
  text = ptx.read_text()
  body = text[text.index("{", text.index(".entry")):]
  return [ln.strip().rstrip(";") for ln in body.splitlines()
          if ln.strip() and not ln.strip().startswith((".", "//", "{", "}", "$"))]


_INT_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
    "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
}


def _emulate(lines, tid, elem_bytes):
  """(stmatrix records [(opcode, address, [(lo, hi) element indices of g])]) of thread tid."""
  regs, stores = {}, []

  def val(x):
    x = x.strip()
    if x.startswith("%"):
      return regs[x]
    return int(x, 0)

  for ln in lines:
    if ln.startswith("@"):
      raise ValueError(f"predicated instruction not modelled: {ln}")
    op, _, rest = ln.partition(" ")
    args = [a.strip() for a in re.split(r",(?![^{]*})", rest)] if rest else []
    base = op.split(".")[0]
    if op.startswith("stmatrix"):
      m = re.match(r"\[(%\w+)(?:\+(-?\d+))?\]", args[0])
      words = [regs[w.strip()] for w in args[1].strip("{} ").split(",")]
      stores.append((op, regs[m.group(1)] + int(m.group(2) or 0), words))
    elif base in ("ret", "bar", "st") or op.startswith("ld.shared"):
      continue
    elif base == "ld" and ".param" in op:
      regs[args[0]] = 0
    elif base == "ld" and ".global" in op:
      m = re.match(r"\[(%\w+)(?:\+(-?\d+))?\]", args[1])
      regs[args[0]] = ("g", (regs[m.group(1)] + int(m.group(2) or 0)) // elem_bytes)
    elif base == "mov" and args[1].startswith("{"):
      lo, hi = (regs[r.strip()] for r in args[1].strip("{} ").split(","))
      regs[args[0]] = (lo, hi)
    elif base == "mov":
      src = args[1]
      regs[args[0]] = (tid if src == "%tid.x" else val(src) if src.startswith("%")
                       or src[0].isdigit() else 0)  # a symbol: the dynamic smem base, 0
    elif base == "shfl":
      regs[args[0]] = val(args[1])  # a warp-uniform value in the tiny kernel
    elif base == "cvt" and "x2" in op:
      regs[args[0]] = (regs[args[2]], regs[args[1]])  # d = {cvt(b) low, cvt(a) high}
    elif base == "cvt":
      regs[args[0]] = val(args[1])
    elif base == "mad":
      regs[args[0]] = val(args[1]) * val(args[2]) + val(args[3])
    elif base in _INT_OPS:
      bits = 64 if (".wide" in op or "64" in op) else 32
      regs[args[0]] = _INT_OPS[base](val(args[1]), val(args[2])) & ((1 << bits) - 1)
    else:
      raise ValueError(f"opcode not modelled: {ln}")
  return stores


def _check(kernel, mode, lines):
  """(values placed wrongly, values never stored, values stored) for one compiled case."""
  swapped = mode != "control"
  shape = (kernel.tile_n, kernel.tile_m) if swapped else (kernel.tile_m, kernel.tile_n)
  size = cute.size(kernel.tiled_mma_sdp.get_slice(0).partition_shape_C(shape))
  per_thread = [_emulate(lines, t, 2 if swapped else 4) for t in range(THREADS)]
  sw, outer = kernel.sPdS_layout.inner, kernel.sPdS_layout.outer
  mask = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)

  def smem_byte(query, key):
    b = 2 * int(outer((query, key, STAGE) if swapped else (query, key)))
    return b ^ ((b & mask) >> sw.num_shift)

  placed = {}
  for warp in range(THREADS // 32):
    lanes = per_thread[32 * warp:32 * warp + 32]
    for j in range(len(lanes[0])):
      op = lanes[0][j][0]
      trans = ".trans" in op
      nmat = int(re.search(r"\.x(\d)", op).group(1))
      addr = [lanes[l][j][1] for l in range(32)]
      for lane in range(32):
        for mat in range(nmat):
          for half, g in enumerate(lanes[lane][j][2][mat]):
            row, col = lane // 4, 2 * (lane % 4) + half
            at = addr[8 * mat + col] + 2 * row if trans else addr[8 * mat + row] + 2 * col
            placed.setdefault(g[1], []).append(at)
  bad = 0
  ident = cute.make_identity_tensor(shape)
  for t in range(THREADS):
    coord = kernel.tiled_mma_sdp.get_slice(t).partition_C(ident)
    for i in range(size):
      a, b = (int(x) for x in coord[i])
      want = smem_byte(b, a) if swapped else smem_byte(a, b)
      bad += placed.get(t * size + i) != [want]
  missing = THREADS * size - len(placed)
  return bad, missing, len(placed)


@cute.jit
def _run(cases: cutlass.Constexpr, ptx: cutlass.Constexpr, results: cutlass.Constexpr):
  # Plain Python over the cases (layouts evaluate to ints while tracing on the host).
  _run_checks(cases, ptx, results)


def _run_checks(cases, ptx, results):
  for name, kernel, mode in cases:
    kernel._setup_attributes()
    results[name] = _check(kernel, mode, ptx[name])


def main():
  tile64, tile80 = config.TileConfig(64, 128, 2), config.TileConfig(80, 128, 2)
  swap64 = FlashAttentionBackwardSm90(cutlass.BFloat16, 128, 128, tile64, False, swap_sdp=True)
  swap80 = FlashAttentionBackwardSm90(cutlass.BFloat16, 128, 128, tile80, False, swap_sdp=True)
  plain = FlashAttentionBackwardSm90(cutlass.BFloat16, 128, 128, tile64, False)
  swap64_f16 = FlashAttentionBackwardSm90(cutlass.Float16, 128, 128, tile64, False,
                                          swap_sdp=True)
  cases = [("control: default dS store (GPU-verified path)", plain, "control"),
           ("swap_sdp m64 bf16 dS^T store", swap64, "swapped"),
           ("swap_sdp m64 f16 dS^T store", swap64_f16, "swapped"),
           ("swap_sdp m80 bf16 dS^T store", swap80, "swapped")]
  negative = [("negative control: m64 store with the partition-shaped chunk", swap64, "old")]
  results = {}
  with tempfile.TemporaryDirectory() as work:
    ptx = {name: _compile_ptx(kernel, mode, work) for name, kernel, mode in cases + negative}
  cute.compile(_run, cases + negative, ptx, results)
  failed = False
  for name, _, _ in cases:
    bad, missing, total = results[name]
    print(f"{name}: {bad} misplaced, {missing} never stored, {total} stored")
    failed |= bool(bad or missing) or total == 0
  for name, _, _ in negative:
    bad, missing, total = results[name]
    print(f"{name}: {bad} misplaced, {missing} never stored (must not be 0)")
    failed |= not bad
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
