"""Byte-level decoder-only transformer trained with Flax on jaxflash attention."""
