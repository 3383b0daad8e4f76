"""Small jaxflash calls that reach each kernel family's special paths, for compute-sanitizer.

GPU host, with the kernels installed (a kernel wheel or JAXFLASH_CACHE_DIR):
  compute-sanitizer --tool racecheck --kernel-name kns=jaxflashkernels \
      python devtools/sanitize/calls.py masked_bwd
`scripts/gpu_check.sh sanitize` runs every tool on every family and summarises. Each family
runs its calls once, blocks, and checks that the results are finite where they must be (a
sanitizer run is no accuracy test: tests/test_gpu_*.py are).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash.fp8 import quantize_tensor


def _qkv(seed, b, sq, sk, h, hk, d, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(s), dtype)
               for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))


def _documents(lengths, total, pad=-1):
  """Segment ids of packed documents of `lengths`, the rest padding with id `pad`."""
  ids = np.full(total, pad, np.int32)
  start = 0
  for i, n in enumerate(lengths):
    ids[start:start + n] = i
    start += n
  return jnp.asarray(ids[None])


def _sink(heads, value=0.0):
  """Sink logits copied from the host (initcheck follows host copies into device buffers)."""
  return jax.device_put(np.full((heads,), value, np.float32))


def _timed(what, fn):
  """Runs fn, blocks on its result and prints how long it took (compile included): under a
  sanitizer the log then shows where a slow run spends its time."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  print(f"calls.py {what}: {time.perf_counter() - start:.1f} s", flush=True)
  return out


def _describe(q, kw):
  keys = ",".join(k for k, v in sorted(kw.items()) if v is not None and v is not False)
  return f"{q.dtype} d{q.shape[-1]} {keys or 'plain'}"


def _forward(q, k, v, **kw):
  return _timed("forward " + _describe(q, kw),
                lambda: jaxflash.attention(q, k, v, implementation="cute", **kw))


def _grad(q, k, v, **kw):
  def loss(q, k, v):
    return jnp.sum(jaxflash.attention(q, k, v, implementation="cute", **kw).astype(jnp.float32))
  return _timed("grad " + _describe(q, kw),
                lambda: jax.grad(loss, argnums=(0, 1, 2))(q, k, v))


def _masks():
  """(name, keyword arguments) of the masked calls: packed documents of 1, 170 and 129 tokens
  (tile-straddling), padding with empty rows, windows, softcap, sinks."""
  docs = _documents((1, 170, 129), 300)
  # Query rows 200-299 are padding whose id no key has: empty rows.
  q_pad, kv_pad = _documents((200,), 300, pad=-1), _documents((200,), 300, pad=-2)
  sink = _sink(4)
  return (("documents_causal", dict(causal=True, q_segment_ids=docs, kv_segment_ids=docs)),
          ("padding_empty_rows", dict(q_segment_ids=q_pad, kv_segment_ids=kv_pad)),
          ("window", dict(causal=True, window_size=(70, 0))),
          ("window_both_sides", dict(window_size=(33, 17))),
          ("softcap_sink_documents", dict(causal=True, q_segment_ids=docs,
                                          kv_segment_ids=docs, softcap=20.0,
                                          learnable_sink=sink)))


def dense_fwd():
  for d in (64, 128, 256):
    q, k, v = _qkv(d, 2, 300, 300, 8, 2, d)
    for causal in (False, True):
      _forward(q, k, v, causal=causal)
  q, k, v = _qkv(1, 1, 200, 330, 4, 1, 128)
  _forward(q, k, v, causal=True, learnable_sink=_sink(4, 1.0))
  # More tiles than SMs: persistent CTAs cycle their two Q slots (causal lists at head_dim 64,
  # 96 and 128, head_dim 96 not causal); 700 rows start the causal tiles above row 0.
  for d, causal in ((64, True), (96, False), (96, True), (128, True)):
    q, k, v = _qkv(d, 2, 700, 700, 40, 8, d)
    _forward(q, k, v, causal=causal)


def dense_bwd():
  for d in (64, 128, 256):
    q, k, v = _qkv(d, 1, 300, 300, 4, 2, d)
    for causal in (False, True):
      for deterministic in (False, True):
        _grad(q, k, v, causal=causal, deterministic=deterministic)


def masked_fwd():
  q, k, v = _qkv(3, 1, 300, 300, 4, 2, 128)
  for _, kw in _masks():
    _forward(q, k, v, **kw)
  q, k, v = _qkv(4, 1, 300, 300, 4, 2, 64)
  _forward(q, k, v, **dict(_masks())["softcap_sink_documents"])


def masked_bwd():
  q, k, v = _qkv(5, 1, 300, 300, 4, 2, 128)
  for name, kw in _masks():
    if name != "softcap_sink_documents":  # its own family, below
      for deterministic in (False, True):
        _grad(q, k, v, deterministic=deterministic, **kw)
  q, k, v = _qkv(6, 1, 300, 300, 4, 2, 256)
  for deterministic in (False, True):
    _grad(q, k, v, deterministic=deterministic, **dict(_masks())["documents_causal"])


def masked_bwd_softcap_sink():
  """The masked backward with softcap and a sink on packed documents: a family of its own, as
  XLA's compile of this gradient stalled under racecheck, synccheck and initcheck (not under
  memcheck) and would hide the other masked backward calls' results."""
  q, k, v = _qkv(5, 1, 300, 300, 4, 2, 128)
  for deterministic in (False, True):
    _grad(q, k, v, deterministic=deterministic, **dict(_masks())["softcap_sink_documents"])


def bias():
  """The bias variants' forward and gradient (the bias's too) at head_dim 64 and 128: the bias
  tiles that ride on the K stages (forward) and into the dS buffers (backward, with the dbias
  TMA store's wait before each stage's release), the producer warp's zeros where causal key
  tiles skip query blocks, 333 keys (rows padded to 336, keys past the length out of bounds),
  a bias broadcast over batch, one over queries (one row per head), softcap (dbias from
  registers)."""
  rng = np.random.default_rng(11)
  for d in (64, 128):
    q, k, v = _qkv(d + 11, 2, 300, 333, 4, 2, d)
    for shape, kw in (((1, 4, 300, 333), dict(causal=True)), ((2, 4, 1, 333), {}),
                      ((2, 4, 300, 333), dict(softcap=5.0, causal=True))):
      b = jax.device_put(np.asarray(rng.standard_normal(shape), np.float32)).astype(q.dtype)

      def loss(q, k, v, b, kw=kw):
        out = jaxflash.attention(q, k, v, bias=b, implementation="cute", **kw)
        return jnp.sum(out.astype(jnp.float32))
      name = f"bias {shape} " + _describe(q, kw)
      out = _timed("forward " + name,
                   lambda: jaxflash.attention(q, k, v, bias=b, implementation="cute", **kw))
      grads = _timed("grad " + name, lambda: jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, b))
      for x in (out,) + tuple(grads):
        assert np.isfinite(np.asarray(x, np.float32)).all(), name


def mods():
  """score_mod / mask_mod variants, forward and gradient, on tests/test_gpu_mods.py's cases
  (their variants must be in the kernel cache: `python devtools/prebuild_mods.py`): reads of
  closed-over arrays at computed indices (ALiBi with a document mask over 400 keys and a sink,
  T5 buckets by clipped distance), a mask_mod's block ranges (documents, rows that see no
  key, 200 keys under 300 queries)."""
  from tests import test_gpu_mods
  for name in ("alibi_document_bf16_d128_sink", "t5_distance_bf16_d128_s1000",
               "document_bf16_d64_s1000", "empty_rows_bf16_d64"):
    q, k, v, make, arrays, w_out, w_lse, kwargs = test_gpu_mods._case(name)
    attend = test_gpu_mods._attend(make, kwargs)
    argnums = test_gpu_mods._float_argnums(arrays)
    loss = test_gpu_mods._loss(attend, w_out, w_lse)
    out, lse = _timed(f"forward mods {name}", lambda: jax.jit(attend)(q, k, v, *arrays))
    grads = _timed(f"grad mods {name}", lambda: jax.jit(jax.grad(loss, argnums))(
        q, k, v, *arrays))
    assert np.isfinite(np.asarray(out, np.float32)).all(), name
    for g in grads:
      assert np.isfinite(np.asarray(g, np.float32)).all(), name


def fp8_fwd():
  for d in (64, 128, 256):
    q, k, v = _qkv(d + 7, 1, 300, 300, 4, 2, d)
    for block_size in (None, 64):
      q8, k8, v8, qd, kd, vd = jaxflash.quantize_fp8(q, k, v, block_size=block_size)
      for causal in (False, True):
        _forward(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                 learnable_sink=_sink(4) if causal else None)


def decode():
  """kv_cache_attention on the split-KV kernel: contiguous and paged (16 and 64 keys a page,
  pages permuted, table entries past the lengths out of the pool), lengths 0, 1, 17 and a
  partial last page, GQA 4:1, seq_q 1 and 3 (causal), window + softcap + sink; the paged and
  contiguous calls again over float8_e4m3fn caches with their descales."""
  rng = np.random.default_rng(9)
  for d in (64, 128, 256):
    b, cap, h, hk = 4, 200, 8, 2
    q3 = jnp.asarray(rng.standard_normal((b, 3, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, cap, hk, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, cap, hk, d)), jnp.bfloat16)
    lengths = jax.device_put(np.asarray([0, 1, 17, 150], np.int32))
    kw = dict(implementation="cute")
    outs = [jaxflash.kv_cache_attention(q3[:, :1], k, v, lengths, causal=False, **kw),
            jaxflash.kv_cache_attention(q3, k, v, lengths, num_splits=3, **kw),
            jaxflash.kv_cache_attention(q3, k, v, lengths, window_size=(20, 0), softcap=20.0,
                                        learnable_sink=_sink(h, 0.5), **kw)]
    for page_size in (16, 64):
      pages = -(-cap // page_size)
      order = rng.permutation(b * pages + 2)
      table = np.asarray(order[:b * pages].reshape(b, pages), np.int32)
      table[0, :] = 10 ** 6  # length 0: never read
      pool = lambda x: jnp.zeros((b * pages + 2, page_size) + x.shape[2:], x.dtype).at[
          order[:b * pages]].set(jnp.pad(x, ((0, 0), (0, pages * page_size - cap), (0, 0),
                                              (0, 0))).reshape(b * pages, page_size,
                                                               *x.shape[2:]))
      outs.append(jaxflash.kv_cache_attention(q3, pool(k), pool(v), lengths,
                                              page_table=jax.device_put(table), **kw))
      # float8_e4m3fn caches: the same pool with a descale per (page, kv head).
      (k8, kd), (v8, vd) = quantize_tensor(pool(k)), quantize_tensor(pool(v))
      outs.append(jaxflash.kv_cache_attention(q3, k8, v8, lengths,
                                              page_table=jax.device_put(table), k_descale=kd,
                                              v_descale=vd, **kw))
    (k8, kd), (v8, vd) = quantize_tensor(k), quantize_tensor(v)  # per (sequence, kv head)
    outs.append(jaxflash.kv_cache_attention(q3, k8, v8, lengths, k_descale=kd, v_descale=vd,
                                            **kw))
    for out in jax.block_until_ready(outs):
      assert np.isfinite(np.asarray(out, np.float32)).all()


# scripts/gpu_check.sh starts the runs in this order (the longest first).
FAMILIES = {f.__name__: f for f in (masked_bwd, masked_bwd_softcap_sink, dense_bwd, bias,
                                    fp8_fwd, masked_fwd, decode, dense_fwd, mods)}
# Families whose variants are never shipped: run when named (`gpu_check.sh sanitize mods`), not
# in the default list.
NAMED_ONLY = ("mods",)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("family", choices=sorted(FAMILIES) + ["list"])
  args = p.parse_args(argv)
  if args.family == "list":
    print(" ".join(f for f in FAMILIES if f not in NAMED_ONLY))
    return 0
  FAMILIES[args.family]()
  print(f"calls.py {args.family}: done", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
