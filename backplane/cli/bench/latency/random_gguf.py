"""Random-weight GGUF files of the llama-family shapes, projections stored as Q4_K.

``--weights-format gguf-q4_k`` measures a shape as a llama.cpp file loads it:
the seven projections of each layer (q, k, v, o, gate, up, down) in Q4_K, the
output head in Q6_K (as llama.cpp's Q4_K_M files have it; the loader keeps
both quantised), the embedding in F16 and the norms in F32. A projection whose
rows are not whole 256-value blocks (the tiny presets) is written as Q8_0,
which the loader keeps quantised too.

The weights are random, so no float matrix is quantised: each block is drawn
directly (random quants, 6-bit scales and mins) with small finite float16 block
scales chosen so that the weights have a mean near zero and a spread like an
initialised model's. An 8B shape is drawn and written in about a minute; the
file is kept under ``--weights-dir`` by shape name and format and reused while
its recorded config matches.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from backplane.core.errors import ConfigError

__all__ = ["GGUF_ARCHITECTURE_OF", "check_gguf_shape", "random_gguf_path", "write_random_gguf"]

logger = logging.getLogger(__name__)

#: HF architecture -> GGUF ``general.architecture`` of the shapes written as GGUF files
GGUF_ARCHITECTURE_OF: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}

#: the ``--weights-format`` value this module writes
FORMAT = "gguf-q4_k"

#: metadata key recording the config and format a file was drawn for (its reuse key)
_ORIGIN_KEY = "backplane.bench.origin"

# ggml type ids, block sizes and bytes per block
_Q8_0, _Q4_K, _Q6_K = 8, 12, 14
_BLOCKS = {_Q8_0: (32, 34), _Q4_K: (256, 144), _Q6_K: (256, 210)}


def check_gguf_shape(name: str, config: dict[str, Any]) -> str:
    """The GGUF architecture of shape ``name``, or a refusal.

    :param name: the shape's name (for the message).
    :param config: its HF config dict.
    :return: ``llama`` or ``qwen3``.
    :raises ConfigError: a shape of another architecture, naming the ones written.
    """
    arch = (config.get("architectures") or ["?"])[0]
    gguf_arch = GGUF_ARCHITECTURE_OF.get(arch)
    if gguf_arch is None:
        raise ConfigError(
            f"--weights-format {FORMAT}: shape {name!r} is a {arch}; GGUF files are written "
            "for the llama-family shapes only (llama-1b, llama-3.2-1b, llama-3.1-8b, qwen3-8b, "
            "tiny-llama); measure this shape with --weights-format safetensors"
        )
    return gguf_arch


def random_gguf_path(workdir: str | os.PathLike[str], name: str) -> Path:
    """Where shape ``name``'s random GGUF file is kept.

    :param workdir: the run's weights folder.
    :param name: the shape's name.
    :return: ``<workdir>/<name>-gguf-q4_k.gguf``.
    """
    return Path(workdir) / f"{name}-{FORMAT}.gguf"


def _block_type(preferred: int, in_features: int) -> int:
    """``preferred`` where rows of ``in_features`` are whole blocks of it, else Q8_0."""
    if in_features % _BLOCKS[preferred][0] == 0:
        return preferred
    if in_features % _BLOCKS[_Q8_0][0] == 0:
        return _Q8_0
    raise ConfigError(
        f"--weights-format {FORMAT}: rows of {in_features} values are not whole blocks of 32 "
        "(Q8_0), the smallest GGUF block written; use --weights-format safetensors"
    )


def _half(rng: np.random.Generator, n: int, low: float, high: float) -> np.ndarray:
    """``n`` float16 values drawn in ``[low, high)`` as bytes ``[n, 2]``."""
    values = (low + (high - low) * rng.random(n, dtype=np.float32)).astype(np.float16)
    return values.view(np.uint8).reshape(n, 2)


def random_blocks(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``ggml_type`` for a ``[rows, cols]`` weight: ``uint8`` ``[rows, row bytes]``.

    Every bit pattern of the quants, scales and mins is a valid value; only the
    float16 block scales are set, small and finite. Q4_K: ``w = d * sc * q -
    dmin * m`` with ``dmin = 7.5 d`` centres the weights (the means of ``sc * q``
    and ``7.5 m`` agree). Q6_K: the signed 8-bit sub-block scales are drawn in
    ``[-8, 8)`` so that ``d`` stays a normal float16. Each type's ``d`` gives a
    spread of about 0.02.

    :param ggml_type: Q8_0 (8), Q4_K (12) or Q6_K (14).
    :param rows: output rows.
    :param cols: values per row (a multiple of the type's block size).
    :param rng: the random generator.
    :return: the blocks.
    """
    block, size = _BLOCKS[ggml_type]
    n = rows * cols // block
    raw = np.frombuffer(bytearray(rng.bytes(n * size)), dtype=np.uint8).reshape(n, size)
    if ggml_type == _Q4_K:
        d = _half(rng, n, 6.2e-5, 1.2e-4)
        raw[:, 0:2] = d
        dmin = (d.view(np.float16).astype(np.float32) * 7.5).astype(np.float16)
        raw[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    elif ggml_type == _Q6_K:
        raw[:, 192:208] = rng.integers(-8, 8, size=(n, 16), dtype=np.int8).view(np.uint8)
        raw[:, 208:210] = _half(rng, n, 1.5e-4, 3.5e-4)
    else:
        raw[:, 0:2] = _half(rng, n, 1.5e-4, 3.5e-4)
    return raw.reshape(rows, -1)


def _rope_freqs(config: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs`` tensor (each default frequency's divisor) of a scaled rope,
    or ``None`` for the default rope."""
    from backplane.models.rotary import rope_inv_freq, rope_parameters

    params = rope_parameters(config)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(
            f"--weights-format {FORMAT}: rope type {kind!r} is not written to GGUF files; "
            "the llama-family shapes use the default or llama3 rope"
        )
    limit = int(config.get("max_position_embeddings", 4096))
    default, _ = rope_inv_freq(head_dim, {**params, "rope_type": "default"}, limit)
    scaled, _ = rope_inv_freq(head_dim, params, limit)
    return (default / scaled).numpy().astype(np.float32)


def _origin(name: str, config: dict[str, Any]) -> str:
    """The reuse key recorded in a file: the format, the shape's name and its config."""
    return json.dumps({"format": FORMAT, "shape": name, "config": config}, sort_keys=True)


def _written_before(path: Path, origin: str) -> bool:
    """Whether ``path`` is a complete file drawn for ``origin``."""
    if not path.is_file():
        return False
    try:
        from backplane.models.gguf.reader import GGUFFile

        return GGUFFile(path).get(_ORIGIN_KEY) == origin
    except Exception:  # a truncated or foreign file is drawn again
        logger.debug("%s is not reused", path, exc_info=True)
        return False


def write_random_gguf(
    name: str, config: dict[str, Any], path: str | os.PathLike[str], *, seed: int = 0
) -> Path:
    """Write shape ``name`` as a random-weight GGUF file with Q4_K projections (or reuse it).

    :param name: the shape's name.
    :param config: its HF config dict (a llama-family architecture).
    :param path: the file to write (see :func:`random_gguf_path`).
    :param seed: the random generator's seed.
    :return: ``path``.
    :raises ConfigError: a shape that is not llama-family, a rope scaling or row
        width the file cannot hold, or no ``gguf`` package (saying how to install it).
    """
    from backplane.models.gguf.reader import import_gguf
    from backplane.models.registry import model_class

    arch = check_gguf_shape(name, config)
    path = Path(path)
    origin = _origin(name, config)
    if _written_before(path, origin):
        logger.info("%s: reusing %s", name, path)
        return path
    gguf = import_gguf()
    cfg = model_class(config.get("architectures")).normalize_config(dict(config))
    hidden = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    for key, kind, value in (
        ("block_count", "uint32", layers),
        ("context_length", "uint32", int(cfg.get("max_position_embeddings", 4096))),
        ("embedding_length", "uint32", hidden),
        ("feed_forward_length", "uint32", inter),
        ("attention.head_count", "uint32", heads),
        ("attention.head_count_kv", "uint32", kv_heads),
        ("attention.key_length", "uint32", head_dim),
        ("attention.value_length", "uint32", head_dim),
        ("rope.freq_base", "float32", theta),
        ("attention.layer_norm_rms_epsilon", "float32", float(cfg.get("rms_norm_eps", 1e-6))),
        ("vocab_size", "uint32", vocab),
    ):
        getattr(writer, f"add_{kind}")(f"{arch}.{key}", value)
    for key in ("bos", "eos"):
        token = cfg.get(f"{key}_token_id")
        if isinstance(token, list):
            token = token[0]
        if token is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", int(token))
    writer.add_string("general.name", f"random {name}")
    writer.add_string(_ORIGIN_KEY, origin)

    rng = np.random.default_rng(seed)
    fell_back: set[str] = set()

    def projection(gguf_name: str, rows: int, cols: int, preferred: int = _Q4_K) -> None:
        kind = _block_type(preferred, cols)
        if kind != preferred:
            fell_back.add(gguf_name.rpartition(".")[0].split(".")[-1])
        writer.add_tensor(
            gguf_name,
            random_blocks(kind, rows, cols, rng),
            raw_dtype=gguf.GGMLQuantizationType(kind),
        )

    def ones(gguf_name: str, size: int) -> None:
        writer.add_tensor(gguf_name, np.ones(size, dtype=np.float32))

    embedding = rng.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(0.02)
    writer.add_tensor("token_embd.weight", embedding.astype(np.float16))
    del embedding
    freqs = _rope_freqs(cfg, head_dim)
    if freqs is not None:
        writer.add_tensor("rope_freqs.weight", freqs)
    for i in range(layers):
        blk = f"blk.{i}"
        ones(f"{blk}.attn_norm.weight", hidden)
        ones(f"{blk}.ffn_norm.weight", hidden)
        if arch == "qwen3":
            ones(f"{blk}.attn_q_norm.weight", head_dim)
            ones(f"{blk}.attn_k_norm.weight", head_dim)
        projection(f"{blk}.attn_q.weight", heads * head_dim, hidden)
        projection(f"{blk}.attn_k.weight", kv_heads * head_dim, hidden)
        projection(f"{blk}.attn_v.weight", kv_heads * head_dim, hidden)
        projection(f"{blk}.attn_output.weight", hidden, heads * head_dim)
        projection(f"{blk}.ffn_gate.weight", inter, hidden)
        projection(f"{blk}.ffn_up.weight", inter, hidden)
        projection(f"{blk}.ffn_down.weight", hidden, inter)
    ones("output_norm.weight", hidden)
    if not cfg.get("tie_word_embeddings", False):
        projection("output.weight", vocab, hidden, preferred=_Q6_K)
    if fell_back:
        logger.info(
            "%s: %s rows are not whole 256-value blocks; written as Q8_0",
            name,
            ", ".join(sorted(fell_back)),
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # a complete file only ever bears the final name
    os.replace(partial, path)
    return path
