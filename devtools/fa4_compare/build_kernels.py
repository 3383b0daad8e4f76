"""Compile FlashAttention-4's own Hopper backward kernels (bf16, hdim 128, non-causal,
non-deterministic) for sm_90a and export them with export_to_c.

Writes into OUT (argv[1], default ./build):
  fa4_bwd_pre.{h,o}      FlashAttentionBackwardPreprocess  (with dLSE, with dq_accum zeroing)
  fa4_bwd_main_g{G}.{h,o} FlashAttentionBackwardSm90, qhead_per_kvhead = G (compile-time in FA-4)
  fa4_bwd_post.{h,o}     FlashAttentionBackwardPostprocess for dQ   (tile_m = 80)
  fa4_bwd_postkv.{h,o}   FlashAttentionBackwardPostprocess for dK/dV (tile = 128, GQA only)
  config.json            the config the kernels were built with

Everything mirrors flash_attn/cute/interface.py::_flash_attn_bwd for arch 90 with
causal=False, window None, softcap 0, no score/mask mod, no block sparsity, no varlen,
deterministic=False, dlse given, learnable_sink None. The only addition is a thin @cute.jit entry
per kernel that takes just tensors (+ scale) and the stream, binding every None / AuxData()
argument at trace time, because export_to_c cannot describe Python objects.
"""

import ctypes
import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fa4_env  # noqa: E402

fa4_env.setup()

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402

import flash_attn.cute.interface as fa4  # noqa: E402
from flash_attn.cute.flash_bwd_preprocess import FlashAttentionBackwardPreprocess  # noqa: E402
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90  # noqa: E402
from flash_attn.cute.flash_bwd_postprocess import FlashAttentionBackwardPostprocess  # noqa: E402
from flash_attn.cute.utils import AuxData  # noqa: E402
from quack.compile_utils import make_fake_tensor as fake_tensor  # noqa: E402

ARCH = 90
GPU_ARCH = "sm_90a"
DTYPE = cutlass.BFloat16
HEAD_DIM = HEAD_DIM_V = 128
CAUSAL = False
GQA_GROUPS = tuple(int(g) for g in os.environ.get("FA4_GQA_GROUPS", "1,2,3,4,8").split(","))


def load_dsl_runtime():
  libs = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)
          if os.path.basename(p) == "libcute_dsl_runtime.so" and os.path.exists(p)]
  ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
  return os.path.dirname(libs[0])


# ---------------------------------------------------------------------------------------------
# Thin entries: tensors (+ Float32 scale) + stream only.
class PreEntry:
  def __init__(self, obj):
    self.obj = obj

  @cute.jit
  def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mPdPsum: cute.Tensor, mLSE: cute.Tensor,
               mLSElog2: cute.Tensor, mdQaccum: cute.Tensor, mdLSE: cute.Tensor,
               stream: cuda.CUstream):
    # FA-4: fa_bwd_pre(mO, mdO, mPdPsum, mLSE, mLSElog2, mdQaccum, mCuSeqlensQ, mSequsedQ, mdLSE,
    #                  mRowMax, mScaleP, softmax_scale, mCuTotalMBlocks, stream)
    # softmax_scale is only read with mScaleP (MLA path); FA-4 passes 1.0.
    self.obj(mO, mdO, mPdPsum, mLSE, mLSElog2, mdQaccum, None, None, mdLSE, None, None,
             Float32(1.0), None, stream)


class MainEntry:
  def __init__(self, obj):
    self.obj = obj

  @cute.jit
  def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
    # FA-4 compile_args after the tensors: softmax_scale, cu_seqlens_q/k, seqused_q/k (None),
    # window_size_left/right (None: non-causal, non-local), dQ/dK/dV semaphores (None:
    # non-deterministic), AuxData(None, None), block-sparse tensors (None), cu_total_m_blocks_k
    # (None: not varlen), stream.
    self.obj(mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale,
             None, None, None, None, None, None, None, None, None, AuxData(None, None), None,
             None, stream)


class PostEntry:
  def __init__(self, obj):
    self.obj = obj

  @cute.jit
  def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32,
               stream: cuda.CUstream):
    # FA-4: fa_bwd_post(mdQaccum, mdQ, scale, mCuSeqlensQ, mSeqUsedQ, sink_tensors,
    #                   mCuTotalMBlocks, stream)
    self.obj(mdQaccum, mdQ, scale, None, None, None, None, stream)


# ---------------------------------------------------------------------------------------------
def main_fakes(qhead_per_kvhead):
  """FA-4 hands the main kernel to_cute_tensor(t) of real tensors: every extent and every stride
  dynamic except a static unit stride on the last mode, assumed_align 16, nothing shared between
  tensors. Same here (16-byte stride divisibility is what assume_tensor_aligned() asserts
  inside the kernel anyway)."""
  sym = cute.sym_int

  def t(dtype, rank):
    div = 128 // dtype.width
    return fake_tensor(dtype, tuple(sym() for _ in range(rank)), divisibility=div)

  q, k, v, do = (t(DTYPE, 4) for _ in range(4))
  lse_log2, dpsum, dq_accum = (t(Float32, 3) for _ in range(3))
  if qhead_per_kvhead == 1:
    dk, dv = t(DTYPE, 4), t(DTYPE, 4)
  else:
    dk, dv = t(Float32, 3), t(Float32, 3)  # dk_accum / dv_accum (b, h_kv, s_k_rounded * d)
  return q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv


def compile_and_export(entry, args, out_dir, name, log):
  t0 = time.perf_counter()
  compiled = cute.compile(entry, *args, options=f"--gpu-arch {GPU_ARCH}")
  t1 = time.perf_counter()
  compiled.export_to_c(str(out_dir), name, name)
  t2 = time.perf_counter()
  log[name] = {"compile_s": round(t1 - t0, 2), "export_s": round(t2 - t1, 2)}
  print(f"{name}: compile {t1 - t0:.1f}s export {t2 - t1:.1f}s", flush=True)


def main():
  out_dir = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else HERE / "build").resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  load_dsl_runtime()

  # FA-4's own config choice for this case.
  cfg = fa4._tile_size_bwd_sm90(HEAD_DIM, HEAD_DIM_V, CAUSAL, False, sparse_block_size_q=None)
  m_block, n_block = cfg.m_block_size, cfg.n_block_size
  num_threads = (cfg.num_wg + 1) * 128
  q_subtile_factor = 2  # interface.py: sparse_q is None -> 2
  num_threads_post_dQ = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
  num_threads_post_dKV = cfg.num_wg * 128
  log = {"config": cfg.__dict__, "num_threads": num_threads, "gqa_groups": list(GQA_GROUPS)}
  stream = make_fake_stream()

  # 1) preprocess: FA-4 _compile_bwd_preprocess(dtype, 128, 128, m_block, has_cuseqlens_q=False,
  #    has_seqused_q=False, has_dlse=True, has_dq_accum=True, has_scaleP=False,
  #    use_padded_offsets=True, nheads_major=False, pack_gqa=False, qhead_per_kvhead=1,
  #    nheads_kv=1, has_cu_total_m_blocks=False), with its own fake tensors.
  (mQ, mK, mV, mO, mdO, mdQ, mdK, mdV, mLSE, mLSElog2, mPdPsum, mdQaccum, mdKaccum, mdVaccum,
   mScaleP) = fa4.make_fake_bwd_tensors(DTYPE, has_gqa=True, varlen_q=False, varlen_k=False,
                                        nheads_major=False)
  mdLSE = fake_tensor(Float32, mLSE.shape, divisibility=1)
  pre = FlashAttentionBackwardPreprocess(DTYPE, HEAD_DIM, HEAD_DIM_V, m_block,
                                         use_padded_offsets=True, nheads_major=False,
                                         pack_gqa=False, qhead_per_kvhead=1, nheads_kv=1)
  compile_and_export(PreEntry(pre), (mO, mdO, mPdPsum, mLSE, mLSElog2, mdQaccum, mdLSE, stream),
                     out_dir, "fa4_bwd_pre", log)

  # 2) main kernel, one per GQA group size (qhead_per_kvhead is a compile-time constant in FA-4).
  for g in GQA_GROUPS:
    obj = FlashAttentionBackwardSm90(
        DTYPE, HEAD_DIM, HEAD_DIM_V, g, CAUSAL, is_local=False, deterministic=False,
        tile_m=m_block, tile_n=n_block, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
        PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB,
        dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP,
        AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=num_threads, V_in_regs=False, score_mod=None, score_mod_bwd=None,
        mask_mod=None, has_aux_tensors=False, q_subtile_factor=q_subtile_factor,
        dQ_single_wg=cfg.dQ_single_wg)
    compile_and_export(MainEntry(obj), (*main_fakes(g), Float32(0.0), stream), out_dir,
                       f"fa4_bwd_main_g{g}", log)

  # 3) postprocess dQ: FA-4 _compile_bwd_postprocess(dtype, 128, m_block, num_threads_post_dQ,
  #    AtomLayoutMdQ, dQ_swapAB, False, False, use_2cta_instrs=False, cluster_size=1, arch=90,
  #    has_cu_total_m_blocks=False, learnable_sink_dtype=None)
  (mQ, mK, mV, mO, mdO, mdQ, mdK, mdV, mLSE, mLSElog2, mPdPsum, mdQaccum, mdKaccum, mdVaccum,
   mScaleP) = fa4.make_fake_bwd_tensors(DTYPE, has_gqa=True, varlen_q=False, varlen_k=False)
  post = FlashAttentionBackwardPostprocess(DTYPE, HEAD_DIM, ARCH, m_block, num_threads_post_dQ,
                                           cfg.AtomLayoutMdQ, cfg.dQ_swapAB,
                                           use_2cta_instrs=False, cluster_size=1)
  compile_and_export(PostEntry(post), (mdQaccum, mdQ, Float32(0.0), stream), out_dir,
                     "fa4_bwd_post", log)

  # 4) postprocess dK / dV (GQA only): same call with (accum, output) = (dk_accum, dk) and
  #    (dv_accum, dv), hdim 128 (= hdim_v), block n_block, AtomLayoutNdKV, dKV_swapAB. FA-4 passes
  #    dk_accum / dv_accum (which make_fake_bwd_tensors shapes like dQaccum) in the dQ slot.
  if any(g > 1 for g in GQA_GROUPS):
    (mQ, mK, mV, mO, mdO, mdQ, mdK, mdV, mLSE, mLSElog2, mPdPsum, mdQaccum, mdKaccum, mdVaccum,
     mScaleP) = fa4.make_fake_bwd_tensors(DTYPE, has_gqa=True, varlen_q=False, varlen_k=False)
    postkv = FlashAttentionBackwardPostprocess(DTYPE, HEAD_DIM, ARCH, n_block,
                                               num_threads_post_dKV, cfg.AtomLayoutNdKV,
                                               cfg.dKV_swapAB, use_2cta_instrs=False,
                                               cluster_size=1)
    # FA-4 compiles this with the generic fakes (dQaccum / dQ shaped); the K-side tensors have
    # the same rank / dtype / alignment, so this is the identical specialization.
    compile_and_export(PostEntry(postkv), (mdQaccum, mdQ, Float32(0.0), stream), out_dir,
                       "fa4_bwd_postkv", log)

  (out_dir / "config.json").write_text(json.dumps(log, indent=1, default=str))


if __name__ == "__main__":
  main()
