"""The variant / schedule table of jaxflash.config: what ships, the schedules, support, scratch.

CPU only, no cutlass: config is a leaf module (the kernels' compile tests check that each
schedule builds).
"""

import dataclasses
import pathlib
import re

import pytest

from jaxflash import config

FWD = config.shipped_variants("sm90a", "fwd")
BWD = config.shipped_variants("sm90a", "bwd")
DECODE = config.shipped_variants("sm90a", "decode")
# Forward variants a call's static shape picks (fwd_schedule's seq_k: short dense calls; band:
# narrow windows), where they differ from the others.
SHAPED_FWD = [v for v in FWD if v.dtype != config.FP8_DTYPE and not v.bias and (
    v.schedule != config.fwd_schedule(v.head_dim, v.head_dim_v, v.causal, v.masked))]
# The bias variants (masked ones with the bias operand), one per dtype and BIAS_HEAD_DIM_PAIRS.
BIAS_FWD = [v for v in FWD if v.bias]
BIAS_BWD = [v for v in BWD if v.bias]
DENSE_FWD = [v for v in FWD if not v.masked and v.dtype != config.FP8_DTYPE and v not in SHAPED_FWD]
DENSE_BWD = [v for v in BWD if not v.masked]
PAIRS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))


def _cfg(**options):
  return config.AttentionConfig(softmax_scale=0.1, **options)


def _bwd(head_dim, head_dim_v=None, causal=False, deterministic=False):
  return config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", head_dim,
                                       head_dim_v or head_dim,
                                       _cfg(causal=causal, deterministic=deterministic))


def test_shipped_variants_cover_dtypes_head_dims_masks_and_determinism():
  """Dense (causal or not) and masked variants (windows, segment ids, causal at run time):
  3 x 2 dtypes x 6 head-dim pairs forward, twice that backward (deterministic or not); and the
  FP8 forward: head_dim 64 / 128 / 256, causal or not, per-head or block descales (-blk)."""
  assert config.KERNEL_HEAD_DIM_PAIRS == {"fwd": PAIRS, "bwd": PAIRS, "decode": PAIRS}
  fp8 = [v for v in FWD if v.dtype == config.FP8_DTYPE]
  assert [(v.head_dim, v.head_dim_v, v.causal, v.block_descales) for v in fp8] == [
      (d, d, c, blocks) for blocks in (False, True) for d in config.FP8_HEAD_DIMS
      for c in (False, True)]
  assert all(v.key.endswith(f"-blk-{v.schedule.key}") == v.block_descales for v in fp8)
  assert not any(v.masked for v in fp8)
  assert all(v.key.startswith("fwd-sm90a-e4m3-") for v in fp8)
  assert len(FWD) == 2 * len(PAIRS) * 3 + len(SHAPED_FWD) + len(fp8) + len(BIAS_FWD)
  assert len(BWD) == 2 * len(PAIRS) * 3 * 2 + len(BIAS_BWD)
  # The budget of the masked-attention and score-modifier work: at most 160 variants.
  assert len(FWD) + len(BWD) <= 160
  for variants, direction in ((FWD, "fwd"), (BWD, "bwd")):
    variants = [v for v in variants
                if v.dtype != config.FP8_DTYPE and v not in SHAPED_FWD and not v.bias]
    combos = {(v.dtype, v.head_dim, v.head_dim_v, v.causal, v.masked, v.deterministic)
              for v in variants}
    assert len(combos) == len(variants)
    assert not any(v.causal and v.masked for v in variants)
    assert {(v.head_dim, v.head_dim_v) for v in variants} == set(PAIRS)
    assert all(v.direction == direction and v.key.startswith(direction + "-") for v in variants)
  assert not any(v.deterministic for v in FWD)
  assert {v.deterministic for v in BWD} == {False, True}


def test_keys_are_unique_names_of_flags_and_tile():
  keys = [v.key for v in FWD + BWD + DECODE]
  assert len(set(keys)) == len(keys)
  assert "decode-sm90a-bf16-d128-dv128-m64n128s3" in keys
  assert "decode-sm90a-f16-d192-dv128-m64n64s4" in keys
  assert "fwd-sm90a-bf16-d128-dv128-causal-m128n128s2" in keys
  assert "fwd-sm90a-f16-d128-dv128-m128n176s2" in keys
  assert "bwd-sm90a-bf16-d128-dv128-causal-det-m80n128s2swap" in keys
  assert "bwd-sm90a-f16-d256-dv256-det-m64n64s2" in keys
  for v in FWD + BWD + DECODE:
    assert ("-causal" in v.key) == v.causal and ("-det" in v.key) == v.deterministic
    assert ("-masked" in v.key) == v.masked
    assert v.key.endswith("-" + v.schedule.key)


def test_forward_schedule_table():
  by_pair = {(v.head_dim, v.head_dim_v, v.causal): v.schedule for v in DENSE_FWD}
  tiles = {pair: (s.tile_m, s.tile_n, s.num_stages) for pair, s in by_pair.items()}
  assert tiles == {
      (64, 64, False): (192, 128, 2), (64, 64, True): (192, 128, 2),
      (96, 96, False): (128, 128, 2), (96, 96, True): (128, 128, 2),
      (128, 128, False): (128, 176, 2), (128, 128, True): (128, 128, 2),
      (192, 128, False): (128, 128, 2), (192, 128, True): (128, 128, 2),
      (192, 192, False): (128, 112, 2), (192, 192, True): (128, 112, 2),
      (256, 256, False): (128, 80, 2), (256, 256, True): (128, 80, 2)}
  for (head_dim, head_dim_v, causal), s in by_pair.items():
    assert s.tile_m % 64 == 0 and s.tile_n % 16 == 0
    # 192 query rows (3 consumer warpgroups at 160 registers) only at head_dim 64.
    assert s.tile_m == 128 or head_dim == 64
    assert s.pingpong == (head_dim <= 128)
    # A persistent grid everywhere: causal tiles claimed longest first (dynamic), the others
    # walked as a static list.
    assert (s.persistent, s.dynamic, s.lpt) == (True, causal, causal)
    assert s.rescale_o_before_pv == (head_dim_v > 128)
    # Two Q slots only where two slots (each also O's) and the K / V rings fit 227 KiB.
    size = lambda q_slots: 2 * (q_slots * s.tile_m * head_dim
                                + s.num_stages * s.tile_n * (head_dim + head_dim_v))
    fits = head_dim == head_dim_v and size(2) + 1024 <= 227 * 1024
    assert s.q_stages == 1 or fits, (head_dim, head_dim_v, causal)
  q_stages = {pair: s.q_stages for pair, s in by_pair.items() if s.q_stages != 1}
  assert q_stages == {(64, 64, True): 2, (96, 96, False): 2, (96, 96, True): 2,
                      (128, 128, True): 2}
  # Masked variants take the causal tiles, claimed in the order of their block ranges (narrow
  # bands: test_narrow_band_masked_calls_at_head_dim_64_take_their_own_forward_variant).
  for v in FWD:
    if v.masked and v not in SHAPED_FWD and not v.bias:
      causal = config.fwd_schedule(v.head_dim, v.head_dim_v, True)
      assert v.schedule == dataclasses.replace(causal, lpt=False)


def test_forward_scratch_is_the_tile_counter_of_dynamic_schedules():
  """A dynamic schedule's forward call carries one int32 tile counter after out and lse (the
  handler zeroes it); static schedules, FP8 variants among them, carry none."""
  for v in FWD:
    want = (("tile_counter", (1,), "int32"),) if v.schedule.dynamic else ()
    assert config.fwd_scratch_shapes(v) == want, v.key
    assert not v.schedule.dynamic or (v.causal or v.masked) and v.dtype != config.FP8_DTYPE
  assert any(v.schedule.dynamic for v in FWD) and any(not v.schedule.dynamic for v in FWD)
  with pytest.raises(ValueError, match="direction"):
    config.fwd_scratch_shapes(_bwd(128))


def test_fp8_forward_schedule_table():
  """One schedule per head_dim, causal or not alike, and per-head or block descales alike but at
  head_dim 128 (block descales need whole chunks of 64 keys per key block); ping-pong except at
  head_dim 128; causal tiles launched longest first; a persistent tile list not causal with
  per-head descales where O has a buffer of its own (head_dim 64 and 128; at 256 O takes the V
  ring's bytes), one CTA per tile otherwise."""
  fp8 = [v for v in FWD if v.dtype == config.FP8_DTYPE]
  assert len(fp8) == 12
  for v in fp8:
    s = v.schedule
    tile_n_128 = 192 if v.block_descales else 224
    assert (s.tile_m, s.tile_n, s.num_stages, s.fma_exp2_per_8) == {
        64: (192, 128, 2, 2), 128: (128, tile_n_128, 2, 0), 256: (128, 128, 2, 0)}[v.head_dim]
    assert s.tile_n % config.FP8_DESCALE_ROWS == 0 or not v.block_descales
    assert s.pingpong == (v.head_dim != 128)
    persistent = not v.causal and not v.block_descales and v.head_dim <= 128
    assert (s.persistent, s.lpt, s.rescale_o_before_pv) == (persistent, v.causal, False)
    assert s.q_stages == 1  # O has a buffer of its own


def test_decode_variants_one_per_dtype_and_head_dim_pair():
  """Decode: 2 dtypes x the forward's 6 head-dim pairs over caches in the query's dtype, then
  float16 x the FP8 head dims over float8_e4m3fn caches (which bfloat16 queries run:
  decode_launched), then 2 dtypes x the chunked-prefill pairs; causal, windows and softcap are
  run-time scalars, so no mask flags."""
  chunked = [v for v in DECODE if v.schedule.chunked]
  plain = [v for v in DECODE if v.kv_dtype is None and not v.schedule.chunked]
  fp8 = [v for v in DECODE if v.kv_dtype is not None]
  assert DECODE == plain + fp8 + chunked
  assert len(plain) == 2 * len(PAIRS) == 12 and len(fp8) == len(config.FP8_HEAD_DIMS) == 3
  assert chunked == [config.chunked_variant(dtype, d, dv) for dtype in config.KERNEL_DTYPES
                     for d, dv in config.CHUNKED_HEAD_DIM_PAIRS]
  assert all(v.key.startswith("decode-sm90a-") and v.key.endswith("-m128n128s2")
             for v in chunked)
  assert {(v.dtype, v.head_dim, v.head_dim_v) for v in plain} == {
      (dtype, d, dv) for dtype in config.KERNEL_DTYPES for d, dv in PAIRS}
  assert {(v.dtype, v.head_dim, v.head_dim_v, v.kv_dtype) for v in fp8} == {
      ("float16", d, d, config.FP8_DTYPE) for d in config.FP8_HEAD_DIMS}
  for d in config.FP8_HEAD_DIMS:
    for dtype in config.KERNEL_DTYPES:
      call = config.decode_variant(dtype, d, d, kv_dtype=config.FP8_DTYPE)
      assert config.decode_launched(call) == config.decode_variant(
          "float16", d, d, kv_dtype=config.FP8_DTYPE) and call.dtype == dtype
  for v in plain + chunked:  # 16-bit caches: every variant runs itself
    assert config.decode_launched(v) == v
  for v in plain + fp8:
    assert v.direction == "decode" and v.key.startswith("decode-sm90a-")
    assert ("-kve4m3-" in v.key) == (v.kv_dtype is not None)
    assert not (v.causal or v.masked or v.deterministic or v.block_descales)
    assert v == config.decode_variant(v.dtype, v.head_dim, v.head_dim_v, kv_dtype=v.kv_dtype)
    for cfg in (_cfg(), _cfg(causal=True, window_left=8, softcap=5.0)):
      assert config.KernelVariant.for_call("decode", "sm90a", v.dtype, v.head_dim, v.head_dim_v,
                                           cfg, kv_dtype=v.kv_dtype) == v
  with pytest.raises(ValueError, match="kv_dtype: expected None .* or 'float8_e4m3fn', got "
                                       "'bfloat16'"):
    config.decode_variant("bfloat16", 128, 128, kv_dtype="bfloat16")


def test_chunked_schedule_table():
  """Chunked prefill: 128 x 128 tiles (the forward's causal key tile at head_dim <= 128), two
  stages, two consumer warpgroups, which fit 227 KiB with the Q tile; other pairs have none."""
  for d, dv in config.CHUNKED_HEAD_DIM_PAIRS:
    s = config.chunked_schedule(d, dv)
    assert s == config.DecodeSchedule(tile_m=128, tile_n=128, num_stages=2, chunked=True)
    assert s.tile_n == config.fwd_schedule(d, dv, causal=True).tile_n == 128
    assert 2 * (s.tile_m * d + s.num_stages * s.tile_n * (d + dv)) + 1024 <= config.SMEM_BYTES
  assert config.chunked_support("bfloat16", 128, 128) == (True, "")
  ok, why = config.chunked_support("bfloat16", 192, 128)
  assert not ok and "(192, 128) has no chunked variant" in why
  ok, why = config.chunked_support("float32", 128, 128)
  assert not ok and "dtype float32 has no kernel" in why
  with pytest.raises(ValueError, match=r"\(256, 256\) has no chunked prefill schedule"):
    config.chunked_schedule(256, 256)


def test_decode_fp8_support_names_what_it_takes():
  assert config.decode_fp8_support("bfloat16", 128, 128) == (True, "")
  ok, why = config.decode_fp8_support("float32", 128, 128)
  assert not ok and "a float32 query has no decode kernel over float8_e4m3fn caches" in why
  for d, dv in ((96, 96), (192, 128)):
    ok, why = config.decode_fp8_support("float16", d, dv)
    assert not ok and f"head_dim = head_dim_v in (64, 128, 256); got {d}, {dv}" in why


def test_decode_schedule_table():
  """64 packed query rows (one warpgroup), key tiles of 128 up to head dim 128 and 64 above,
  and the deepest K / V ring up to 4 stages whose stages and the Q tile fit 227 KiB; over FP8
  caches two 16-bit stages and the deepest e4m3 ring up to 4 that fits beside them."""
  smem = 227 * 1024
  for v in DECODE:
    if v.schedule.chunked:  # test_chunked_schedule_table
      continue
    s, d, dv = v.schedule, v.head_dim, v.head_dim_v
    assert isinstance(s, config.DecodeSchedule)
    assert (s.tile_m, s.tile_n) == (64, 128 if max(d, dv) <= 128 else 64)
    suffix = f"e{s.fp8_stages}" if v.kv_dtype else ""
    assert s.key == f"m64n{s.tile_n}s{s.num_stages}{suffix}" and v.key.endswith("-" + s.key)
    # 16-bit elements of Q and the 16-bit rings, bytes of the e4m3 rings; the mbarriers and
    # alignment take the last KiB.
    size = lambda stages, e4m3: (2 * (s.tile_m * d + stages * s.tile_n * (d + dv))
                                 + e4m3 * s.tile_n * (d + dv) + 1024)
    if v.kv_dtype is None:
      assert s.fp8_stages == 0 and size(s.num_stages, 0) <= smem, v.key
      assert s.num_stages == 4 or size(s.num_stages + 1, 0) > smem, v.key
    else:
      assert s.num_stages == 2 and size(2, s.fp8_stages) <= smem, v.key
      assert s.fp8_stages == 4 or size(2, s.fp8_stages + 1) > smem, v.key
  stages = {(v.head_dim, v.head_dim_v): v.schedule.num_stages for v in DECODE
            if v.kv_dtype is None and not v.schedule.chunked}
  assert stages == {(64, 64): 4, (96, 96): 4, (128, 128): 3, (192, 128): 4, (192, 192): 4,
                    (256, 256): 3}
  assert {v.head_dim: v.schedule.fp8_stages for v in DECODE if v.kv_dtype} == {
      64: 4, 128: 2, 256: 2}
  with pytest.raises(ValueError, match=r"\(head_dim, head_dim_v\): \(80, 80\) has no decode "
                                       r"schedule; accepted: \(\(64, 64\)"):
    config.decode_schedule(80, 80)
  with pytest.raises(ValueError, match=r"\(96, 96\) has no decode schedule over float8_e4m3fn "
                                       r"caches; accepted: head_dim = head_dim_v in \(64, 128, "
                                       r"256\)"):
    config.decode_schedule(96, 96, fp8_cache=True)


def test_backward_schedule_table():
  for v in DENSE_BWD:
    s, d = v.schedule, v.head_dim
    # Key split with S^T / dP^T up to hdim 128, head-dim split above it.
    assert s.swap_sdp == (d <= 128)
    assert (s.tile_m, s.tile_n) == {64: (128, 128), 96: (64, 128), 128: (80, 128)}.get(d, (64, 64))
    assert s.num_stages == 2
    assert s.dq_transposed == (s.tile_m % 64 != 0)  # 80 rows: dQ^T = K^T dS^T
    assert s.dq_split_m == (s.tile_m == 128)  # one 64-row dQ block per warpgroup
    assert s.dv_after_ds == (s.tile_m > 64)  # fp32 S^T, dP^T, P^T fit only without dV in flight
    assert (s.do_stages, s.dq_pieces) == ((1, 2) if d == 256 else (2, 1))
    two = v.deterministic and d > 128 and not (v.causal and d > 192)
    assert s.dq_copies == (2 if two else 1), v.key
    limit = {192: 4096, 128: 8192}[v.head_dim_v] if two and v.causal else None
    assert s.two_dq_copies_max_seq_q == limit, v.key
  # Masked variants take the causal tiles and one dQ accumulator; bias variants at head_dim 64
  # take head_dim 96's 64 x 128 tile (test_bias_variants_are_masked_variants_of_two_head_dims_
  # per_dtype).
  for v in BWD:
    if v.masked and not v.bias:
      causal = config.bwd_schedule(v.head_dim, v.head_dim_v, True, False)
      assert v.schedule == causal, v.key


def test_kernel_support_accepts_the_table_and_names_what_it_refuses():
  for direction in config.DIRECTIONS:
    for d, dv in PAIRS:
      assert config.kernel_support(direction, "float16", d, dv) == (True, "")
      assert config.kernel_support(direction, "bfloat16", d, dv, _cfg(causal=True)) == (True, "")
  refused = [
      (("fwd", "float32", 128, 128), "dtype float32"),
      (("bwd", "bfloat16", 160, 160), "head_dim 160"),
      (("fwd", "bfloat16", 128, 96), "head_dim_v 96 with head_dim 128"),
      (("sideways", "bfloat16", 128, 128), "direction 'sideways'"),
  ]
  for args, reason in refused:
    ok, text = config.kernel_support(*args)
    assert not ok and reason in text, text
  ok, text = config.kernel_support("fwd", "bfloat16", 192, 64)
  assert not ok and "accepted head_dim_v: (128, 192)" in text
  decode_refused = [
      (("decode", config.FP8_DTYPE, 128, 128), "float8_e4m3fn has a forward kernel only"),
      (("decode", "float32", 128, 128), "dtype float32 has no kernel"),
      (("decode", "float16", 160, 160), "head_dim 160 has no decode kernel"),
      (("decode", "bfloat16", 128, 64), "head_dim_v 64 with head_dim 128 has no decode kernel"),
      (("decode", "bfloat16", 128, 128, _cfg(has_segment_ids=True)), "no segment ids"),
  ]
  for args, reason in decode_refused:
    ok, text = config.kernel_support(*args)
    assert not ok and reason in text, text
  for direction in config.DIRECTIONS:
    assert config.kernel_support(direction, "bfloat16", 128, 128, _cfg(softcap=5.0)) == (True, "")
  for options in ({"window_left": 4}, {"has_segment_ids": True, "causal": True}):
    assert config.kernel_support("bwd", "bfloat16", 128, 128, _cfg(**options)) == (True, "")


def test_softcap_takes_the_masked_variants():
  for options in ({"softcap": 5.0}, {"softcap": 5.0, "causal": True},
                  {"softcap": 5.0, "deterministic": True}):
    for direction in ("fwd", "bwd"):
      v = config.KernelVariant.for_call(direction, "sm90a", "bfloat16", 128, 128, _cfg(**options))
      assert v.masked and not v.causal and v in config.shipped_variants(direction=direction)
      assert v.deterministic == (direction == "bwd" and options.get("deterministic", False))


def test_windows_and_segment_ids_take_the_masked_variant():
  for options in ({"window_left": 4}, {"window_right": 0}, {"has_segment_ids": True},
                  {"has_segment_ids": True, "causal": True, "window_left": 100}):
    for direction in ("fwd", "bwd"):
      v = config.KernelVariant.for_call(direction, "sm90a", "bfloat16", 128, 128, _cfg(**options))
      assert v.masked and not v.causal and v in (FWD if direction == "fwd" else BWD)
  assert not config.KernelVariant.for_call("fwd", "sm90a", "bfloat16", 128, 128,
                                           _cfg(causal=True)).masked


def test_a_direction_without_a_kernel_is_refused(monkeypatch):
  """The table may give a head-dim pair a forward kernel only (the lowering then runs the
  reference backward)."""
  monkeypatch.setitem(config.KERNEL_HEAD_DIM_PAIRS, "bwd", PAIRS[:3])
  assert config.kernel_support("fwd", "bfloat16", 256, 256) == (True, "")
  ok, text = config.kernel_support("bwd", "bfloat16", 256, 256)
  assert not ok and "head_dim 256 has no bwd kernel" in text
  # Bias variants need their own pairs' backward kernels, which 256 is not.
  bias = len(config.KERNEL_DTYPES) * len(config.BIAS_HEAD_DIM_PAIRS)
  assert len(config.shipped_variants("sm90a", "bwd")) == 2 * 3 * 3 * 2 + bias


@pytest.mark.parametrize("head_dim,rows", [(128, 160), (256, 192)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_bwd_scratch_shapes_round_seq_q_to_the_tile(deterministic, head_dim, rows):
  """seq_q 130 rounds up to 2 query blocks of 80 rows (hdim 128) or 3 of 64 (hdim 256)."""
  variant = _bwd(head_dim, causal=True, deterministic=deterministic)
  shapes = config.bwd_scratch_shapes(variant, batch=2, seq_q=130, num_heads=3)
  # causal at these head dims: one dQ accumulator even when deterministic
  expected = [("dq_accum", (2, 3, rows, head_dim), "float32"),
              ("lse_log2", (2, 3, rows), "float32"),
              ("delta", (2, 3, rows), "float32")]
  if deterministic:
    expected.append(("dq_semaphore", (2, 3, rows // variant.schedule.tile_m), "int32"))
  assert list(shapes) == expected
  with pytest.raises(ValueError, match="direction"):
    config.bwd_scratch_shapes(dataclasses.replace(variant, direction="fwd"), 1, 1, 1)


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 192), (192, 128), (256, 256)])
def test_deterministic_scratch_holds_two_dq_copies_above_hdim_128(head_dim, head_dim_v):
  """Copy c of the accumulator and its semaphores follow copy c - 1 in each (batch, head): two
  copies without a mask; with the causal mask at hdim 192 up to two_dq_copies_max_seq_q (4096
  at head_dim_v 192, 8192 at 128), one above; hdim 256 causal and the default mode one."""
  limit = {192: 4096, 128: 8192}.get(head_dim_v) if head_dim == 192 else None
  two_causal = 2 if limit else 1
  limit = limit or 4096
  cases = ((False, True, 100, 2), (False, True, 3 * limit, 2), (True, True, 100, two_causal),
           (True, True, limit, two_causal), (True, True, limit + 1, 1), (False, False, 100, 1),
           (True, False, 100, 1))
  for causal, deterministic, seq_q, copies in cases:
    variant = _bwd(head_dim, head_dim_v, causal, deterministic)
    assert config.dq_accum_copies(variant, seq_q) == copies
    rows = -(-seq_q // 64) * 64
    shapes = {name: shape for name, shape, _ in
              config.bwd_scratch_shapes(variant, batch=2, seq_q=seq_q, num_heads=3)}
    assert shapes["dq_accum"] == (2, 3, copies * rows, head_dim)
    assert shapes["lse_log2"] == shapes["delta"] == (2, 3, rows)
    assert shapes.get("dq_semaphore") == ((2, 3, copies * rows // 64) if deterministic else None)


def test_the_ffi_library_counts_the_fp8_descale_chunks_as_python_does():
  """The handler checks, and the variant wrapper lays out, the FP8 descales with kernel_abi.h's
  jaxflash_fp8_descale_chunks, whose integer arithmetic equals config.fp8_descale_chunks (also
  for tiles that are no multiple of 64, such as head_dim 128's 224 keys)."""
  ffi = pathlib.Path(config.__file__).parent / "ffi"
  abi = (ffi / "kernel_abi.h").read_text()
  body = re.search(r"jaxflash_fp8_descale_chunks\(int64_t length, int64_t tile\) \{\s*return "
                   r"(.*?);", abi, re.S).group(1)
  rows = int(re.search(r"#define JAXFLASH_FP8_DESCALE_ROWS (\d+)", abi).group(1))
  assert rows == config.FP8_DESCALE_ROWS
  expr = " ".join(body.replace("JAXFLASH_FP8_DESCALE_ROWS", str(rows)).replace("/", "//").split())
  for length in (1, 17, 63, 64, 65, 200, 224, 225, 4097, 16384):
    for tile in (64, 128, 192, 224):
      assert eval(expr, {"length": length, "tile": tile}) == config.fp8_descale_chunks(
          length, tile), (length, tile)
  assert config.fp8_descale_chunks(200, 224) == 4  # the tile's 224 keys need a fourth chunk
  for source in ("handlers.cc", "variant_fwd.cc"):
    text = (ffi / source).read_text()
    assert len(re.findall(r"jaxflash_fp8_descale_chunks\(", text)) == 2, source
    assert "DescaleRows" not in text, source


def test_the_kernel_abi_takes_the_dq_copies_from_the_library():
  """The handler learns a variant's tile_m and most dQ copies from the library
  (jaxflash_variant_info), not from the key or a constant of its own."""
  ffi = pathlib.Path(config.__file__).parent / "ffi"
  abi = (ffi / "kernel_abi.h").read_text()
  fields = re.search(r"typedef struct \{(.*?)\} JaxflashVariantInfo;", abi, re.S).group(1)
  assert re.findall(r"int32_t (\w+);", fields) == [
      "direction", "dtype", "head_dim", "head_dim_v", "causal", "deterministic", "tile_m",
      "max_dq_copies", "masked", "tile_n", "tile_counter", "kv_fp8", "bias", "mod_arrays"]
  assert re.findall(r"int32_t (\w+)\[JAXFLASH_MAX_MOD_ARRAYS\];", fields) == ["mod_dtypes",
                                                                             "mod_ranks"]
  handlers = (ffi / "handlers.cc").read_text()
  assert "info.tile_m" in handlers and "info.max_dq_copies" in handlers
  assert "info.kv_fp8" in handlers
  assert "DQ_COPIES" not in abi + handlers
  assert not re.search(r"\bfind\('-'|rfind\('-'\)|HasToken", handlers)
  assert max(v.schedule.dq_copies for v in BWD) == 2  # the kernels index a copy by one bit


def _documented_count(path: str, pattern: str) -> int:
  text = (pathlib.Path(__file__).resolve().parents[1] / path).read_text()
  found = re.findall(pattern, " ".join(text.split()))
  assert len(found) == 1, (path, pattern, found)
  return int(found[0])


def test_documented_variant_counts_are_the_shipped_ones():
  """docs/build.md and docs/kernels.md state how many variants ship: the table's counts."""
  fwd = config.shipped_variants("sm90a", "fwd")
  bwd = config.shipped_variants("sm90a", "bwd")
  decode = config.shipped_variants("sm90a", "decode")
  fp8 = [v for v in fwd if v.dtype == config.FP8_DTYPE]
  total = len(fwd) + len(bwd) + len(decode)
  assert _documented_count("docs/build.md", r"`--all` builds the (\d+) shipped variants") == total
  assert _documented_count("docs/build.md", r"(\d+) forward \(\d+ fp16/bf16") == len(fwd)
  assert _documented_count("docs/build.md", r"forward \((\d+) fp16/bf16") == len(fwd) - len(fp8)
  assert _documented_count("docs/build.md", r"fp16/bf16: .*?; (\d+) FP8\)") == len(fp8)
  assert _documented_count("docs/build.md", r"(\d+) backward \(the same") == len(bwd)
  assert _documented_count("docs/build.md", r"(\d+) decode \(the two dtypes") == len(decode)
  # The build time and sizes were measured on the forward and backward variants.
  assert _documented_count("docs/build.md",
                           r"built the (\d+) forward and backward variants in") == len(
                               fwd) + len(bwd)
  assert _documented_count("docs/build.md", r"With all (\d+) variants it is") == total
  assert _documented_count("docs/kernels.md", r"(\d+) forward and \d+ backward variants") == (
      len(fwd) - len(fp8))
  assert _documented_count("docs/kernels.md", r"\d+ forward and (\d+) backward variants") == len(
      bwd)


def test_short_dense_calls_at_head_dim_128_take_their_own_forward_variant():
  """Dense head_dim 128 forwards without the causal mask over at most SHORT_DENSE_MAX_KEYS keys
  run 128 x 128 tiles with two Q slots; longer ones (and seq_k None) 128 x 176 with one. The
  causal and masked variants, other head dims and the backward do not depend on seq_k."""
  limit = config.SHORT_DENSE_MAX_KEYS
  for dtype, short_name in (("float16", "f16"), ("bfloat16", "bf16")):
    at = lambda seq_k, **options: config.KernelVariant.for_call(
        "fwd", "sm90a", dtype, 128, 128, _cfg(**options), seq_k)
    short, long = at(limit), at(limit + 1)
    assert at(1) == short and at(None) == long and SHAPED_FWD.count(short) == 1
    assert short.key == f"fwd-sm90a-{short_name}-d128-dv128-m128n128s2"
    assert (short.schedule.q_stages, short.schedule.persistent) == (2, True)
    assert long.key == f"fwd-sm90a-{short_name}-d128-dv128-m128n176s2"
    assert long.schedule.q_stages == 1
    assert short in FWD and long in FWD
    for options in ({"causal": True}, {"window_left": 8}, {"softcap": 5.0},
                    {"has_segment_ids": True}):
      assert at(100, **options) == at(None, **options), options
  for head_dim, head_dim_v in PAIRS:
    if head_dim in config.SHORT_DENSE_HEAD_DIMS:
      continue
    for direction in ("fwd", "bwd"):
      at = lambda seq_k: config.KernelVariant.for_call(direction, "sm90a", "bfloat16", head_dim,
                                                       head_dim_v, _cfg(), seq_k)
      assert at(100) == at(None), (direction, head_dim)
  assert config.KernelVariant.for_call("bwd", "sm90a", "bfloat16", 128, 128, _cfg(), 100) == (
      _bwd(128))


def test_narrow_band_masked_calls_at_head_dim_64_take_their_own_forward_variant():
  """Masked head_dim 64 forwards whose band (left + right + 1 keys, the causal mask folded into
  the right side) is at most NARROW_BAND_MAX_KEYS run 128 x 128 tiles as a persistent list with
  two Q slots; wider or unbounded bands, other head dims, dense calls and the backward do not
  depend on the band."""
  limit = config.NARROW_BAND_MAX_KEYS
  assert _cfg(causal=True, window_left=128).band == 129
  assert _cfg(window_left=-3, window_right=64).band == 62
  assert _cfg(window_left=5, window_right=-9).band == 0
  assert _cfg(causal=True, window_left=10, window_right=7).band == 11
  for options in ({}, {"causal": True}, {"window_left": 8}, {"window_right": 8},
                  {"has_segment_ids": True}, {"softcap": 5.0}):
    assert _cfg(**options).band is None, options
  for dtype, short_name in (("float16", "f16"), ("bfloat16", "bf16")):
    at = lambda head_dim=64, direction="fwd", **options: config.KernelVariant.for_call(
        direction, "sm90a", dtype, head_dim, head_dim, _cfg(**options))
    narrow = at(causal=True, window_left=limit - 1)
    wide = at(causal=True, window_left=limit)
    assert narrow.key == f"fwd-sm90a-{short_name}-d64-dv64-masked-m128n128s2"
    assert (narrow.schedule.persistent, narrow.schedule.q_stages, narrow.schedule.lpt) == (
        True, 2, False)
    assert wide.key == f"fwd-sm90a-{short_name}-d64-dv64-masked-m192n128s2"
    assert narrow in FWD and wide in FWD and SHAPED_FWD.count(narrow) == 1
    for options in ({"window_left": 100, "window_right": 20},
                    {"window_left": 0, "window_right": 0, "has_segment_ids": True},
                    {"causal": True, "window_left": 128, "softcap": 5.0}):
      assert at(**options) == narrow, options
    for options in ({"window_left": 128}, {"causal": True, "has_segment_ids": True},
                    {"softcap": 5.0}, {"window_left": 200, "window_right": 100}):
      assert at(**options) == wide, options
    assert at(causal=True) != narrow and at() != narrow
    for head_dim in (96, 128, 256):
      assert at(head_dim, causal=True, window_left=128) == at(head_dim, window_left=0)
    for deterministic in (False, True):
      assert at(direction="bwd", causal=True, window_left=128, deterministic=deterministic) == (
          at(direction="bwd", window_left=0, deterministic=deterministic))


def test_bias_variants_are_masked_variants_of_two_head_dims_per_dtype():
  """A bias call of any mask runs one masked -bias variant per direction, dtype and pair of
  BIAS_HEAD_DIM_PAIRS (the narrow-band tile is not built for it); other pairs and the
  deterministic backward are refused with a reason naming the bias."""
  assert config.BIAS_HEAD_DIM_PAIRS == ((64, 64), (128, 128))
  for direction, variants in (("fwd", BIAS_FWD), ("bwd", BIAS_BWD)):
    if direction not in config.BIAS_DIRECTIONS:
      assert not variants
      continue
    assert [(v.dtype, v.head_dim) for v in variants] == [
        (dtype, d) for dtype in config.KERNEL_DTYPES for d, _ in config.BIAS_HEAD_DIM_PAIRS]
    assert all(v.masked and not v.causal and not v.deterministic for v in variants)
    assert all(f"-masked-bias-{v.schedule.key}" in v.key for v in variants)
    # 128 x 128 forward tiles at head_dim 64 and 128 (two consumer warpgroups: the bias loads
    # spilled the 192-row tile); backward: head_dim 96's 64 x 128 swapped tile at 64 (they
    # spilled the 128 x 128 one), the masked 80 x 128 one at 128.
    tiles = {(v.head_dim, v.schedule.tile_m, v.schedule.tile_n) for v in variants}
    assert tiles == ({(64, 128, 128), (128, 128, 128)} if direction == "fwd"
                     else {(64, 64, 128), (128, 80, 128)})
    if direction == "bwd":
      assert all(v.schedule.swap_sdp for v in variants)
  bias = (True, False, True)
  for options in ({}, {"causal": True}, {"window_left": 100, "window_right": 0},
                  {"has_segment_ids": True, "softcap": 5.0}):
    for d in (64, 128):
      cfg = _cfg(bias_dims=bias, **options)
      v = config.KernelVariant.for_call("fwd", "sm90a", "bfloat16", d, d, cfg, 4096)
      assert v in BIAS_FWD, (options, v.key)
  assert config.kernel_support("fwd", "bfloat16", 96, 96, _cfg(bias_dims=bias)) == (
      False, "bias: (head_dim, head_dim_v) (96, 96) has no bias kernel; accepted: "
             "((64, 64), (128, 128))")
  assert config.kernel_support("decode", "bfloat16", 64, 64, _cfg(bias_dims=bias))[0] is False
  ok, reason = config.kernel_support("bwd", "bfloat16", 64, 64,
                                     _cfg(bias_dims=bias, deterministic=True))
  assert not ok and reason.startswith("bias: ")
