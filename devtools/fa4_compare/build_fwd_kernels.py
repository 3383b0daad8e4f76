"""Compile FlashAttention-4's own Hopper forward kernel (bf16, dense, causal or not) for sm_90a
and export it with export_to_c, one object per head_dim, causal flag and GQA group size.

Writes into OUT (argv[1], default ./build):
  fa4_fwd_d{D}_c{C}_g{G}.{h,o}  FlashAttentionForwardSm90, head_dim = head_dim_v = D, causal C,
                                qhead_per_kvhead = G (compile-time in FA-4)
  fwd_config.json               the configs the kernels were built with

Everything mirrors flash_attn/cute/interface.py::_flash_attn_fwd for arch 90 with no varlen,
no paging, no window (causal is FA-4's window_size_right = 0, which it resolves to its causal
flag), no softcap / score or mask mod, no learnable sink, no block sparsity, num_splits 1, and
pack_gqa = (G > 1) as FA-4 picks it. FA4_FWD_CONFIGS ("64:0,64:1,128:0,128:1") and
FA4_GQA_GROUPS ("1,2,3,8": the forward self-test's shapes) choose what is built. The only
addition is a thin @cute.jit entry taking just tensors (+ scale) and the stream, binding every
None / AuxData() argument at trace time (export_to_c cannot describe Python objects).
"""

import json
import os
import pathlib
import sys

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
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from flash_attn.cute.utils import AuxData  # noqa: E402
from quack.compile_utils import make_fake_tensor as fake_tensor  # noqa: E402

from build_kernels import compile_and_export, load_dsl_runtime  # noqa: E402

DTYPE = cutlass.BFloat16
CONFIGS = tuple((int(d), bool(int(c))) for d, c in (
    x.split(":") for x in os.environ.get("FA4_FWD_CONFIGS", "64:0,64:1,128:0,128:1").split(",")))
GQA_GROUPS = tuple(int(g) for g in os.environ.get("FA4_GQA_GROUPS", "1,2,3,8").split(","))


class FwdEntry:
  def __init__(self, obj):
    self.obj = obj

  @cute.jit
  def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, softmax_scale: Float32, stream: cuda.CUstream):
    # FA-4 compile_args for arch 9 after the tensors: softmax_scale, cu_seqlens_q / k,
    # seqused_q / k, page_table (None: no varlen, no paging), window_size_left / right (None:
    # causal is the compile-time flag), learnable_sink (None), block-sparse tensors (None),
    # AuxData(None, None), cu_total_m_blocks, cu_total_splits_m_blocks (None), stream.
    self.obj(mQ, mK, mV, mO, mLSE, softmax_scale, None, None, None, None, None, None, None,
             None, None, AuxData(None, None), None, None, stream)


def fwd_fakes():
  """FA-4 hands the kernel to_cute_tensor(t) of real tensors: every extent and stride dynamic
  but a static unit stride on the last mode; q / k / v / out assumed 16-byte aligned, lse 4."""
  sym = cute.sym_int

  def t(dtype, rank, div):
    return fake_tensor(dtype, tuple(sym() for _ in range(rank)), divisibility=div)

  q, k, v, o = (t(DTYPE, 4, 128 // DTYPE.width) for _ in range(4))
  return q, k, v, o, t(Float32, 3, 1)


def main():
  out_dir = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else HERE / "build").resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  load_dsl_runtime()
  stream = make_fake_stream()
  log = {"gqa_groups": list(GQA_GROUPS), "configs": {}}
  for head_dim, causal in CONFIGS:
    cfg = fa4._tile_size_fwd_sm90(head_dim, head_dim, causal, False)
    log["configs"][f"d{head_dim}_c{int(causal)}"] = cfg.__dict__
    for g in GQA_GROUPS:
      # interface.py, arch 9: num_stages 2, Q not in registers, q_subtile_factor 1, TMA K/V;
      # the kernel derives its thread count from tile_m.
      obj = FlashAttentionForwardSm90(
          DTYPE, head_dim, head_dim, g, is_causal=causal, is_local=False, pack_gqa=g > 1,
          tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, num_stages=2, num_threads=384,
          Q_in_regs=False, intra_wg_overlap=cfg.intra_wg_overlap,
          mma_pv_is_rs=cfg.mma_pv_is_rs, mask_mod=None, score_mod=None, has_aux_tensors=False,
          q_subtile_factor=1, paged_kv_non_tma=False)
      compile_and_export(FwdEntry(obj), (*fwd_fakes(), Float32(0.0), stream), out_dir,
                         f"fa4_fwd_d{head_dim}_c{int(causal)}_g{g}", log)
  (out_dir / "fwd_config.json").write_text(json.dumps(log, indent=1, default=str))


if __name__ == "__main__":
  main()
