"""The public `jaxflash.attention`: argument checks, defaults, and the choice of implementation."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from jaxflash import (checks, few_rows, fp8, implementation, mods_core, primitives,
                      programmable)
from jaxflash.sink import add_learnable_sink, check_learnable_sink
from jaxflash.config import AttentionConfig, KernelVariant, kernel_support


def _check_segments(q_segment_ids, kv_segment_ids, query, key):
  if q_segment_ids is None and kv_segment_ids is None:
    return False
  if q_segment_ids is None or kv_segment_ids is None:
    raise ValueError("q_segment_ids/kv_segment_ids: pass both or neither (for self-attention "
                     "pass the same ids twice)")
  for name, ids, seq in (("q_segment_ids", q_segment_ids, query.shape[1]),
                         ("kv_segment_ids", kv_segment_ids, key.shape[1])):
    checks.check_array(name, ids, 2, "(batch, seq)")
    if tuple(ids.shape) != (query.shape[0], seq):
      raise ValueError(f"{name}: expected shape {(query.shape[0], seq)}, got {tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name}: expected an integer dtype, got {ids.dtype}")
  return True


def _resolve_implementation(requested: Optional[str], dtype: str, head_dim: int,
                            head_dim_v: int, config: AttentionConfig,
                            seq_k: Optional[int] = None) -> str:
  """'cute' or 'reference' (implementation.resolve). The lowering loads the kernels where a CUDA
  device is; without one, 'cute' may still lower for a GPU elsewhere (jax.export)."""
  return implementation.resolve(
      requested, kernel_support("fwd", dtype, head_dim, head_dim_v, config),
      lambda: _missing_kernel(dtype, head_dim, head_dim_v, config, seq_k))


def _missing_kernel(dtype: str, head_dim: int, head_dim_v: int, config: AttentionConfig,
                    seq_k: Optional[int] = None) -> str:
  """Why the forward kernel of this call is unavailable here ("" when it is installed or
  buildable: its lowering, right after the trace, builds it).

  The backward kernel is not looked for: the gradient's lowering finds or builds it (and raises
  where it cannot), so a call without a gradient never loads or builds a backward variant.
  """
  from jaxflash import ffi  # only on a CUDA host: keeps `import jaxflash` light
  variant = KernelVariant.for_call("fwd", "sm90a", dtype, head_dim, head_dim_v, config, seq_k)
  return ffi.variant_available(variant)[1]


def empty_result(query, value, out_dtype=None):
  """No query, head or key to attend to: zeros (in out_dtype, default the query's) and
  lse = -inf, without any kernel."""
  b, seq_q, h, _ = query.shape
  dtype = query.dtype if out_dtype is None else out_dtype
  out = jnp.zeros((b, seq_q, h, value.shape[-1]), dtype)  # grads w.r.t. inputs: zeros
  lse = jnp.full((b, h, seq_q), -jnp.inf, jnp.promote_types(dtype, jnp.float32))
  return out, lse


def attention(query, key, value, *, causal: bool = False, softmax_scale: Optional[float] = None,
              window_size=(None, None), softcap: Optional[float] = None, q_segment_ids=None,
              kv_segment_ids=None, learnable_sink=None, q_descale=None, k_descale=None,
              v_descale=None, out_dtype=None, bias=None, score_mod=None, mask_mod=None,
              deterministic: bool = False, return_lse: bool = False,
              implementation: Optional[str] = None):
  """Scaled dot-product attention, FlashAttention style.

  Args:
    query: (batch, seq_q, num_heads, head_dim), float16/bfloat16 (float32 on the reference).
    key: (batch, seq_k, num_kv_heads, head_dim); num_heads % num_kv_heads == 0 (MQA/GQA).
    value: (batch, seq_k, num_kv_heads, head_dim_v).
    causal: query i sees keys j <= i + seq_k - seq_q (bottom-right aligned, as FlashAttention).
    softmax_scale: multiplies the scores; default head_dim ** -0.5.
    window_size: (left, right): query i sees keys in [i' - left, i' + right] where
      i' = i + seq_k - seq_q; None is unbounded. Negative values shift the band.
    softcap: if set, scores become softcap * tanh(scores / softcap) (after scaling). The
      CuTe kernels take it at run time (masked variants), forward and backward.
    q_segment_ids: (batch, seq_q) integers; with kv_segment_ids (batch, seq_k), tokens attend
      only to keys with an equal id (packed sequences, padding).
    learnable_sink: (num_heads,) float32 logits, one per query head (gpt-oss's attention
      sinks): each row's softmax runs over its visible scores plus the sink logit, whose column
      has no value, so the row's weights sum to less than one; lse includes it, and a row that
      sees no key outputs zeros with lse equal to its sink. Differentiable. None: no sink.
    q_descale, k_descale, v_descale: float8_e4m3fn inputs only: float32 descales (x = x8 *
      descale), all three per (batch, num_kv_heads) or all per block: (batch, num_heads,
      ceil(seq_q / block)) for the query and (batch, num_kv_heads, ceil(seq_k / block)) for key
      and value, block a power of two (the counts give it; one block on both sides is one
      descale per head); `jaxflash.quantize_fp8` makes them. None: 1. FP8 inputs
      take dense or causal masks, GQA/MQA, seq_q != seq_k, learnable sinks and head_dim
      64/128/256 (= head_dim_v) and have no gradient (differentiating raises). Descales must be
      positive. On a Hopper GPU per-head descales and blocks of 64 tokens or more run the FP8
      kernel; smaller blocks run dequantized on the float32 reference.
    out_dtype: float8_e4m3fn inputs only: bfloat16 (default) or float16.
    bias: (batch or 1, num_heads or 1, seq_q or 1, seq_k) float32 / bfloat16 / float16, added
      to the scores after the scale and softcap. Differentiable: its gradient is reduced over
      the dims of size 1 and returned in the bias's dtype. The CuTe kernels take it (with any
      mask, softcap and sink) at head dims 64 and 128 (head_dim_v equal) in float16 / bfloat16,
      reading it in the query's dtype (a float32 bias is rounded to it, as the scores are);
      the gradient comes from one value in the query's dtype per (batch, head, query, key)
      written by the backward kernel (summed over broadcast dims in float32), so a bias call's
      backward holds batch x heads x seq_q x seq_k x 2 bytes of scratch (seq_k rounded up to a
      multiple of 8). A deterministic backward of a bias call runs the reference.
    score_mod: score_mod(score, batch, head, q_idx, kv_idx) -> score, a JAX function of
      scalars (int32 indices, q_idx in [0, seq_q), kv_idx in [0, seq_k), head a query head;
      score the scaled, soft-capped score plus the bias) applied to every score; it may close
      over arrays (ALiBi slopes, bias tables), and the gradients of the float ones are
      returned by jax.grad.
    mask_mod: mask_mod(batch, head, q_idx, kv_idx) -> bool, a JAX function of scalars like
      score_mod: a key is seen only where it is True (and causal, window_size and the segment
      ids let it). Python control flow on the arguments raises a ValueError when the call is
      traced; use jnp.where / lax.select. Without a bias, the forward CuTe kernel runs them
      (head dims 64 and 128, float16 / bfloat16): they are traced to a jaxpr, translated into
      the kernel's score step and compiled once per function (cached on disk by the jaxpr's
      hash; docs/kernels.md lists the supported primitives); their closed-over arrays (up to
      4, rank up to 4) are operands, replicated across shards, and a call whose functions
      read `batch` or `head` keeps that dim unsharded. The backward kernel takes them where
      score_mod's derivative by the score is a constant (ALiBi, T5 buckets, any mask_mod) and
      there is no softcap and deterministic=False. The closed-over float arrays' gradients,
      other backward passes and every call the kernels cannot take (another primitive, a bias
      as well: implementation="cute" raises naming the reason) run the blocked reference
      implementation (memory linear in seq_k).
    deterministic: make the backward pass bitwise reproducible run to run. Without a causal
      mask at head_dim > 128 the CuTe backward then keeps two fp32 dQ accumulators (scratch of
      2 x batch x num_heads x seq_q x head_dim x 4 bytes instead of one).
    return_lse: also return the log-sum-exp (batch, num_heads, seq_q) float32, natural log of
      the softmax denominator in the scaled-score domain; -inf for rows that see no key.
      It is differentiable.
    implementation: None (CuTe kernels on a Hopper GPU when they cover the call and the forward
      kernel is built or buildable here, else the reference; a RuntimeWarning names the build
      command when only the build is missing), "cute" (kernels or an error, raised when the
      call is traced), "reference" (pure JAX). The backward kernel is found or built when a
      gradient of the call lowers, which raises where it cannot be had.

  Returns:
    out (batch, seq_q, num_heads, head_dim_v) in the query dtype, or (out, lse). Rows that see
    no key are exactly zero.

  The forward kernels take the sink as a run-time operand and add it to each row's
  denominator in their epilogue; its gradient is a reduction over (out, lse) in XLA
  (jaxflash/sink.py). Calls with few query rows (decoding: seq_q x query heads per kv head up
  to 64, no segment ids) run the forward on the split-KV decode kernel of
  `kv_cache_attention` and the backward on the usual kernels (jaxflash/few_rows.py).
  """
  return _attention(query, key, value, None, causal=causal, softmax_scale=softmax_scale,
                    window_size=window_size, softcap=softcap, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, learnable_sink=learnable_sink,
                    q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                    out_dtype=out_dtype, bias=bias, score_mod=score_mod, mask_mod=mask_mod,
                    deterministic=deterministic, return_lse=return_lse,
                    implementation=implementation)


def attention_with_kv_lengths(query, key, value, kv_lengths, **options):
  """`attention(query, key, value, **options)` with the keys at or past kv_lengths[b] (int32
  (batch,), a run-time value) masked: segment ids (queries 0; keys 0 below the length, 1
  past it), except that a call with few query rows and no causal mask or window gives the
  decode kernel the lengths themselves. jaxflash.dot_product_attention's key_value_seq_lengths
  without query_seq_lengths."""
  q_ids, kv_ids = few_rows.length_segment_ids(*query.shape[:2], key.shape[1], kv_lengths)
  return _attention(query, key, value, kv_lengths, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                    **options)


def _attention(query, key, value, kv_lengths, *, causal: bool = False,
               softmax_scale: Optional[float] = None, window_size=(None, None),
               softcap: Optional[float] = None, q_segment_ids=None, kv_segment_ids=None,
               learnable_sink=None, q_descale=None, k_descale=None, v_descale=None,
               out_dtype=None, bias=None, score_mod=None, mask_mod=None,
               deterministic: bool = False, return_lse: bool = False,
               implementation: Optional[str] = None):
  """attention(); kv_lengths: None, or the lengths behind the segment ids (see
  attention_with_kv_lengths)."""
  dtype = checks.check_tensors(query, key, value, extra_dtypes=(fp8.FP8_DTYPE,))
  config = checks.check_options(causal, softmax_scale, window_size, softcap, deterministic,
                          return_lse, implementation, query.shape[-1])
  has_segments = _check_segments(q_segment_ids, kv_segment_ids, query, key)
  if dtype == fp8.FP8_DTYPE:
    for name, x in (("bias", bias), ("score_mod", score_mod), ("mask_mod", mask_mod)):
      if x is not None:
        raise TypeError(f"{name}: float8_e4m3fn inputs take no {name} (pass None)")
    return _fp8_call(query, key, value, config.replace(has_segment_ids=has_segments),
                     learnable_sink, (q_descale, k_descale, v_descale), out_dtype, return_lse,
                     implementation)
  for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                  ("out_dtype", out_dtype)):
    if x is not None:
      raise TypeError(f"{name}: applies to float8_e4m3fn inputs only; these are {dtype} (pass "
                      f"None)")
  if learnable_sink is not None:
    check_learnable_sink(learnable_sink, query.shape[2], accept_float64=dtype == "float64")
  config = config.replace(has_segment_ids=has_segments)
  mods = programmable.check_mods(bias, score_mod, mask_mod, query, key, dtype)
  if mods is not None and not programmable.functions_only(mods):
    # A bias alone: an operand of the primitives (kernels or reference), not a ScoreMods.
    config = config.replace(bias_dims=programmable.bias_dims(bias, query))
    mods = None
  arrays = ()
  if mods is not None:
    kernel_config, arrays, reason = programmable.kernel_config(config, mods, implementation)
    if kernel_config is not None and not kernel_config.has_mods:
      mods = None  # a score_mod that returns its score: the plain call
  if mods is not None:
    if kernel_config is None:
      impl = programmable.reference_instead(implementation, reason)
    else:
      impl = _resolve_implementation(implementation, dtype, query.shape[-1], value.shape[-1],
                                     kernel_config, key.shape[1])
      if impl == "cute":
        config = kernel_config
  else:
    impl = _resolve_implementation(implementation, dtype, query.shape[-1], value.shape[-1],
                                   config, key.shape[1])
  config = config.replace(implementation=impl)
  if 0 in query.shape[:3] or 0 in key.shape[:2]:
    out, lse = empty_result(query, value)
    if learnable_sink is not None:  # every row is empty: lse = its sink
      out, lse = add_learnable_sink(out, lse, learnable_sink)
  else:
    if has_segments:
      q_segment_ids = jnp.asarray(q_segment_ids, jnp.int32)
      kv_segment_ids = jnp.asarray(kv_segment_ids, jnp.int32)
    config = config.replace(has_sink=learnable_sink is not None)
    # Masked by lengths, the decode kernel takes the lengths instead of the segment ids.
    few = config.replace(has_segment_ids=False) if kv_lengths is not None else config
    if config.has_mods:
      out, lse = mods_core.attention_core(config, query, key, value, q_segment_ids,
                                          kv_segment_ids, learnable_sink, arrays)
    elif mods is not None:
      out, lse = programmable.attention(config, mods, query, key, value, q_segment_ids,
                                        kv_segment_ids, learnable_sink)
    elif few_rows.takes(few, dtype, query.shape, key.shape, value.shape[-1],
                      kv_lengths=kv_lengths is not None):
      out, lse = few_rows.attention_core(few, query, key, value, kv_lengths, learnable_sink)
    else:
      out, lse = primitives.attention_core(config, query, key, value, q_segment_ids,
                                           kv_segment_ids, learnable_sink,
                                           bias if config.has_bias else None)
  return (out, lse) if return_lse else out


def _fp8_call(query, key, value, config: AttentionConfig, learnable_sink, descales, out_dtype,
              return_lse: bool, implementation: Optional[str]):
  """attention() of float8_e4m3fn inputs (jaxflash/fp8.py)."""
  out_name = fp8.check_fp8_call(config, query.shape[-1], value.shape[-1], out_dtype)
  if learnable_sink is not None:
    check_learnable_sink(learnable_sink, query.shape[2])
  config = config.replace(has_sink=learnable_sink is not None)
  checked = fp8.check_descales(query, key, value, *descales)
  impl = _resolve_implementation(implementation, fp8.FP8_DTYPE, query.shape[-1],
                                 value.shape[-1], config)
  small_blocks = checked.block_size is not None and checked.block_size < fp8.KERNEL_MIN_BLOCK
  if impl == "cute" and small_blocks:
    if implementation == "cute":
      raise ValueError(
          f"implementation='cute': the FP8 kernel takes per-head descales (batch, "
          f"num_kv_heads) or blocks of {fp8.KERNEL_MIN_BLOCK} tokens or more; this call has "
          f"blocks of {checked.block_size}; use implementation=None (auto) or 'reference'")
    impl = "reference"
  config = config.replace(implementation=impl)
  if 0 in query.shape[:3] or 0 in key.shape[:2]:
    out, lse = empty_result(query, value, out_name)
    if learnable_sink is not None:  # every row is empty: lse = its sink
      out, lse = add_learnable_sink(out, lse, learnable_sink)
  else:
    out, lse = fp8.fp8_attention(config, out_name, checked.block_size, query, key, value,
                                 checked.q, checked.k, checked.v, learnable_sink)
  return (out, lse) if return_lse else out
