"""A Hugging Face checkpoint checked against its ``config.json`` before any weight is used.

:func:`check_checkpoint` reads only the safetensors headers (an 8-byte little-endian length,
then that many bytes of JSON naming each tensor's ``dtype``, ``shape`` and ``data_offsets``)
and the optional ``model.safetensors.index.json``, and raises
:class:`~cpbook.core.config.ConfigError` on the first of these rules a folder breaks, naming the
file and the tensor:

* ``safetensors-header`` — the file is too short for its header, the header runs past the end
  of the file or is not a JSON object of tensor entries;
* ``safetensors-data`` — a tensor's bytes are not ``prod(shape) * itemsize`` or lie past the
  end of the file (a truncated copy);
* ``checkpoint-index`` — the index is not JSON with a ``weight_map``, names a file the folder
  lacks, or places a tensor in a file whose header does not hold it;
* ``checkpoint-tensors`` — a tensor the config implies is missing, or the folder holds one the
  model does not have;
* ``checkpoint-shape`` — a tensor's shape is not the one ``config.json`` implies (expected and
  found shapes in the message);
* ``checkpoint-dtype`` — a tensor is not stored as a float type the engine converts
  (F16, BF16, F32, F64).

:func:`expected_tensors` is what the config implies: every tensor name of the architectures
:mod:`cpbook.engine.hf` loads, with its shape (transformers' ``nn.Linear`` convention,
``[out_features, in_features]``), required or optional (biases a family may carry).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from cpbook.core.config import ConfigError
from cpbook.engine.hf_model import HFConfig

__all__ = ["FLOAT_DTYPES", "check_checkpoint", "expected_tensors", "read_header"]

#: safetensors dtype -> bytes per element, the float types the loader converts
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_ITEMSIZE = {
    **FLOAT_DTYPES,
    **{"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2},
    **{"I32": 4, "U32": 4, "I64": 8, "U64": 8},
}
INDEX = "model.safetensors.index.json"


def _bad(rule: str, condition: str, **values: Any) -> ConfigError:
    return ConfigError(rule, condition, **values)


def read_header(path: Path) -> dict[str, dict]:
    """The tensor entries ``{name: {"dtype", "shape", "data_offsets"}}`` of safetensors file
    ``path``, after checking that the header is whole and JSON and that every tensor's bytes
    are ``prod(shape) * itemsize`` and lie inside the file (rules ``safetensors-header``,
    ``safetensors-data``, naming the file and the tensor).  Reads the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(
                "safetensors-header",
                "8 bytes of header length at the start of the file",
                file=path.name,
                file_bytes=size,
            )
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise _bad(
                "safetensors-header",
                "a header that fits in the file (truncated or corrupted)",
                file=path.name,
                header_bytes=n,
                file_bytes=size,
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad("safetensors-header", "a JSON header", file=path.name, error=str(e)) from None
    if not isinstance(header, dict):
        raise _bad("safetensors-header", "a JSON object header", file=path.name)
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, entry in header.items():
        try:
            dtype, shape = entry["dtype"], [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _bad(
                "safetensors-header",
                "dtype, shape and data_offsets for every tensor",
                file=path.name,
                tensor=name,
                entry=entry,
            ) from None
        if dtype not in _ITEMSIZE:
            raise _bad(
                "safetensors-header",
                "a safetensors dtype",
                file=path.name,
                tensor=name,
                dtype=dtype,
            )
        if not 0 <= begin <= end or end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise _bad(
                "safetensors-data",
                "data_offsets spanning prod(shape) * itemsize bytes",
                file=path.name,
                tensor=name,
                dtype=dtype,
                shape=shape,
                data_offsets=[begin, end],
            )
        if end > data:
            raise _bad(
                "safetensors-data",
                "every tensor's bytes inside the file (truncated?)",
                file=path.name,
                tensor=name,
                data_end=end,
                data_bytes=data,
            )
        entry["shape"] = shape
    return header


def _gqa_layer(cfg: HFConfig, i: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    H, n, k, D = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
    a = f"model.layers.{i}.self_attn."
    out = {
        a + "q_proj.weight": ((n * D, H), True),
        a + "k_proj.weight": ((k * D, H), True),
        a + "v_proj.weight": ((k * D, H), True),
        a + "o_proj.weight": ((H, n * D), True),
        a + "q_proj.bias": ((n * D,), False),
        a + "k_proj.bias": ((k * D,), False),
        a + "v_proj.bias": ((k * D,), False),
        a + "o_proj.bias": ((H,), False),
    }
    if cfg.qk_norm:
        out[a + "q_norm.weight"] = ((D,), True)
        out[a + "k_norm.weight"] = ((D,), True)
    return out


def _mla_layer(cfg: HFConfig, i: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    H, n, C, R = cfg.hidden_size, cfg.num_q_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    Dn, Dv, Q = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    a = f"model.layers.{i}.self_attn."
    out = {
        a + "kv_a_proj_with_mqa.weight": ((C + R, H), True),
        a + "kv_a_layernorm.weight": ((C,), True),
        a + "kv_b_proj.weight": ((n * (Dn + Dv), C), True),
        a + "o_proj.weight": ((H, n * Dv), True),
    }
    if Q:
        out[a + "q_a_proj.weight"] = ((Q, H), True)
        out[a + "q_a_layernorm.weight"] = ((Q,), True)
        out[a + "q_b_proj.weight"] = ((n * (Dn + R), Q), True)
    else:
        out[a + "q_proj.weight"] = ((n * (Dn + R), H), True)
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    return {
        prefix + "gate_proj.weight": ((inter, hidden), True),
        prefix + "up_proj.weight": ((inter, hidden), True),
        prefix + "down_proj.weight": ((hidden, inter), True),
    }


def expected_tensors(cfg: HFConfig, raw: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{name: (shape, required)}`` of every tensor the checkpoint of ``config.json`` ``raw``
    (parsed as ``cfg`` by :func:`cpbook.engine.hf.hf_config`) may hold, in the model's order.
    DeepSeek's multi-token-prediction layers (``num_nextn_predict_layers``) are not listed:
    the loader skips them."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out: dict[str, tuple[tuple[int, ...], bool]] = {"model.embed_tokens.weight": ((V, H), True)}
    for i in range(cfg.num_hidden_layers):
        pre, m = f"model.layers.{i}.", f"model.layers.{i}.mlp."
        out[pre + "input_layernorm.weight"] = ((H,), True)
        out.update(_mla_layer(cfg, i) if cfg.use_mla else _gqa_layer(cfg, i))
        out[pre + "post_attention_layernorm.weight"] = ((H,), True)
        if cfg.is_moe(i):
            E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
            out[m + "gate.weight"] = ((E, H), True)
            if cfg.topk_method == "noaux_tc":
                out[m + "gate.e_score_correction_bias"] = ((E,), True)
            for e in range(E):
                out.update(_mlp(f"{m}experts.{e}.", H, Im))
            if cfg.n_shared_experts:
                out.update(_mlp(m + "shared_experts.", H, Im * cfg.n_shared_experts))
        else:
            out.update(_mlp(m, H, cfg.intermediate_size))
    out["model.norm.weight"] = ((H,), True)
    out["lm_head.weight"] = ((V, H), not raw.get("tie_word_embeddings", False))
    return out


def _index(folder: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor -> file), or None without an index."""
    path = folder / INDEX
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise _bad(
            "checkpoint-index", "a JSON index with a weight_map", file=INDEX, error=str(e)
        ) from None
    if not isinstance(weight_map, dict):
        raise _bad("checkpoint-index", "a JSON index with a weight_map", file=INDEX)
    return weight_map


def check_checkpoint(folder: str | Path, cfg: HFConfig, raw: dict) -> dict[str, str]:
    """Check every safetensors file of ``folder`` (those its index names, or every
    ``*.safetensors``) against ``config.json`` (``raw``, parsed as ``cfg``) without reading a
    weight; returns ``{tensor: file}``.  The first broken rule (see the module docstring) raises
    :class:`ConfigError` naming the file and the tensor, and for a shape the expected and found
    shapes."""
    folder = Path(folder)
    weight_map = _index(folder)
    if weight_map is None:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    else:
        files = sorted(set(weight_map.values()))
        for name, f in sorted(weight_map.items()):
            if not (folder / f).is_file():
                raise _bad(
                    "checkpoint-index",
                    "every file the index names in the folder",
                    file=f,
                    tensor=name,
                    index=INDEX,
                )
    if not files:
        raise _bad("hf-folder", "a folder with config.json and *.safetensors", path=str(folder))
    where: dict[str, str] = {}
    headers = {}
    for f in files:
        headers[f] = read_header(folder / f)
        for name in headers[f]:
            where.setdefault(name, f)
    for name, f in sorted((weight_map or {}).items()):
        if name not in headers[f]:
            raise _bad(
                "checkpoint-index",
                "each tensor in the file the index names",
                file=f,
                tensor=name,
                index=INDEX,
            )
    want = expected_tensors(cfg, raw)
    for name, (shape, required) in want.items():
        if name not in where:
            if required:
                raise _bad(
                    "checkpoint-tensors",
                    "every tensor config.json implies",
                    file=files[0] if len(files) == 1 else "any",
                    tensor=name,
                    expected=list(shape),
                )
            continue
        entry = headers[where[name]][name]
        if tuple(entry["shape"]) != shape:
            raise _bad(
                "checkpoint-shape",
                "each tensor's shape as config.json implies",
                file=where[name],
                tensor=name,
                expected=list(shape),
                found=entry["shape"],
            )
        if entry["dtype"] not in FLOAT_DTYPES:
            raise _bad(
                "checkpoint-dtype",
                f"a float tensor ({', '.join(FLOAT_DTYPES)})",
                file=where[name],
                tensor=name,
                dtype=entry["dtype"],
            )
    L = cfg.num_hidden_layers
    mtp = tuple(f"model.layers.{L + j}." for j in range(raw.get("num_nextn_predict_layers", 0)))
    for name in where:
        if name not in want and not name.startswith(mtp):
            raise _bad(
                "checkpoint-tensors",
                "only tensors config.json implies",
                file=where[name],
                tensor=name,
            )
    return where
