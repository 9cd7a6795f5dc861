"""Command line: ``python -m kvjax <command>``.

Commands:
    codecs     list the registered codecs and their spec grammar
    probe      measure caches on seeded Gaussian (or saved) K/V; a table, or JSON
    generate   generate text with a model whose KV cache is the given cache spec
    ppl        perplexity on a real corpus with the given cache, and its next-token KL
               divergence and top-1 agreement against a bf16 cache
    needle     needle-in-a-haystack retrieval accuracy per cache, length and depth
    calibrate  key statistics of a model on a corpus, for cache specs' calib clauses

Every command that builds a cache takes it as one cache spec (:func:`kvjax.spec.parse_cache`)
in ``--cache SPEC`` (also spelled ``--codec``); results record its canonical form. A bad
spec is a usage error: one line that lists what is valid, exit status 2. So is every other
bad input: numbers out of range, a cache window or sinks longer than the context, missing
or corrupt model and data files (:class:`models.files.ModelFileError`), values a codec
cannot store (:class:`kvjax.codec.CodecError`): one line on stderr, never a traceback.

A run that does not fit in device memory (:class:`models.generate.OutOfMemoryError`) is one
line too, naming the program, its sizes and what to try, with exit status 1.

Every command reuses the XLA programs earlier runs compiled, from JAX's persistent
compilation cache (:mod:`kvjax.compile_cache`: ``~/.cache/kvjax/jax-compile`` unless
``$KVJAX_COMPILE_CACHE`` names another directory); ``--no-compile-cache`` (before or after
the command) or ``KVJAX_COMPILE_CACHE=off`` compiles everything anew.

``--json`` prints strict JSON (RFC 8259) on stdout: a number that is not finite (a
metric with nothing to measure, or one that overflowed) is ``null``, never ``NaN``.

This is the one module of kvjax that imports ``models`` (lazily, for ``generate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax import compile_cache
from kvjax.attention import check_names
from kvjax.eval.corpus import CorpusDownloadError
from kvjax.probe import BASELINE_CODECS
from kvjax.sharding import MeshError, check_split, make_mesh, parse_mesh
from kvjax.sharding import describe as describe_mesh
from kvjax.spec import CACHE_CLAUSES, CacheConfig, parse_cache, registered

CACHE_HELP = ("cache spec, one quoted string of clauses: " + " ".join(CACHE_CLAUSES)
              + ", e.g. 'k=kivi:2,g32 v=int:4 window=32 sinks=4 layers[0,-1]:k=bf16'; "
              "python -m kvjax codecs lists the codecs")


JSON_HELP = "strict JSON: numbers that are not finite are null"

#: the largest count an option takes: XLA's array dimensions are 32-bit
MAX_COUNT = 2**31 - 1
#: seeds go to JAX (64-bit) and numpy (non-negative)
MAX_SEED = 2**63 - 1


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"kvjax: error: {_one_line(message)}\n")


def _one_line(message: Any) -> str:
    return " ".join(str(message).split())


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer up to {MAX_COUNT}, got {value}")
    return value


def _count(text: str) -> int:
    """A non-negative integer (``0`` or a :func:`_positive` one)."""
    return 0 if text.strip() == "0" else _positive(text)


def _finite(low: float, high: float, expected: str, *, low_open: bool = False):
    """An option type: a finite float in ``[low, high]`` (``(low, high]`` when
    ``low_open``), ``expected`` describing it in the error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and value <= high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'")
        return value

    return parse


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..{MAX_SEED}, got '{text}'")
    return value


def _rate(text: str) -> float:
    """A ``--rate``: requests per second > 0, or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 or inf, got "
                                         f"'{text}'")
    return value


def _span(text: str) -> tuple[int, int]:
    """A ``LO:HI`` token range (one number: both)."""
    low, _, high = text.partition(":")
    try:
        span = (_positive(low), _positive(high or low))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected LO:HI token counts, got '{text}'") from None
    if span[0] > span[1]:
        raise argparse.ArgumentTypeError(f"expected LO <= HI, got '{text}'")
    return span


def _shared(text: str) -> tuple[float, int]:
    """A ``FRACTION:TOKENS`` shared prompt."""
    fraction, _, tokens = text.partition(":")
    try:
        return _finite(0, 1, "a fraction in [0, 1]")(fraction), _positive(tokens)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected FRACTION:TOKENS (e.g. 0.5:64), got "
                                         f"'{text}'") from None


def _cache(text: str) -> CacheConfig:
    """A ``--cache`` value: the spec parsed, or a usage error with the grammar's message."""
    try:
        config = parse_cache(text)
        check_names(config.attention)  # the registry lives above the grammar
        return config
    except ValueError as err:  # one line that lists what is valid
        raise argparse.ArgumentTypeError(str(err)) from None


def _mesh(text: str) -> dict[str, int]:
    """A ``--mesh`` value: ``data=D,model=M`` read, or a usage error saying why not."""
    try:
        return parse_mesh(text)
    except MeshError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_progress(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help=f"{what} on stderr (default: when stderr is a terminal)")


def _status(args, message: str) -> None:
    """One status line on stderr where progress is shown (what a long step is doing)."""
    if getattr(args, "progress", False):
        print(f"kvjax: {message}", file=sys.stderr, flush=True)


def _add_mesh(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", type=_mesh, default=None, metavar="data=D,model=M",
                        help="run over D x M devices: rows split over data, heads "
                             "tensor-parallel over model (default: one device)")


def _device_mesh(args):
    """The mesh of ``--mesh`` over this machine's devices, or None for one device."""
    return None if args.mesh is None else make_mesh(args.mesh)


def _add_cache(parser: argparse.ArgumentParser, extra_help: str, **kw) -> None:
    """The one cache option of a command: ``--cache SPEC``, also spelled ``--codec``."""
    parser.add_argument("--cache", "--codec", dest="cache", type=_cache, metavar="SPEC",
                        help=f"{CACHE_HELP}; {extra_help}", **kw)


def check_context(config: CacheConfig, context: int, what: str) -> None:
    """Raise ``ValueError`` when the cache's raw window or sinks hold more than
    ``context`` tokens (``what`` says whose): they could never fill, and their buffers
    are allocated whole."""
    for clause, value in (("window", config.residual_window), ("sinks", config.sink_tokens)):
        if value > context:
            raise ValueError(f"cache {clause}={value} exceeds {what} of {context} tokens "
                             f"(in '{config.spec}')")


def strict_json(value: Any) -> str:
    """``value`` as strict JSON: numpy scalars and arrays become numbers and lists, and
    numbers that are not finite become ``null`` (Python's ``json`` would write ``NaN``)."""
    return json.dumps(_jsonable(value), allow_nan=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def needle_caches(tested: Sequence[CacheConfig]) -> list[CacheConfig]:
    """The caches a needle run measures: a bf16 cache with the window and sinks of each
    cache under test (plain bf16 when none is given), then those caches; once each."""
    baselines = [c.reference() for c in tested] or [CacheConfig(k="bf16")]
    return list(dict.fromkeys([*baselines, *tested]))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvjax``."""
    parser = _Parser(prog="kvjax", description="KV-cache compression for LLMs in JAX")
    compile_cache.add_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sub.add_parser("codecs", help="list registered codecs and their spec grammar")

    p = sub.add_parser("probe", help="codec error, bits and attention error on synthetic K/V")
    _add_cache(p, "repeat for a table; default: all baselines", action="append")
    p.add_argument("--head-dim", type=_positive, default=128)
    p.add_argument("--tokens", type=_positive, default=1024)
    p.add_argument("--heads", type=_positive, default=2, help="kv heads")
    p.add_argument("--queries", type=_positive, default=16, help="probe queries per kv head")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--npy", metavar="FILE", help="K/V from a .npy [2, T, K, D] or [T, K, D]")
    _add_progress(p, "a progress bar over caches")
    p.add_argument("--json", action="store_true",
                   help=f"one JSON object (a list for several); {JSON_HELP}")

    g = sub.add_parser("generate", help="generate text with a compressed KV cache")
    g.add_argument("--prompt", help="the prompt text (required unless --resume)")
    _add_cache(g, "default: bf16 (with --resume: the stored cache's)")
    g.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                   help="registered name, .gguf file or HF checkpoint dir "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--max-new-tokens", type=_positive, default=None,
                   help="default: 32, or with --resume the room the stored cache keeps")
    g.add_argument("--temperature", type=_finite(0, math.inf, "a finite number >= 0"),
                   default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=_finite(0, 1, "a number in (0, 1]", low_open=True),
                   default=1.0)
    g.add_argument("--seed", type=_seed, default=None, help="default: 0")
    g.add_argument("--prefill-chunk", type=_positive, default=None, metavar="C",
                   help="feed the prompt C tokens at a time (long prompts)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
    g.add_argument("--save-prompt", metavar="DIR", default=None,
                   help="store the prefilled compressed cache in DIR (replacing it) before "
                        "decoding; --max-new-tokens is the room it keeps for --resume")
    g.add_argument("--resume", metavar="DIR", default=None,
                   help="continue from a cache that --save-prompt stored, instead of a "
                        "prompt (same --model; --seed defaults to the stored one)")
    _add_progress(g, "status lines (loading, compiling, prefill, decoding)")
    g.add_argument("--json", action="store_true",
                   help="one JSON object: text, tokens, log_probs (each token's, the "
                        "model's distribution), prefill_s, decode_tok_per_s, "
                        f"cache_bytes (disk_bytes with --save-prompt or --resume); "
                        f"{JSON_HELP}")
    _add_mesh(g)

    q = sub.add_parser("ppl", help="perplexity on a corpus, compressed cache vs bf16 cache")
    _add_cache(q, "a bf16 cache with its window and sinks is the baseline", required=True)
    q.add_argument("--corpus", default="shakespeare", metavar="NAME|PATH",
                   help="shakespeare, austen, wikitext-2/103, or a UTF-8 text file")
    q.add_argument("--windows", type=_positive, default=4, help="number of windows")
    q.add_argument("--window-len", type=_positive, default=256, help="tokens per window")
    q.add_argument("--chunk", type=_positive, default=None,
                   help="prefill chunk in tokens (default: the whole window)")
    q.add_argument("--context", type=_positive, default=None, metavar="N",
                   help="score only the tokens after the first N of each window, which are "
                        "prefilled once as a prompt (needed by an evict= clause)")
    q.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                   help="registered name, .gguf file or HF checkpoint dir "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    q.add_argument("--seed", type=_seed, default=0, help="seed of the codec parameters")
    _add_progress(q, "a progress bar over chunks")
    q.add_argument("--json", action="store_true", help=f"one JSON object; {JSON_HELP}")
    _add_mesh(q)

    n = sub.add_parser("needle", help="needle-in-a-haystack retrieval accuracy per cache")
    _add_cache(n, "repeat for several; a bf16 cache with the window and sinks of each "
               "always runs too", action="append")
    n.add_argument("--lengths", type=_positive, nargs="+", default=[512, 1024],
                   metavar="N", help="prompt lengths in tokens")
    n.add_argument("--depths", type=_finite(0, 1, "a fraction in [0, 1]"), nargs="+",
                   default=[0.1, 0.5, 0.9], metavar="F",
                   help="needle depths, fractions of the haystack")
    n.add_argument("--trials", type=_positive, default=2,
                   help="numbers (and haystacks) per length and depth")
    n.add_argument("--corpus", default="shakespeare", metavar="NAME|PATH",
                   help="haystack text: shakespeare, austen, or a UTF-8 text file")
    n.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                   help="an instruct model with a chat template (default: SmolLM2-135M-Instruct)")
    n.add_argument("--seed", type=_seed, default=0, help="seed of the numbers and codecs")
    n.add_argument("--batch-size", type=_positive, default=None,
                   help="prompts per generate call (default: all of one length)")
    _add_progress(n, "a progress bar over prompts")
    n.add_argument("--json", action="store_true",
                   help=f"one JSON list of every answer; {JSON_HELP}")

    b = sub.add_parser("serve-bench", help="a synthetic request stream through the "
                                           "continuous-batching engine, per cache")
    _add_cache(b, "repeat for several; default: bf16 (a page=N clause pages it)",
               action="append")
    b.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                   help="registered name, .gguf file or HF checkpoint dir "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    b.add_argument("--shape", default=None, metavar="SHAPE",
                   help="random weights of a named model shape instead of --model "
                        "(e.g. llama-3-8b)")
    b.add_argument("--layers", type=_positive, default=None,
                   help="with --shape: fewer transformer blocks than the shape's")
    b.add_argument("--requests", type=_positive, default=16)
    b.add_argument("--rate", type=_rate, nargs="+", default=[math.inf], metavar="R",
                   help="Poisson arrivals, requests per second (inf: all at once); several "
                        "make a throughput-against-rate curve")
    b.add_argument("--prompt-len", type=_span, default=(32, 128), metavar="LO:HI")
    b.add_argument("--output-len", type=_span, default=(16, 32), metavar="LO:HI")
    b.add_argument("--shared", type=_shared, default=(0.0, 0), metavar="FRACTION:TOKENS",
                   help="a FRACTION of the requests start with one TOKENS-token prompt")
    b.add_argument("--rows", type=_positive, default=8, help="cache rows (concurrent requests)")
    b.add_argument("--num-pages", type=_positive, default=None,
                   help="a paged cache's pool (default: what --rows contiguous rows hold)")
    b.add_argument("--cache-gb", type=_finite(0, math.inf, "a number of GB > 0",
                                              low_open=True), default=None, metavar="G",
                   help="every cache in G GB (1e9 bytes): a contiguous one gets the rows "
                        "that fit, a paged one --rows rows and the pages that fit")
    b.add_argument("--chunk", type=_positive, default=128, help="prefill tokens per row per step")
    b.add_argument("--decode-steps", type=_positive, default=1,
                   help="decode tokens per row per step")
    b.add_argument("--no-share", action="store_true",
                   help="feed every prompt whole: no request reads another's prefix pages")
    b.add_argument("--seed", type=_seed, default=0, help="seed of the workload and codecs")
    b.add_argument("--plot", metavar="FILE.png", default=None,
                   help="tokens/s against request rate, a line per cache")
    b.add_argument("--json", action="store_true",
                   help=f"one JSON list, a row per (cache, rate); {JSON_HELP}")

    c = sub.add_parser("calibrate", help="key statistics for center=calib / smooth=calib, "
                                         "or fitted codec parameters for fit=DIR")
    c.add_argument("--out", required=True, metavar="FILE.npz|DIR",
                   help="where to write them (a directory with --fit, replaced)")
    c.add_argument("--fit", type=_cache, default=None, metavar="SPEC",
                   help="fit the parameters of the codecs of this cache spec that take "
                        "them (e.g. saw:b4,kv,c256); a cache names them with fit=DIR")
    c.add_argument("--allocate", type=_finite(0, math.inf, "a number of bits > 0",
                                              low_open=True),
                   nargs="+", default=None, metavar="BITS",
                   help="measure each (layer, K|V)'s sensitivity and print the per-layer "
                        "cache spec of least loss at each budget (bits per element); the "
                        "sensitivities go to --out (a directory)")
    c.add_argument("--candidates", nargs="+", default=["int:2", "int:4", "int:8"],
                   metavar="CODEC", help="what --allocate chooses from")
    c.add_argument("--seed", type=_seed, default=0, help="seed of the fits (with --fit)")
    _add_progress(c, "progress bars (--fit, --allocate) or a status line")
    c.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                   help="registered name, .gguf file or HF checkpoint dir "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    c.add_argument("--corpus", default="shakespeare", metavar="NAME|PATH",
                   help="shakespeare, austen, wikitext-2/103, or a UTF-8 text file")
    c.add_argument("--windows", type=_positive, default=4, help="number of windows")
    c.add_argument("--window-len", type=_positive, default=512, help="tokens per window")
    c.add_argument("--offset", type=_count, default=0,
                   help="windows to skip first (keep calibration text apart from "
                        "evaluated text)")
    c.add_argument("--json", action="store_true", help=f"one JSON object; {JSON_HELP}")
    for sp in (g, q, n):
        sp.add_argument("--calibration", default=None, metavar="FILE.npz",
                        help="key statistics for calib clauses (python -m kvjax calibrate)"
                             + ("; default: the windows after the evaluated ones"
                                if sp is q else ""))
    for sp in sub.choices.values():  # the global flag, also after the command
        compile_cache.add_argument(sp, default=argparse.SUPPRESS)
    return parser


def _calibration(args, cache_configs: Sequence[CacheConfig]):
    """The key calibration of ``--calibration``, checked against the caches' needs: None
    when no cache has a calib clause; a ``ValueError`` when one needs it and no file was
    given (the ppl command calibrates on held-out windows instead: None then too)."""
    from kvjax.centering import KeyCalibration

    if args.calibration is not None:
        return KeyCalibration.load(args.calibration)
    needing = [c.spec for c in cache_configs if c.calibrated]
    if needing and args.command != "ppl":
        raise ValueError(f"cache '{needing[0]}' takes its key transform from a calibration: "
                         "pass --calibration FILE.npz (python -m kvjax calibrate)")
    return None


def _cmd_codecs() -> int:
    from kvjax.codecs.outliers import MedOutlierCodec

    # the grammar and the examples come from each codec's option declarations
    for cls in [*(cls for _, cls in sorted(registered().items())), MedOutlierCodec]:
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        print(cls.usage())
        if cls is MedOutlierCodec:
            doc = "any lossy token-wise codec takes these: Med-C outlier chunks kept in fp16"
        print(f"    {doc.replace('``', '')}")
        if cls.examples:
            print(f"    e.g. {', '.join(example.spec for example in cls.examples)}")
        if cls.decode_note:
            print(f"    decode speed: {cls.decode_note}")
    return 0


def _check_values(what: str, *dims: int) -> None:
    """Raise ``ValueError`` when an array of shape ``dims`` would be too large for XLA."""
    if math.prod(dims) > MAX_COUNT:
        raise ValueError(f"{what}: {' x '.join(map(str, dims))} values, more than "
                         f"{MAX_COUNT} in one array")


def _cmd_probe(args) -> int:
    from kvjax.probe import gaussian_kv, load_kv, probe

    configs = args.cache or [parse_cache(spec) for spec in BASELINE_CODECS]
    if args.npy:
        k, v = load_kv(args.npy)
    else:
        _check_values("tokens x heads x head dim", args.tokens, args.heads, args.head_dim)
        k, v = gaussian_kv(args.seed, args.tokens, args.heads, args.head_dim)
    _check_values("queries x heads x head dim", args.queries, *k.shape[1:])
    for config in configs:
        check_context(config, len(k), "the probe's input")
    if args.progress:
        from tqdm.auto import tqdm

        configs = tqdm(configs, desc="probe", unit="cache")
    rows = [{"cache": config.spec,
             **probe(config, k=k, v=v, queries=args.queries, seed=args.seed)}
            for config in configs]
    if args.json:
        print(strict_json(rows[0] if len(rows) == 1 else rows))
    else:
        print(format_probe_table(rows))
    return 0


def _cmd_generate(args) -> int:
    import jax

    import models
    from kvjax.checkpoint import disk_bytes
    from models.generate import decode, generate, load_prompt_cache

    if args.resume is not None:
        for flag, value in (("--prompt", args.prompt), ("--cache", args.cache),
                            ("--save-prompt", args.save_prompt), ("--chat", args.chat or None),
                            ("--prefill-chunk", args.prefill_chunk),
                            ("--calibration", args.calibration)):
            if value is not None:
                raise ValueError(f"--resume continues a stored prompt: {flag} does not apply")
    elif args.prompt is None or not args.prompt.strip():
        raise ValueError("the prompt is empty" if args.prompt is not None
                         else "give --prompt TEXT, or --resume DIR")
    cache_config = args.cache or parse_cache("bf16")
    mesh = _device_mesh(args)
    check_split(mesh, rows=1)  # one prompt
    model_name = args.model or models.DEFAULT_MODEL
    # a cache or a model file that cannot work fails before the model is loaded
    check_context(cache_config, models.context_length(model_name), "the model's context")
    # per-layer weight buffers: a GPU copies stacked ones every decode step
    _status(args, f"loading {model_name}")
    config, params, tokenizer = models.load(model_name,
                                            per_layer=jax.default_backend() == "gpu")
    if tokenizer is None:
        raise ValueError(f"model '{model_name}' has no tokenizer")
    sampling = {"max_new_tokens": args.max_new_tokens or 32, "temperature": args.temperature,
                "top_p": args.top_p}
    stored_bytes = None
    if args.resume is not None:
        _status(args, f"reading the prompt cache {args.resume}")
        stored = load_prompt_cache(args.resume, params=params, config=config)
        if args.max_new_tokens is None:  # the room the saving call kept
            cache = stored.prefill.cache
            sampling["max_new_tokens"] = max(1, cache.max_len - int(cache.lengths.max()) + 1)
        cache_config, stored_bytes = stored.prefill.cache.config, stored.disk_bytes
        result = decode(params, config, stored.prefill, **sampling,
                        seed=stored.seed if args.seed is None else args.seed, mesh=mesh)
    else:
        if args.chat:
            prompt_ids = models.chat_prompt_ids(tokenizer, args.prompt)
        else:
            prompt_ids = tokenizer.encode(args.prompt)
        _status(args, f"compiling and running the prefill ({len(prompt_ids)} tokens) and "
                      f"the decode loop ({sampling['max_new_tokens']} tokens) through "
                      f"'{cache_config.spec}'")
        result = generate(
            params, config, [list(prompt_ids)], cache_config=cache_config, **sampling,
            seed=args.seed or 0, prefill_chunk=args.prefill_chunk,
            calibration=_calibration(args, [cache_config]), save_prompt=args.save_prompt,
            mesh=mesh,
        )
        if args.save_prompt is not None:
            stored_bytes = disk_bytes(args.save_prompt)
    tokens = result.tokens[0]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if args.json:
        print(strict_json({
            "text": text, "tokens": tokens,
            "log_probs": [float(x) for x in result.log_probs[0]],
            "prefill_s": result.prefill_s,
            "decode_tok_per_s": result.decode_tok_per_s, "cache_bytes": result.cache_bytes,
            "cache": cache_config.spec, "k_codec": cache_config.k.spec,
            "v_codec": cache_config.v.spec, "mesh": describe_mesh(mesh),
            **({} if stored_bytes is None else {"disk_bytes": stored_bytes}),
        }))
    else:
        print(text)
    return 0


def _cmd_ppl(args) -> int:
    import models
    from models.evaluate import (
        cache_continuation,
        cache_perplexity,
        check_window_len,
        heldout_calibration,
        load_model_and_windows,
    )

    # bad specs, model names and lengths fail before the corpus and the model are loaded
    cache_config = args.cache
    if cache_config.evict is not None and args.context is None:
        raise ValueError("an evict= clause acts on a prompt: give --context N to prefill "
                         "each window's first N tokens and score the rest")
    if args.context is not None and args.context >= args.window_len:
        raise ValueError(f"--context {args.context} leaves no token of a "
                         f"{args.window_len}-token window to score")
    calibration = _calibration(args, [cache_config])
    mesh = _device_mesh(args)
    check_split(mesh, rows=args.windows)
    baseline = cache_config.reference()
    model_name = args.model or models.DEFAULT_MODEL
    context = models.context_length(model_name)
    check_window_len(context, args.window_len)
    check_context(cache_config, context, "the model's context")
    config, params, tokenizer, text, wins = load_model_and_windows(
        model_name, args.corpus, args.windows, args.window_len)
    if cache_config.calibrated and calibration is None:
        calibration = heldout_calibration(params, config, tokenizer, text, args.windows,
                                          args.window_len)

    # one pass: the bf16 cache runs beside the one under test, for its perplexity and
    # the next-token distribution the tested cache is compared with
    evaluate = cache_perplexity if args.context is None else functools.partial(
        cache_continuation, context=args.context)
    result = evaluate(params, config, cache_config, wins, chunk=args.chunk, seed=args.seed,
                      progress=args.progress, calibration=calibration, reference=baseline,
                      mesh=mesh)
    row = {
        "cache": cache_config.spec, "bf16_cache": baseline.spec,
        "k_codec": cache_config.k.spec, "v_codec": cache_config.v.spec,
        "model": model_name, "corpus": str(args.corpus),
        "windows": args.windows, "window_len": args.window_len, "chunk": args.chunk,
        "context": args.context,
        "residual_window": cache_config.residual_window, "sinks": cache_config.sink_tokens,
        "seed": args.seed, "mesh": describe_mesh(mesh),
        "ppl": result.ppl, "bf16_ppl": result.reference_ppl,
        "bits_per_element": result.bits_per_element,
        "k_bits_per_element": result.k_bits_per_element,
        "v_bits_per_element": result.v_bits_per_element,
        "sequence_bits_per_element": result.sequence_bits_per_element,
        "tokens": result.tokens, "seconds": result.seconds,
        "kl_mean": result.kl_mean, "kl_p99": result.kl_p99,
        "top1_agreement": result.top1_agreement,
        "kl_by_position": [dataclasses.asdict(b) for b in result.kl_by_position],
    }
    if args.json:
        print(strict_json(row))
    else:
        delta = 100.0 * (row["ppl"] / row["bf16_ppl"] - 1.0)
        if args.context is not None:
            print(f"scored: the {args.window_len - args.context} tokens after a "
                  f"{args.context}-token prompt per window; bits per sequence element "
                  f"(evicted tokens counted): {row['sequence_bits_per_element']:.3f}\n")
        print("| cache | bits/elem | ppl | bf16 ppl | delta % | KL mean | KL p99 | top-1 |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {row['cache']} | {row['bits_per_element']:.3f} | {row['ppl']:.4f} | "
              f"{row['bf16_ppl']:.4f} | {delta:+.2f} | {row['kl_mean']:.4f} | "
              f"{row['kl_p99']:.4f} | {row['top1_agreement']:.3f} |")
        print("\nby position (KL mean / top-1): " + ", ".join(
            f"{b['start']}-{b['end'] - 1}: {b['kl_mean']:.4f} / {b['top1_agreement']:.3f}"
            for b in row["kl_by_position"] if b["tokens"]))
    return 0


def _cmd_needle(args) -> int:
    import jax.numpy as jnp

    import models
    from kvjax.eval.corpus import load_corpus
    from kvjax.eval.needle import accuracy_table, check_grid
    from models.evaluate import check_needle_lengths, needle_cases, needle_retrieval

    check_grid(args.lengths, args.depths, args.trials)
    configs = needle_caches(args.cache or [])
    model_name = args.model or models.DEFAULT_MODEL
    # lengths and caches past the model's context fail before the corpus and the model
    # are loaded
    context = models.context_length(model_name)
    check_needle_lengths(context, args.lengths)
    for cache_config in configs:
        check_context(cache_config, context, "the model's context")
    calibration = _calibration(args, configs)
    text = load_corpus(args.corpus)
    config, params, tokenizer = models.load(model_name, jnp.float32)
    cases = needle_cases(config, tokenizer, text, lengths=args.lengths, depths=args.depths,
                         trials=args.trials, seed=args.seed)
    rows = []
    for cache_config in configs:
        for row in needle_retrieval(params, config, tokenizer, cache_config, cases,
                                    seed=args.seed, batch_size=args.batch_size,
                                    progress=args.progress, calibration=calibration):
            rows.append({"cache": cache_config.spec, **row})
    if args.json:
        print(strict_json(rows))
    else:
        print(accuracy_table(rows, key="cache"))
    return 0


def _cmd_calibrate(args) -> int:
    import numpy as np

    import models
    from models.evaluate import calibrate_keys, check_window_len, load_model_and_windows

    model_name = args.model or models.DEFAULT_MODEL
    if not args.out.strip():
        raise ValueError("--out must name a file (or with --fit / --allocate a directory)")
    if args.fit is not None and args.allocate is not None:
        raise ValueError("--fit and --allocate are separate runs")
    if args.allocate is not None:
        from kvjax.spec import parse_codec

        for candidate in args.candidates:
            parse_codec(candidate)  # a bad one fails before the model loads
    if args.fit is not None and not args.fit.needs_fit:
        raise ValueError(f"--fit '{args.fit.spec}': no codec of it takes fitted parameters "
                         "(e.g. saw:b4,kv,c256 or saw:b4,hess do)")
    check_window_len(models.context_length(model_name), args.window_len)
    config, params, _, _, wins = load_model_and_windows(
        model_name, args.corpus, args.offset + args.windows, args.window_len)
    if args.fit is not None:
        return _fit_codecs(args, model_name, config, params, wins[args.offset:])
    if args.allocate is not None:
        return _allocate(args, config, params, wins[args.offset:])
    _status(args, f"key statistics of {len(wins) - args.offset} windows of "
                  f"{args.window_len} tokens")
    calibration = calibrate_keys(params, config, wins[args.offset:])
    calibration.save(args.out)
    # how far the keys sit from zero, per layer: what centering takes away
    offset = np.linalg.norm(calibration.center, axis=-1) / np.maximum(
        np.linalg.norm(calibration.rms, axis=-1), 1e-30)
    row = {"out": str(args.out), "model": model_name, "corpus": str(args.corpus),
           "tokens": calibration.tokens, "layers": calibration.shape[0],
           "kv_heads": calibration.shape[1], "head_dim": calibration.shape[2],
           "center_over_spread_max": float(offset.max()),
           "center_over_spread_mean": float(offset.mean())}
    if args.json:
        print(strict_json(row))
    else:
        print(f"wrote {args.out}: {row['tokens']} tokens, {row['layers']} layers x "
              f"{row['kv_heads']} kv heads x {row['head_dim']}; mean key / spread "
              f"{row['center_over_spread_mean']:.2f} on average, "
              f"{row['center_over_spread_max']:.2f} at most")
    return 0


def _fit_codecs(args, model_name: str, config, params, windows) -> int:
    """``calibrate --fit``: collect the model's activations on ``windows``, fit, save."""
    import time

    import jax

    from kvjax.calibration import fit_cache, save_fitted
    from models.evaluate import collect_activations

    start = time.perf_counter()
    activations = collect_activations(params, config, windows, batch_size=4,
                                      progress=args.progress)
    fitted = fit_cache(args.fit, activations, key=jax.random.PRNGKey(args.seed),
                       progress=args.progress,
                       metadata={"model": model_name, "corpus": str(args.corpus),
                                 "offset_windows": args.offset, "seed": args.seed})
    written = save_fitted(args.out, fitted, overwrite=True)
    fits = sum(c is not None for role in fitted.codecs.values() for c in role)
    row = {"out": str(args.out), "model": model_name, "corpus": str(args.corpus),
           "fit": args.fit.spec, "use": f"{args.fit.spec} fit={args.out}",
           "tokens": activations.tokens, "fits": fits, "disk_bytes": written,
           "seconds": time.perf_counter() - start}
    if args.json:
        print(strict_json(row))
    else:
        print(f"wrote {args.out}: {fits} fitted (layer, K|V) on {row['tokens']} tokens per "
              f"kv head, {written} bytes; use it as --cache '{row['use']}'")
    return 0


def _allocate(args, config, params, windows) -> int:
    """``calibrate --allocate``: per-layer sensitivities, then a spec per budget."""
    from kvjax.allocation import allocate
    from models.evaluate import layer_sensitivity

    sensitivity = layer_sensitivity(params, config, windows, args.candidates,
                                    seed=args.seed, progress=args.progress,
                                    budgets=args.allocate)
    sensitivity.save(args.out, metadata={"model": args.model or "default",
                                         "corpus": str(args.corpus)}, overwrite=True)
    rows = []
    for budget in args.allocate:
        found = allocate(sensitivity, budget)
        rows.append({"budget": budget, "bits_per_element": found.bits,
                     "predicted_kl": sensitivity.base + found.predicted, "spec": found.spec})
    if args.json:
        print(strict_json({"out": str(args.out), "rows": rows}))
    else:
        for row in rows:
            print(f"{row['budget']:g} bits: {row['spec']}  ({row['bits_per_element']:.3f} "
                  f"bits per element)")
    return 0


def _serving_memory(args, config, cache_config: CacheConfig, max_len: int
                    ) -> tuple[int, int | None]:
    """A serving cache's rows and pool pages: ``--rows`` and ``--num-pages``, or with
    ``--cache-gb`` the rows (contiguous) or pages (paged) that fit in that memory."""
    from kvjax.eval.memory import pool_pages, row_bytes

    if not cache_config.page_tokens:
        if args.num_pages is not None:
            raise ValueError(f"--num-pages: cache spec '{cache_config.spec}' is not paged")
        if args.cache_gb is None:
            return args.rows, None
    if args.cache_gb is None:
        return args.rows, args.num_pages
    dims = dict(context=max_len, num_layers=config.num_layers,
                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    budget = args.cache_gb * 1e9
    if cache_config.page_tokens:
        pages = pool_pages(cache_config, budget=budget, rows=args.rows, **dims)
        if pages < 1:
            raise ValueError(f"--cache-gb {args.cache_gb:g}: {args.rows} rows of "
                             f"'{cache_config.spec}' leave no room for a page")
        return args.rows, pages
    per_row, fixed = row_bytes(cache_config, **dims)
    fits = int((budget - fixed) // per_row)
    if fits < 1:
        raise ValueError(f"--cache-gb {args.cache_gb:g} holds no row of {max_len} tokens "
                         f"of '{cache_config.spec}'")
    return fits, None


def _cmd_serve_bench(args) -> int:
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    import models
    from kvjax.cache import memory_bytes
    from kvjax.eval.memory import MODEL_SHAPES
    from models import workload as wl
    from models.config import ModelConfig
    from models.llama import init_params, relayout
    from models.serve import Engine

    caches = args.cache or [parse_cache("bf16")]
    workloads = [wl.Workload(requests=args.requests, rate=rate, prompt_len=args.prompt_len,
                          output_len=args.output_len, shared_fraction=args.shared[0],
                          shared_tokens=args.shared[1]) for rate in args.rate]
    max_len = workloads[0].longest
    gpu = jax.default_backend() == "gpu"
    if args.shape is not None:
        if args.model is not None:
            raise ValueError("give --model or --shape, not both")
        if args.shape not in MODEL_SHAPES:
            raise ValueError(f"unknown --shape '{args.shape}'; known: "
                             f"{', '.join(MODEL_SHAPES)}")
        config = ModelConfig.from_shape(MODEL_SHAPES[args.shape], max_len=max_len,
                                        num_layers=args.layers)
        params = init_params(jax.random.key(args.seed), config, jnp.bfloat16)
        params = relayout(params) if gpu else params
        name = f"{args.shape} (random weights)"
    else:
        if args.layers is not None:
            raise ValueError("--layers goes with --shape")
        name = args.model or models.DEFAULT_MODEL
        config, params, _ = models.load(name, per_layer=gpu, tokenizer=False)
    if max_len > config.max_position_embeddings:
        raise ValueError(f"the longest request needs {max_len} positions; the model has "
                         f"{config.max_position_embeddings}")
    for cache_config in caches:
        check_context(cache_config, max_len, "the longest request")
    if args.cache_gb is not None and args.num_pages is not None:
        raise ValueError("give --cache-gb or --num-pages, not both")
    rows = []
    for cache_config in caches:
        cache_rows, pages = _serving_memory(args, config, cache_config, max_len)
        for workload in workloads:
            engine = Engine(params, config, cache_config, rows=cache_rows, max_len=max_len,
                            num_pages=pages, chunk=args.chunk,
                            decode_steps=args.decode_steps, seed=args.seed,
                            share_prefixes=not args.no_share)
            timed = wl.requests(workload, config.vocab_size, seed=args.seed)
            with tqdm(total=workload.requests, desc=f"{cache_config.spec} @ {workload.rate}/s",
                      unit="req", file=sys.stderr, disable=args.json) as bar:
                trace = wl.drive(engine, timed, progress=bar.update)
            rows.append({"model": name, "cache": cache_config.spec, "rate": workload.rate,
                         "rows": cache_rows, "cache_gb": args.cache_gb,
                         "cache_bytes": memory_bytes(engine.cache),
                         "pool_pages": (0 if engine.pool is None
                                                           else engine.pool.num_pages),
                         "max_len": max_len, "prefilled_tokens": engine.prefilled_tokens,
                         "shared_tokens": engine.shared_tokens, **wl.summary(trace)})
    if args.plot:
        wl.plot_throughput(rows, args.plot, title=f"{name}: {args.requests} requests")
    if args.json:
        print(strict_json(rows))
    else:
        print(wl.markdown_table(rows))
    return 0


def format_probe_table(rows: list[dict]) -> str:
    """A markdown table of probe results."""
    cols = [("cache", "cache", "{}"), ("bits", "bits_per_element_measured", "{:.3f}"),
            ("rel_mse", "rel_mse", "{:.2e}"), ("cosine", "cosine", "{:.5f}"),
            ("ip_abs_err", "ip_abs_err", "{:.4f}"), ("v_rel_mse", "v_rel_mse", "{:.2e}"),
            ("attn_rel_err", "attn_rel_err", "{:.2e}")]
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    rule = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(fmt.format(r[key]) for _, key, fmt in cols) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 with a one-line reason on bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help, or a usage error already printed
        return int(exit_.code or 0)
    compile_cache.from_args(args)
    if getattr(args, "progress", False) is None:
        args.progress = sys.stderr.isatty()
    try:
        if args.command == "codecs":
            return _cmd_codecs()
        if args.command == "probe":
            return _cmd_probe(args)
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "ppl":
            return _cmd_ppl(args)
        if args.command == "needle":
            return _cmd_needle(args)
        if args.command == "calibrate":
            return _cmd_calibrate(args)
        if args.command == "serve-bench":
            return _cmd_serve_bench(args)
    # CodecError, CacheSpecError and ModelFileError are ValueErrors
    except (ValueError, OSError, CorpusDownloadError) as err:
        print(f"kvjax: error: {_one_line(err)}", file=sys.stderr)
        return 2
    # models.generate.OutOfMemoryError: a program that does not fit in device memory
    except MemoryError as err:
        print(f"kvjax: error: {_one_line(err) or 'out of memory'}", file=sys.stderr)
        return 1
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
