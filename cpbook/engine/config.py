"""The engine's configuration objects, vLLM's names where vLLM has them.

An :class:`~cpbook.engine.engine.Engine` is configured like vLLM's ``VllmConfig``, one object
per concern instead of a wall of keywords:

* :class:`~cpbook.core.config.ParallelConfig` — the TP × DCP × PCP layout (or a dict of its
  vLLM-named sizes, completed by the engine with the model's attention shape);
* :class:`SchedulerConfig` — ``max_num_seqs``, ``max_num_batched_tokens``
  (``vllm/config/scheduler.py``; chunked prefill is always on, as in vLLM v1);
* :class:`CacheConfig` — ``block_size``, ``num_gpu_blocks`` (physical KV blocks per rank),
  ``enable_prefix_caching`` (``vllm/config/cache.py``);
* :class:`~cpbook.engine.spec_decode.SpeculativeConfig` — chapter 10's drafter;
* :class:`RunnerConfig` — what vLLM spreads over ``ModelConfig`` (``dtype``, ``seed``: the
  tiny models are random weights from the seed, vLLM's ``load_format="dummy"``) and cpbook's
  own PCP chunked-prefill choice (``strategy``, ``workspace_size``, the link's
  ``alpha``/``beta`` for ``strategy="auto"``);
* :class:`ServeWorkload` — what :func:`~cpbook.engine.engine.serve_rank` serves.

And the one resolution of a model name (:func:`model_config`, :func:`load_model`): an engine
model name (:data:`~cpbook.engine.models.ENGINE_MODELS`) or a Hugging Face model folder;
:func:`engine_config` and :func:`valid_grid` give a model's validated ``ParallelConfig`` and
every grid it accepts.

Every config accepts a dict of its fields wherever it is a parameter (:func:`config_of`), so a
launcher's keyword sets stay plain data; every field is validated on construction and a bad
value raises :class:`~cpbook.core.config.ConfigError` naming the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TypeVar

import torch

from cpbook.core.config import ConfigError, ParallelConfig, check_positive
from cpbook.core.errors import RuleError
from cpbook.engine.hf import from_pretrained, hf_config, read_config_json
from cpbook.engine.models import ENGINE_MODELS, ModelConfig, TinyModel, get_engine_model

__all__ = [
    "SchedulerConfig",
    "CacheConfig",
    "RunnerConfig",
    "ServeWorkload",
    "config_of",
    "engine_config",
    "engine_parallel_config",
    "load_model",
    "model_config",
    "valid_grid",
    "request_fits_model",
]

T = TypeVar("T")


def config_of(cls: type[T], value: T | dict[str, Any] | None) -> T:
    """``value`` as a ``cls``: itself, ``cls(**value)`` for a dict, ``cls()`` for ``None``."""
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step (vLLM's ``SchedulerConfig`` names)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32

    def __post_init__(self) -> None:
        check_positive(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache of every rank (vLLM's ``CacheConfig`` names): ``num_gpu_blocks``
    physical blocks of ``block_size`` slots (= block ids of the DCP group)."""

    block_size: int = 4
    num_gpu_blocks: int = 64
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_positive(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks)


@dataclass(frozen=True)
class RunnerConfig:
    """How a rank builds and runs the model: weights' ``dtype`` and ``seed`` (the draft model
    of ``speculative_config`` uses ``seed + 1``), the chunked-prefill ``strategy`` (``"auto"``:
    the chapter 5 selector, priced with ``alpha`` seconds per call and ``beta`` per byte,
    ``None``: the CPU fit) and its ``workspace_size``."""

    dtype: str = "float64"
    seed: int = 0
    strategy: str = "auto"
    workspace_size: int = 64
    alpha: float | None = None
    beta: float | None = None

    def __post_init__(self) -> None:
        check_positive(workspace_size=self.workspace_size)


@dataclass(frozen=True)
class ServeWorkload:
    """What :func:`~cpbook.engine.engine.serve_rank` serves: ``prompts`` (token lists), or
    ``num_requests`` prompts of :func:`~cpbook.engine.engine.make_prompts` (seeded by the
    runner's ``seed``), each generating ``max_new_tokens`` greedy tokens (one count for all,
    or one per prompt); ``request_ids`` name the prompts (default ``"0"``, ``"1"``, ...)."""

    num_requests: int = 6
    max_new_tokens: int | Sequence[int] = 8
    prompts: Sequence[Sequence[int]] | None = None
    request_ids: Sequence[str] | None = None

    def __post_init__(self) -> None:
        check_positive(num_requests=self.num_requests)
        count = len(self.prompts) if self.prompts is not None else self.num_requests
        per_prompt = {"request_ids": self.request_ids}
        if isinstance(self.max_new_tokens, int):
            check_positive(max_new_tokens=self.max_new_tokens)
        else:
            for n in self.max_new_tokens:
                check_positive(max_new_tokens=n)
            per_prompt["max_new_tokens"] = self.max_new_tokens
        for name, values in per_prompt.items():
            if values is not None and len(values) != count:
                raise ConfigError(
                    "workload-per-prompt",
                    f"one of {name} per prompt",
                    prompts=count,
                    **{name: len(values)},
                )


def request_fits_model(
    model: ModelConfig, prompt_len: int, max_new_tokens: int, request_id: str = "0"
) -> str | None:
    """None when a request of ``prompt_len`` tokens generating ``max_new_tokens`` stays within
    the model's positions (``model.max_model_len``; None: no limit), else the refusal
    (rule ``request-fits-model``).  vLLM v0.34.0 refuses a prompt longer than
    ``max_model_len`` (``vllm/renderers/params.py``) and caps ``max_tokens`` at
    ``max_model_len - prompt`` (``get_max_tokens``, ``vllm/entrypoints/serve/utils/
    api_utils.py``); cpbook refuses the whole request instead, so no request silently gets
    fewer tokens than it asked for."""
    limit = model.max_model_len
    if limit is None or prompt_len + max_new_tokens <= limit:
        return None
    return str(
        RuleError(
            "request-fits-model",
            "prompt + max_new_tokens <= the model's max_model_len (max_position_embeddings)",
            request_id=request_id,
            tokens=prompt_len + max_new_tokens,
            max_model_len=limit,
        )
    )


def engine_config(
    model: str | ModelConfig,
    tensor_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    prefill_context_parallel_size: int = 1,
    *,
    block_size: int = 4,
    cp_kv_cache_interleave_size: int = 1,
    dcp_comm_backend: str = "ag_rs",
) -> ParallelConfig:
    """The validated :class:`~cpbook.core.config.ParallelConfig` of engine model ``model`` (a
    name of :data:`~cpbook.engine.models.ENGINE_MODELS`, a Hugging Face model folder, or its
    :class:`ModelConfig`) on a TP×DCP×PCP grid, by
    :meth:`~cpbook.core.config.ParallelConfig.for_model`.  Raises
    :class:`~cpbook.core.config.ConfigError` naming the rule."""
    return ParallelConfig.for_model(
        model_config(model) if isinstance(model, str) else model,
        tensor_parallel_size=tensor_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        prefill_context_parallel_size=prefill_context_parallel_size,
        cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        block_size=block_size,
        dcp_comm_backend=dcp_comm_backend,
    )


def _is_hf_folder(model: str) -> bool:
    """The one model-name rule: an engine model name wins, else an existing folder is a
    Hugging Face model, else the name is looked up (and rejected) as an engine model."""
    return model not in ENGINE_MODELS and Path(model).is_dir()


def model_config(model: str) -> ModelConfig:
    """The :class:`ModelConfig` of an engine model name or of a Hugging Face folder's
    ``config.json`` (validated by :func:`cpbook.engine.hf.hf_config`, no weights read)."""
    if not _is_hf_folder(model):
        return get_engine_model(model)
    return hf_config(read_config_json(model), Path(model).name)[0]


def load_model(model: str | TinyModel, dtype: str = "float64", seed: int = 0) -> TinyModel:
    """``model`` itself if it is a :class:`TinyModel`; else an engine model's weights from
    ``seed`` or a Hugging Face folder's weights (:func:`cpbook.engine.hf.from_pretrained`), in
    ``dtype`` — the name resolved as :func:`model_config` resolves it."""
    if not isinstance(model, str):
        return model
    if _is_hf_folder(model):
        return from_pretrained(model, getattr(torch, dtype))
    return TinyModel.from_name(model, seed, getattr(torch, dtype))


def engine_parallel_config(
    model: ModelConfig, parallel_config: ParallelConfig | dict[str, Any] | None, cache: CacheConfig
) -> ParallelConfig:
    """The engine's :class:`ParallelConfig`: a dict of layout sizes completed with ``model``'s
    attention shape and the cache's block size, or a given config checked against both."""
    if not isinstance(parallel_config, ParallelConfig):
        layout = {"block_size": cache.block_size, **(parallel_config or {})}
        parallel_config = ParallelConfig.for_model(model, **layout)
    shape = {k: getattr(parallel_config, k) for k in model.attention_shape}
    if shape != model.attention_shape:
        raise ConfigError(
            "config-matches-model",
            "parallel_config's attention shape == the model's",
            config=shape,
            model=model.attention_shape,
        )
    if parallel_config.block_size != cache.block_size:
        raise ConfigError(
            "block-size-agrees",
            "parallel_config.block_size == cache_config.block_size",
            parallel_block_size=parallel_config.block_size,
            cache_block_size=cache.block_size,
        )
    return parallel_config


def valid_grid(
    model: str,
    tps: Sequence[int] = (1, 2, 4),
    dcps: Sequence[int] = (1, 2, 4),
    pcps: Sequence[int] = (1, 2),
    max_world: int = 8,
) -> list[tuple[int, int, int]]:
    """Every ``(tp, dcp, pcp)`` of the given sizes that ``model`` accepts, ``tp*pcp <=
    max_world``, ordered by world size."""
    out = []
    for tp in tps:
        for pcp in pcps:
            for dcp in dcps:
                if tp * pcp > max_world:
                    continue
                try:
                    engine_config(model, tp, dcp, pcp)
                except ConfigError:
                    continue
                out.append((tp, dcp, pcp))
    return sorted(out, key=lambda c: (c[0] * c[2], c))
