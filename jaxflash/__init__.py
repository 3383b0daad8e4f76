"""jaxflash: FlashAttention-3/4 class attention for JAX (CuTe DSL kernels through the XLA FFI).

Importing it needs jax only: no kernels, no Flax, no GPU.
"""

from jaxflash.attention import attention
from jaxflash.context_parallel import context_parallel_attention
from jaxflash.fp8 import quantize_fp8
from jaxflash.kv_cache import kv_cache_attention, update_kv_cache
from jaxflash.nn import dot_product_attention

__version__ = "0.1.0.dev0"

__all__ = ["attention", "context_parallel_attention", "dot_product_attention",
           "kv_cache_attention", "quantize_fp8", "update_kv_cache", "__version__"]
