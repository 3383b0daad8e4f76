"""The chunked-prefill kernel (kernels/chunked_sm90.py) compiled for sm_90a on a GPU-less host.

Every shipped chunked variant is exported once per session (the bfloat16 ones; the float16 twin
of head_dim 128 in tests/test_decode_variants.py's choice); the SASS checks assert structure:
WGMMA of the two 64-row warpgroups, TMA loads (those of 64-key boxes beside the 16-key ones),
the register split, the ping-pong barriers, one kernel (no merge) and no local-memory spills.
Needs nvidia-cutlass-dsl (marker `cutlass`).
"""

import re

import pytest

pytest.importorskip("cutlass")

from jaxflash import config  # noqa: E402
from jaxflash.kernels import chunked_sm90, compile as kernel_compile  # noqa: E402
from jaxflash.kernels.decode_sm90 import FlashAttentionDecodeSm90  # noqa: E402
from tests import _sass  # noqa: E402

pytestmark = pytest.mark.cutlass

VARIANTS = [v for v in config.shipped_variants("sm90a", "decode") if v.schedule.chunked]
COMPILED = [v for v in VARIANTS if v.dtype == "bfloat16"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  return _sass.exporter(tmp_path_factory)


def test_one_chunked_variant_per_dtype_and_pair():
  assert [(v.dtype, v.head_dim, v.head_dim_v) for v in VARIANTS] == [
      (dtype, d, dv) for dtype in config.KERNEL_DTYPES for d, dv in config.CHUNKED_HEAD_DIM_PAIRS]
  for v in VARIANTS:
    assert v.schedule.tile_m == 128 and v.kv_dtype is None
    assert isinstance(kernel_compile.build_decode_kernel(v),
                      chunked_sm90.FlashAttentionChunkedSm90)
    # The split-KV kernel refuses the chunked schedules, and the chunked kernel the others.
    ok, why = FlashAttentionDecodeSm90.can_implement(v)
    assert not ok and "chunked-prefill" in why
  split = config.decode_variant("bfloat16", 128, 128)
  ok, why = chunked_sm90.FlashAttentionChunkedSm90.can_implement(split)
  assert not ok and "not a chunked-prefill variant" in why
  assert isinstance(kernel_compile.build_decode_kernel(split), FlashAttentionDecodeSm90)


@pytest.mark.parametrize("variant", COMPILED, ids=lambda v: v.key)
def test_sass_has_two_warpgroup_wgmma_tma_and_no_spills(exported, variant):
  e = exported(variant)
  sass = e.sass["main"]
  kernels = re.findall(r"\.text\.(\S+?):", sass)
  assert len(kernels) == 1 and "ChunkedSm90" in kernels[0], kernels  # no merge kernel
  ops = e.ops()
  _sass.assert_no_spills(ops, variant.key)
  assert {"HGMMA", "UTMALDG"} <= set(ops)
  _sass.assert_wgmma_not_serialized(sass)
  assert _sass.wgmma_shapes(sass) == {f"64x{variant.schedule.tile_n}x16",
                                      f"64x{variant.head_dim_v}x16"}
  # setmaxnreg: the producer warpgroup down to 40 registers, the consumers up to 232.
  assert "USETMAXREG.DEALLOC.CTAPOOL 0x28" in sass
  assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL U?P\d, 0xe8", sass)
  # Ping-pong: the consumers sync on and arrive at named barriers 2 and 3 (256 threads).
  turns = _sass.pingpong_turns(sass)
  assert "ARV" in turns and any(t.startswith("SYNC") for t in turns), turns


def test_pages_of_64_keys_take_64_key_boxes_and_the_split_kernel_keeps_16():
  # The routing sends pools whose pages are a multiple of 64 keys to the chunked kernel, which
  # loads pages of 64 in boxes of that many keys; the split-KV class has 16-key boxes only.
  assert chunked_sm90.FlashAttentionChunkedSm90.box_rows == (config.CHUNKED_PAGE_MULTIPLE, 16)
  assert FlashAttentionDecodeSm90.box_rows == (16,)


@pytest.mark.parametrize("variant", COMPILED, ids=lambda v: v.key)
def test_sass_has_the_tma_loads_of_both_box_heights(exported, variant):
  """The producer's loop is compiled twice, for 64-key and for 16-key boxes, each beside the
  whole-block copies: per loop, Q (c_q column boxes), and at its 2 K and 2 V call sites
  (decode_sm90.load_decode) a whole block (c column boxes) and tile_n / rows row boxes of c
  column boxes each. Without the 64-key loop the count is that of one loop of 16-key boxes
  (74 UTMALDG at head_dim 128, against 100)."""
  kernel = chunked_sm90.FlashAttentionChunkedSm90(variant)
  c_k = variant.head_dim // kernel.k_box_cols
  c_v = variant.head_dim_v // kernel.v_box_rows
  tile_n = variant.schedule.tile_n
  per_loop = [c_k + 2 * (c_k + c_v) * (1 + tile_n // rows) for rows in kernel.box_rows]
  assert exported(variant).ops().count("UTMALDG") == sum(per_loop), per_loop


def test_smem_fits_and_registers_fill_the_sm():
  for v in VARIANTS:
    assert chunked_sm90.FlashAttentionChunkedSm90.smem_bytes(v) <= config.SMEM_BYTES, v.key
  producer, consumer = chunked_sm90._PRODUCER_REGS, chunked_sm90._CONSUMER_REGS
  assert producer * 128 + consumer * 256 <= 64 * 1024
  assert producer % 8 == 0 and consumer % 8 == 0
