"""CPU coordinate probe of bwd_sm90's dq_split_m option (devtools; no GPU, ~30 s).

With tile_m 128 (head_dim 64) the dQ GEMM split head_dim between the two consumer warpgroups
(each 128 rows x 32 columns, two 64-row WGMMA blocks; now dq_split_m=False); dq_split_m (the
default there since the seventh session) splits the rows instead (warpgroup w: 64-row block w,
all 64 columns). Both stage their 32 accumulator values
per thread with the same code (stage_dq: value i of thread t at float (i // 4) * 512 + 4 t +
i % 4 of its warpgroup's buffer) and differ only in where the writer adds each buffer:
  - head_dim split: buffer w float p -> block float (p // 2048) * 4096 + w * 2048 + p % 2048;
  - row split: buffer w float p -> block float w * 4096 + p.
The postprocess reads the block back through bwd_common.dq_tiled_mma (64-row layout). For every
thread and value this checks that the (query row, head_dim column) the postprocess assigns to
the float the value lands in is the one the main kernel's tiled MMA computed there:
  1. control: the head_dim split with its writer map (GPU-tested through the sixth session);
  2. the row split with its writer map;
  negative control: the row-split MMA with the head_dim split's writer map (must mismatch).
Exits 1 on any mismatch (or a negative control without one).

  .venv/bin/python devtools/kernel_selftest/probe_dq_split_m.py
"""

import os
import pathlib
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from jaxflash import config  # noqa: E402
from jaxflash.kernels import bwd_common  # noqa: E402
from jaxflash.kernels.bwd_sm90 import FlashAttentionBackwardSm90  # noqa: E402

THREADS = 256
RESULTS = {}


def _coord(c):
  return tuple(int(x) for x in c)


def _writer_head_split(w, p):
  return (p // 2048) * 4096 + w * 2048 + p % 2048


def _writer_row_split(w, p):
  return w * 4096 + p


def _check(tiled_mma, writer, head_dim, post_coords):
  """Mismatches over all threads' values: main-kernel coordinate vs the postprocess's."""
  ident = cute.make_identity_tensor((128, head_dim))
  bad = total = 0
  for t in range(THREADS):
    w, lane = divmod(t, 128)
    coords = tiled_mma.get_slice(t).partition_C(ident)
    for i in range(cute.size(coords)):
      p = (i // 4) * 512 + 4 * lane + i % 4
      total += 1
      bad += post_coords.get(writer(w, p)) != _coord(coords[i])
  return bad, total


def _postprocess_coords(post_mma, head_dim):
  """Block float -> (row, column) of the 128-row m block, as the postprocess reads it."""
  ident = cute.make_identity_tensor((64, head_dim))
  half = 64 * head_dim // 2
  out = {}
  for block in range(2):
    for t in range(THREADS):
      w, lane = divmod(t, 128)
      coords = post_mma.get_slice(t).partition_C(ident)
      for i in range(cute.size(coords)):
        row, col = _coord(coords[i])
        out[block * 2 * half + w * half + (i // 4) * 512 + 4 * lane + i % 4] = (
            block * 64 + row, col)
  return out


@cute.jit
def probe(head: cutlass.Constexpr, rows: cutlass.Constexpr):
  # Plain Python over python ints while tracing (nothing launched).
  head._setup_attributes()
  rows._setup_attributes()
  d = head.head_dim
  post = _postprocess_coords(bwd_common.dq_tiled_mma(head.dtype, d), d)
  RESULTS["head_dim split (control)"] = _check(head.tiled_mma_dq, _writer_head_split, d, post)
  RESULTS["row split"] = _check(rows.tiled_mma_dq, _writer_row_split, d, post)
  RESULTS["negative: row split, head_dim split writer"] = _check(
      rows.tiled_mma_dq, _writer_head_split, d, post)


def main():
  tile = config.TileConfig(128, 128, 2, swap_sdp=True)
  head = FlashAttentionBackwardSm90(cutlass.BFloat16, 64, 64, tile, False, dq_split_m=False)
  rows = FlashAttentionBackwardSm90(cutlass.BFloat16, 64, 64, tile, False, dq_split_m=True)
  cute.compile(probe, head, rows)
  failed = False
  for name, (bad, total) in RESULTS.items():
    print(f"{name}: {bad} of {total} values mismatched")
    negative = name.startswith("negative")
    failed |= (bad == 0) if negative else (bad != 0 or total != THREADS * 32)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
