"""Model configuration: one frozen dataclass for every llama-like family.

Llama 2/3 (with Llama-3.1 rope scaling), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm) and Mistral (sliding-window attention) differ only in the fields below.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from models.files import ModelFileError

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_MISSING = object()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _hf_int(hf: dict, key: str, default: Any = _MISSING) -> Any:
    """``hf[key]`` (or ``default`` when absent or null), which must be an integer."""
    value = hf.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"config lacks '{key}'")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config '{key}' must be an integer, got {_shown(value)}")
    return value


def _hf_float(value: Any, key: str) -> float:
    """A config number, which must be finite."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"config '{key}' must be a finite number, got {_shown(value)}")
    return float(value)


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
    def from_shape(cls, shape: Any, *, max_len: int, num_layers: int | None = None
                   ) -> ModelConfig:
        """The model of a :class:`kvjax.eval.memory.ModelShape` (with ``num_layers``
        blocks when given), its positions sized to ``max_len`` tokens: random weights have
        no trained context to respect."""
        return cls(
            family=shape.family, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_layers=num_layers or shape.num_layers, num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            rope_theta=shape.rope_theta, tie_word_embeddings=shape.tie_word_embeddings,
            attention_bias=shape.attention_bias, max_position_embeddings=max_len)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From the dict of an HF ``config.json``; clear errors (``ValueError``) for what is
        unsupported, missing or of the wrong type."""
        if not isinstance(hf, dict):
            raise ValueError(f"config must be a JSON object, got {_shown(hf)}")
        model_type = hf.get("model_type")
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ValueError(
                f"unsupported model_type {_shown(model_type)}; supported: "
                f"{', '.join(FAMILIES)}"
            )
        heads = _hf_int(hf, "num_attention_heads")
        hidden = _hf_int(hf, "hidden_size")
        if heads < 1:
            raise ValueError(f"num_attention_heads must be a positive int, got {heads}")
        head_dim = _hf_int(hf, "head_dim", 0) or hidden // heads
        scaling = None
        rope = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if rope:
            if not isinstance(rope, dict):
                raise ValueError(f"config rope_scaling must be an object, got {_shown(rope)}")
            kind = rope.get("rope_type", rope.get("type", "default"))
            rope_theta = rope.get("rope_theta", rope_theta)
            if kind == "llama3":
                try:
                    scaling = RopeScaling(
                        factor=_hf_float(rope["factor"], "factor"),
                        low_freq_factor=_hf_float(rope["low_freq_factor"], "low_freq_factor"),
                        high_freq_factor=_hf_float(rope["high_freq_factor"],
                                                   "high_freq_factor"),
                        original_max_position_embeddings=_hf_int(
                            rope, "original_max_position_embeddings"),
                    )
                except KeyError as err:
                    raise ValueError(f"llama3 rope scaling lacks {err}") from None
            elif kind != "default":
                raise ValueError(
                    f"unsupported rope type {_shown(kind)}; supported: default, llama3"
                )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
            raise ValueError(f"config eos_token_id must be integers, got {_shown(eos)}")
        window = _hf_int(hf, "sliding_window", None) if model_type == "mistral" else None
        if model_type != "mistral" and hf.get("use_sliding_window"):
            # Qwen2/3 window only some layers (max_window_layers, layer_types); silently
            # attending fully would give wrong logits past the window
            raise ValueError(
                f"{model_type} with use_sliding_window=True (per-layer sliding window) "
                "is not supported"
            )
        return cls(
            family=model_type,
            vocab_size=_hf_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_hf_int(hf, "intermediate_size"),
            num_layers=_hf_int(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_hf_int(hf, "num_key_value_heads", 0) or heads,
            head_dim=head_dim,
            rms_norm_eps=_hf_float(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=_hf_float(rope_theta if rope_theta is not None else 10000.0,
                                 "rope_theta"),
            rope_scaling=scaling,
            max_position_embeddings=_hf_int(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            bos_token_id=_hf_int(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_file(cls, path: str | os.PathLike) -> ModelConfig:
        """From an HF ``config.json`` file; every problem with it (unreadable, not JSON,
        or a config :meth:`from_hf` rejects) raises :class:`ModelFileError`."""
        try:
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
        except OSError as err:
            raise ModelFileError(path, err.strerror or str(err)) from None
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise ModelFileError(path, f"not a JSON file ({err})") from None
        try:
            return cls.from_hf(hf)
        except ValueError as err:
            raise ModelFileError(path, str(err)) from None
