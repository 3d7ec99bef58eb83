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

Every config accepts a dict of its fields wherever it is a parameter (:func:`config_of`), so a
launcher's keyword sets stay plain data; every field is validated on construction and a bad
value raises :class:`~cpbook.core.config.ConfigError` naming the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from cpbook.core.config import check_positive

__all__ = ["SchedulerConfig", "CacheConfig", "RunnerConfig", "ServeWorkload", "config_of"]

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
    runner's ``seed``), each generating ``max_new_tokens`` greedy tokens."""

    num_requests: int = 6
    max_new_tokens: int = 8
    prompts: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        check_positive(num_requests=self.num_requests, max_new_tokens=self.max_new_tokens)
