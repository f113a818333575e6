"""Named training recipes: model and training settings that go together, applied beneath what a
user sets (`logitlab train --recipe speedrun`: the recipe's fields replace the defaults and the
preset's; a TOML table or a flag still overrides any of them).

"speedrun" is the small-model recipe of the modded-nanogpt speedruns and nanochat, each part a
typed option with its reference beside it:

- Muon for the 2-D hidden matrices, AdamW for the rest (TrainConfig.optimizer="muon"; Jordan et
  al. 2024), with a rate per role: the embedding table and the matrices (embedding_lr, matrix_lr);
- warmup-stable-decay to zero (lr_schedule="wsd"; Hu et al. 2024, Hägele et al. 2024);
- ReLU² MLPs (mlp="relu2"; So et al. 2021), QK-norm (qk_norm; Dehghani et al. 2023), value
  embeddings on every other layer (value_embeddings), logits soft-capped at 15 (logit_softcap;
  Gemma 2) and zero-initialised output projections (zero_init_output).

Two parts of the published recipes are options here but not in the preset, because on the
benchmark's small model they measured worse: an untied head with its own rate (tie_embeddings=False,
head_lr) and parameter-free RMSNorm (norm_affine=False): taking either out of the published recipe
gained 0.02-0.03 bits per byte (seed 1), putting either back into the preset lost 0.005-0.011 (seeds
2 and 3; docs/training.md has the tables, bench/speedrun.py the benchmark). The rates are the
published ones, not tuned further. It imports nothing of logitlab.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recipe:
    """ModelConfig fields (`model`) and TrainConfig fields (`train`) set together."""

    name: str
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)


SPEEDRUN = Recipe(
    "speedrun",
    model=dict(mlp="relu2", d_ff=None, qk_norm=True, tie_embeddings=True, value_embeddings="alternate",
               logit_softcap=15.0, zero_init_output=True, norm_affine=True, norm="rmsnorm", positions="rope",
               bias=False),
    train=dict(optimizer="muon", lr_schedule="wsd", decay_fraction=0.4, lr=3e-3, embedding_lr=3e-2,
               matrix_lr=0.02, muon_momentum=0.95, weight_decay=0.0),
)

RECIPES: dict[str, Recipe] = {"speedrun": SPEEDRUN}


def get_recipe(name: str) -> Recipe:
    """The recipe called `name`; an unknown name lists the known ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}") from None
