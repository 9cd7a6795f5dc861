"""Model configuration: one frozen dataclass for every llama-like family.

Llama 2/3 (with Llama-3.1 rope scaling), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm) and Mistral (sliding-window attention) differ only in the fields below.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3.1 ("llama3") frequency scaling of RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and options of a llama-like decoder.

    Dimension letters: ``H`` hidden, ``N`` query heads, ``K`` kv heads, ``D`` head dim,
    ``F`` MLP hidden, ``V`` vocabulary, ``L`` layers.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported family '{self.family}'; supported: {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From the dict of an HF ``config.json``; clear errors for what is unsupported."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(
                f"unsupported model_type '{model_type}'; supported: {', '.join(FAMILIES)}"
            )
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // heads
        scaling = None
        rope = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if rope:
            kind = rope.get("rope_type", rope.get("type", "default"))
            rope_theta = rope.get("rope_theta", rope_theta)
            if kind == "llama3":
                scaling = RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        rope["original_max_position_embeddings"]),
                )
            elif kind != "default":
                raise ValueError(
                    f"unsupported rope type '{kind}'; supported: default, llama3"
                )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = hf.get("sliding_window") if model_type == "mistral" else None
        if model_type != "mistral" and hf.get("use_sliding_window"):
            # Qwen2/3 window only some layers (max_window_layers, layer_types); silently
            # attending fully would give wrong logits past the window
            raise ValueError(
                f"{model_type} with use_sliding_window=True (per-layer sliding window) "
                "is not supported"
            )
        return cls(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_file(cls, path: str | os.PathLike) -> ModelConfig:
        """From an HF ``config.json`` file."""
        with open(path) as f:
            return cls.from_hf(json.load(f))
