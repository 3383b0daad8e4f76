"""Settings of the example: `tiny` (CPU, minutes) and `small` (one GPU)."""

from __future__ import annotations

import dataclasses
import pathlib

DEFAULT_CORPUS = pathlib.Path(__file__).parent / "data" / "tinyshakespeare.txt"


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on; `main.py --set key=value` overrides single fields."""

  # Model: decoder-only, byte-level (vocab 256), pre-norm, GQA attention with RoPE, SwiGLU.
  num_layers: int = 6
  d_model: int = 768
  num_heads: int = 6
  num_kv_heads: int = 2
  mlp_dim: int = 2048
  rope_base: float = 10000.0
  dtype: str = "bfloat16"  # activations; parameters stay float32
  vocab_size: int = 256
  # Data: random windows of the corpus; the last eval_fraction of it is held out.
  corpus: str = str(DEFAULT_CORPUS)
  eval_fraction: float = 0.1
  seq_len: int = 2048
  batch_size: int = 16  # global, split over the mesh's data axis
  # Optimiser: AdamW, linear warmup then cosine decay to 10 %.
  learning_rate: float = 1e-3
  warmup_steps: int = 50
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  steps: int = 200
  decay_steps: int = 0  # length of the schedule; 0 = steps (set it to extend a run unchanged)
  # Bookkeeping.
  eval_every: int = 50
  eval_batches: int = 4
  checkpoint_every: int = 100
  seed: int = 0

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def replace(self, **changes) -> "Config":
    return dataclasses.replace(self, **changes)


CONFIGS = {
    # About 38M parameters, head_dim 128 and 32k tokens a step: sized for one Hopper GPU,
    # where a 2k sequence makes attention a visible share of the step.
    "small": Config(),
    # About 0.5M parameters; a few hundred steps train in minutes on 2 CPU cores.
    "tiny": Config(num_layers=2, d_model=128, num_heads=4, num_kv_heads=2, mlp_dim=384,
                   dtype="float32", seq_len=128, batch_size=16, learning_rate=3e-3,
                   warmup_steps=20, steps=300, eval_every=50, eval_batches=2,
                   checkpoint_every=100),
}


def get_config(name: str) -> Config:
  if name not in CONFIGS:
    raise ValueError(f"config: unknown {name!r}; accepted: {', '.join(sorted(CONFIGS))}")
  return CONFIGS[name]


def apply_overrides(config: Config, overrides) -> Config:
  """Applies 'field=value' strings, converting each value to the field's type."""
  types = {f.name: type(getattr(config, f.name)) for f in dataclasses.fields(config)}
  changes = {}
  for item in overrides:
    name, sep, value = item.partition("=")
    if not sep or name not in types:
      raise ValueError(f"--set: expected field=value with field in {sorted(types)}, got "
                       f"{item!r}")
    changes[name] = types[name](value)
  return config.replace(**changes)
