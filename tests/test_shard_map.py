"""jaxflash.attention inside jax.shard_map with the default check_vma=True (2 fake CPU devices).

The scan carries of the reference and the primitives' output types must vary over the manual
axes of their inputs, else shard_map's type check rejects the forward or the custom_vjp bwd.
"""

import os
import subprocess
import sys

_CODE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxflash
mesh = jax.make_mesh((2,), ("x",))
rng = np.random.default_rng(0)
host = [jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((4, 16, 4, 8), (4, 20, 2, 8), (4, 20, 2, 8))]
q, k, v = (jax.device_put(x, NamedSharding(mesh, P("x"))) for x in host)
attn = lambda q, k, v: jaxflash.attention(q, k, v, causal=True)
f = jax.shard_map(attn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) ** 2))
np.testing.assert_allclose(jax.jit(f)(q, k, v), attn(*host), rtol=1e-5, atol=1e-6)
for got, want in zip(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v),
                     jax.grad(loss(attn), argnums=(0, 1, 2))(*host)):
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
print("OK")
"""


def test_attention_inside_shard_map_with_vma_checks():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=2").strip())
  proc = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
