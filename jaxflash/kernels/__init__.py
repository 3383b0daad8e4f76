"""CuTe DSL kernels (device code and host launch functions); needs nvidia-cutlass-dsl.

Modules here import cutlass, the stdlib and jaxflash.config only: never jax, never torch.
"""
