"""Hardware and model specs (each one sourced), KV-cache capacity arithmetic, and the α–β
model of one collective with the per-layer decode-step model built on it (chapter 6).

Every number here carries a ``source``: one or more BibTeX keys of
``book/references.bib``, comma-separated so the string can be pasted into a
MyST ``{cite}`` role. The appendix page ``book/appendix_hardware_models.md``
prints these tables; ``tests/test_costmodel.py`` checks that page against this
module, so the prose and the code cannot drift apart.

Conventions
-----------
* Vendor memory and bandwidth figures use decimal units (1 GB = 1e9 bytes).
* Link bandwidth is *per direction* (NVLink 4: 900 GB/s bidirectional means
  450 GB/s each way).
* MLA models: ``num_kv_heads`` is 1 (one compressed latent shared by all query
  heads), ``head_dim`` is the query/key head dimension (``qk_nope_head_dim +
  qk_rope_head_dim``), and the cache size comes from ``kv_lora_rank +
  qk_rope_head_dim``, the width of the latent vector vLLM stores per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ..config import ParallelConfig

GB = 10**9  #: decimal gigabyte, as on vendor datasheets
GIB = 2**30  #: binary gibibyte, as in ``torch.cuda.mem_get_info`` style reports


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator. Bandwidths in bytes/s, FLOP/s dense (no sparsity)."""

    name: str
    hbm_bytes: int
    hbm_bw_bytes_per_s: float
    bf16_flops: float
    link_bw_bytes_per_s: float  #: scale-up link (NVLink / UB), per direction
    source: str


GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec("H100 SXM", 80 * GB, 3.35e12, 989e12, 450e9, "nvidia_h100"),
    "H200": GPUSpec("H200 SXM", 141 * GB, 4.8e12, 989e12, 450e9, "nvidia_h200"),
    # DGX B200: 1,440 GB, 64 TB/s HBM and 14.4 TB/s NVLink for 8 GPUs, i.e.
    # 180 GB, 8 TB/s, 1.8 TB/s bidirectional = 900 GB/s per direction per GPU.
    # BF16 dense 2.25 PFLOP/s = half the 4.5 PFLOP/s sparse figure.
    "B200": GPUSpec("B200 (DGX B200)", 180 * GB, 8e12, 2.25e15, 900e9, "nvidia_dgx_b200"),
    # CloudMatrix384 (arXiv 2506.12708): 384 chips, ~300 PFLOP/s BF16,
    # 1,229 TB/s HBM, 269 TB/s interconnect in total, i.e. ~780 TFLOP/s,
    # 3.2 TB/s and ~0.7 TB/s per chip. Other sources disagree on the link
    # (392 GB/s unidirectional, 400 GB/s, 784 GB/s) and whether 0.7 TB/s is
    # per direction is not confirmed: treat the link figure as approximate.
    "Ascend910C": GPUSpec("Ascend 910C", 128 * GB, 3.2e12, 780e12, 0.7e12, "zuo2025cloudmatrix"),
}


@dataclass(frozen=True)
class ModelSpec:
    """Attention shape and weight size of one model (see the module docstring for MLA)."""

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    use_mla: bool
    kv_lora_rank: int  #: 0 for GQA models
    qk_rope_head_dim: int  #: 0 for GQA models
    num_params: float
    weight_bytes_per_param: int
    source: str
    hidden_size: int = 0  #: width of the residual stream (input of GQA's ``q_proj``)
    q_lora_rank: int = 0  #: MLA: input width of ``q_b_proj``, the sharded query projection


def _gqa(
    name: str, layers: int, q: int, kv: int, params: float, source: str, hidden: int = 0
) -> ModelSpec:
    """A GQA model with 128-dim heads and bf16 weights."""
    return ModelSpec(name, layers, q, kv, 128, False, 0, 0, params, 2, source, hidden)


def _mla(name: str, layers: int, q: int, params: float, source: str) -> ModelSpec:
    """A DeepSeek-V3-shaped MLA model with FP8 weights (hidden 7168, ``q_lora_rank`` 1536)."""
    # qk_nope 128 + rope 64 = 192; latent 512 + rope 64 = 576 stored per token.
    return ModelSpec(name, layers, q, 1, 192, True, 512, 64, params, 1, source, 7168, 1536)


MODELS: dict[str, ModelSpec] = {
    # Both MLA models ship FP8 weights (1 byte per parameter).
    "DeepSeek-V3": _mla("DeepSeek-V3", 61, 128, 671e9, "hf_deepseek_v3,deepseekai2024v3"),
    "Kimi-K2": _mla("Kimi-K2", 61, 64, 1.04e12, "hf_kimi_k2,kimiteam2025k2"),
    "Llama-3.1-8B": _gqa(
        "Llama-3.1-8B", 32, 32, 8, 8.03e9, "hf_llama31_8b,grattafiori2024llama3", 4096
    ),
    "Llama-3.1-70B": _gqa(
        "Llama-3.1-70B", 80, 64, 8, 70.6e9, "hf_llama31_70b,grattafiori2024llama3", 8192
    ),
    "Llama-3.1-405B": _gqa(
        "Llama-3.1-405B", 126, 128, 8, 405.9e9, "hf_llama31_405b,grattafiori2024llama3", 16384
    ),
    "Qwen2.5-7B-1M": _gqa(
        "Qwen2.5-7B-Instruct-1M", 28, 28, 4, 7.61e9, "hf_qwen25_7b_1m,yang2025qwen25_1m", 3584
    ),
    "Qwen3-235B-A22B": _gqa(
        "Qwen3-235B-A22B", 94, 64, 4, 235e9, "hf_qwen3_235b,yang2025qwen3", 4096
    ),
}

#: bytes per cached element for GQA (and for the MLA latent, except "fp8")
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: vLLM's ``fp8_ds_mla`` layout: 512 fp8 latent + 16 B scales + 64 bf16 rope
FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER = 512 + 16 + 64 * 2
#: placeholder for activations, CUDA graphs and comm buffers (vLLM profiles it)
DEFAULT_ACTIVATION_RESERVE_BYTES = 4 * GIB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def parallel_config(model: ModelSpec, tp: int = 1, dcp: int = 1) -> ParallelConfig:
    """The model's attention under TP × DCP, validated by :class:`~cpbook.config.ParallelConfig`.

    One source of truth for vLLM's rules: an invalid layout raises ``ConfigError`` (a
    ``ValueError``) naming the violated rule and the values.
    """
    return ParallelConfig(
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        num_q_heads=model.num_q_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        use_mla=model.use_mla,
    )


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str = "bf16") -> int:
    """Bytes of KV cache one token occupies, summed over all layers (one copy).

    GQA: ``2 * num_kv_heads * head_dim * num_layers * bytes``.
    MLA: ``(kv_lora_rank + qk_rope_head_dim) * num_layers * bytes``; with
    ``kv_dtype="fp8"`` vLLM's ``fp8_ds_mla`` layout, 656 B per token and layer.
    """
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(
            f"[kv-dtype] requires kv_dtype in {sorted(KV_DTYPE_BYTES)}; got kv_dtype={kv_dtype!r}"
        )
    if model.use_mla:
        if kv_dtype == "fp8":
            return FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER * model.num_layers
        width = model.kv_lora_rank + model.qk_rope_head_dim
        return width * model.num_layers * KV_DTYPE_BYTES[kv_dtype]
    return 2 * model.num_kv_heads * model.head_dim * model.num_layers * KV_DTYPE_BYTES[kv_dtype]


def kv_bytes_for_context(model: ModelSpec, tokens: int, kv_dtype: str = "bf16") -> int:
    """Bytes of KV cache for ``tokens`` tokens of one request (one copy, all layers)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(
            f"[non-negative-tokens] requires a non-negative int; got tokens={tokens!r}"
        )
    return tokens * kv_bytes_per_token(model, kv_dtype)


def kv_replication(model: ModelSpec, tp: int) -> int:
    """How many GPUs of one TP group hold a copy of each KV head.

    GQA: ``tp // num_kv_heads`` when ``tp > num_kv_heads``, else 1 (heads are
    split, nothing is copied). MLA: ``tp`` (every rank keeps the full latent).
    """
    parallel_config(model, tp)
    if model.use_mla:
        return tp
    return tp // model.num_kv_heads if tp > model.num_kv_heads else 1


def kv_bytes_per_token_per_gpu(
    model: ModelSpec, tp: int = 1, dcp: int = 1, kv_dtype: str = "bf16"
) -> float:
    """KV bytes one GPU stores per token of a request, under TP and DCP.

    A GPU holds ``num_kv_heads / tp`` KV heads but never less than one (MLA:
    the whole latent); DCP then shards the *tokens* over ``dcp`` ranks without
    changing the heads, so the result is exactly the ``dcp=1`` value / ``dcp``.
    Raises ValueError for configurations vLLM rejects.
    """
    parallel_config(model, tp, dcp)
    total = kv_bytes_per_token(model, kv_dtype)
    if model.use_mla:
        heads_share = Fraction(1)
    else:
        heads_share = Fraction(max(model.num_kv_heads // tp, 1), model.num_kv_heads)
    return float(total * heads_share / dcp)


def weight_bytes_per_gpu(model: ModelSpec, tp: int) -> float:
    """Weight bytes per GPU: ``num_params * weight_bytes_per_param / tp``.

    Ignores tensors replicated across TP ranks (norms, and embeddings in some
    setups) and expert parallelism: a lower bound good to a few percent.
    """
    parallel_config(model, tp)
    return model.num_params * model.weight_bytes_per_param / tp


def kv_budget_bytes_per_gpu(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes: float = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> float:
    """Bytes left for the KV cache on one GPU, vLLM style.

    ``hbm * gpu_memory_utilization - weights / tp - activation_reserve_bytes``.
    Raises ValueError when the result is not positive (the model does not fit).
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"[gpu-memory-utilization] requires 0 < gpu_memory_utilization <= 1; "
            f"got gpu_memory_utilization={gpu_memory_utilization}"
        )
    if activation_reserve_bytes < 0:
        raise ValueError(
            f"[activation-reserve] requires activation_reserve_bytes >= 0; "
            f"got activation_reserve_bytes={activation_reserve_bytes}"
        )
    weights = weight_bytes_per_gpu(model, tp)
    budget = gpu.hbm_bytes * gpu_memory_utilization - weights - activation_reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"[model-fits] requires weights + reserve < usable HBM; {model.name} does not fit on "
            f"{gpu.name} at tp={tp}: "
            f"{gpu.hbm_bytes / GB:.0f} GB x {gpu_memory_utilization} - "
            f"weights {weights / GB:.1f} GB - reserve "
            f"{activation_reserve_bytes / GB:.1f} GB = {budget / GB:.1f} GB"
        )
    return budget


def max_context_tokens(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int = 1,
    dcp: int = 1,
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes: float = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> int:
    """Longest single request whose KV cache fits: floor(budget / per-GPU bytes).

    Data parallelism does not change this number: each DP replica serves whole
    requests, so a request's KV must fit in one replica. Block granularity and
    the model's own position limit are ignored.
    """
    budget = kv_budget_bytes_per_gpu(
        model, gpu, tp, gpu_memory_utilization, activation_reserve_bytes
    )
    per_token = kv_bytes_per_token_per_gpu(model, tp, dcp, kv_dtype)
    return math.floor(budget / per_token)


def prefill_flops(model: ModelSpec, tokens: int) -> tuple[float, float]:
    """FLOPs of one causal prefill of ``tokens`` tokens: ``(matmul, attention)``.

    ``matmul = 2 * num_params * tokens`` (every weight used once per token; for an MoE model
    this counts all experts, so only use it for dense models) and
    ``attention = 2 * num_layers * num_q_heads * head_dim * tokens**2`` (QKᵀ and PV, each
    ``2·T²·H·d`` for the full square, halved by the causal mask).  The crossover where attention
    overtakes the matmuls is ``tokens = num_params / (num_layers * num_q_heads * head_dim)``.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(
            f"[non-negative-tokens] requires a non-negative int; got tokens={tokens!r}"
        )
    attention = 2.0 * model.num_layers * model.num_q_heads * model.head_dim * tokens**2
    return 2.0 * model.num_params * tokens, attention


def decode_bytes_per_step(
    model: ModelSpec, context_tokens: int, tp: int = 1, dcp: int = 1, kv_dtype: str = "bf16"
) -> tuple[float, float]:
    """HBM bytes one GPU reads for one decode step of one request: ``(weights, kv)``.

    Decode is memory-bound: every step streams this GPU's weight shard and its share of the
    request's KV cache (``context_tokens`` tokens).  ``(weights + kv) / hbm_bw`` bounds TPOT
    from below.
    """
    kv = kv_bytes_per_token_per_gpu(model, tp, dcp, kv_dtype) * context_tokens
    return weight_bytes_per_gpu(model, tp), kv


# ---------------------------------------------------------------------- collectives (α–β)


@dataclass(frozen=True)
class LinkSpec:
    """The scale-up link as one collective call sees it: ``t = alpha_s + bytes_sent / bw``.

    ``alpha_s`` is the fixed cost of one call at small sizes (launch, synchronisation, protocol
    steps), measured per call at the group sizes of interest; ``bw_bytes_per_s`` the per
    direction bandwidth one GPU drives into the fabric.
    """

    name: str
    alpha_s: float
    bw_bytes_per_s: float
    source: str


LINKS: dict[str, LinkSpec] = {
    # 900 GB/s bidirectional NVLink 4 per GPU = 450 GB/s per direction (datasheets).  α: vLLM
    # PR #24111's isolated all-reduce benchmark on H100 (CUDA graphs, bf16, 0.5 MB): NCCL
    # 17 µs on 4 GPUs and 23 µs on 6, vLLM's one-stage custom kernel 10 and 13 µs.  15 µs per
    # NCCL call is the middle of that range once the ~2 µs of transfer is taken out.
    "NVLink4": LinkSpec(
        "NVLink 4 + NVSwitch (H100/H200 HGX), NCCL", 15e-6, 450e9, "nvidia_h200,vllm_pr24111"
    ),
}

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def collective_time(op: str, bytes_per_rank: float, group_size: int, link: LinkSpec) -> float:
    """Seconds of one collective: ``alpha + bytes_per_rank / bw``, 0 for a group of one.

    ``bytes_per_rank`` is what one rank *sends* (the convention of the traces and of every
    ``*_comm_bytes`` formula: ``(N-1)·chunk`` for a ring all-gather or reduce-scatter,
    ``2·(N-1)/N·size`` for a ring all-reduce), so the ring's bandwidth term is exact and the
    algorithm's step count is folded into ``alpha``.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"[collective-op] requires op in {COLLECTIVES}; got op={op!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"[positive-group] requires a positive int; got group_size={group_size!r}")
    if bytes_per_rank < 0:
        raise ValueError(f"[non-negative-bytes] requires >= 0; got {bytes_per_rank=}")
    if group_size == 1:
        return 0.0
    return link.alpha_s + bytes_per_rank / link.bw_bytes_per_s


# ---------------------------------------------------------------- one decode step, per layer

DECODE_MODES = ("no_cp", "dcp", "dcp_tpa")
#: Fraction of the datasheet HBM bandwidth a decode-attention kernel reaches; FlashMLA reports
#: up to 3000 GB/s on an H800 SXM5 (3.35 TB/s HBM3), about 0.9 — 0.8 leaves room for short rows.
DEFAULT_HBM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class DecodeLayerTime:
    """Modelled seconds of one layer's attention in one decode step, on one GPU.

    ``kv_read_s``: streaming this GPU's KV share from HBM; ``comm_s``: the layer's collectives
    (``calls``, ``[(op, group size, bytes sent)]``, α–β each); ``q_proj_extra_s``: reading the
    extra ``q_proj`` weights TPA replicates.  Work that is the same in every mode (the rest of
    ``q_proj``, ``o_proj``, the MLP) is left out: it shifts the step but not the break-even.
    """

    kv_read_s: float
    comm_s: float
    q_proj_extra_s: float
    calls: tuple[tuple[str, int, int], ...]

    @property
    def total_s(self) -> float:
        return self.kv_read_s + self.comm_s + self.q_proj_extra_s


def _decode_config(model: ModelSpec, mode: str, tp: int, dcp: int) -> ParallelConfig:
    from ..tpa import tpa_config

    if mode not in DECODE_MODES:
        raise ValueError(f"[decode-mode] requires mode in {DECODE_MODES}; got mode={mode!r}")
    if mode == "no_cp":
        return parallel_config(model, tp, 1)
    if mode == "dcp":
        return parallel_config(model, tp, dcp)
    return tpa_config(
        "tpa",
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        num_q_heads=model.num_q_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        use_mla=model.use_mla,
    )


def decode_layer_time(
    model: ModelSpec,
    gpu: GPUSpec,
    context_tokens: float,
    mode: str,
    *,
    tp: int = 8,
    dcp: int = 8,
    num_reqs: int = 1,
    kv_dtype: str = "bf16",
    hbm_efficiency: float = DEFAULT_HBM_EFFICIENCY,
    link: LinkSpec = LINKS["NVLink4"],
    dcp_comm_backend: str = "ag_rs",
    act_bytes: int = 2,
) -> DecodeLayerTime:
    """One layer's decode attention on one GPU of a TP group, ``num_reqs`` requests of
    ``context_tokens`` cached tokens each, in ``mode``:

    * ``no_cp``: TP only, every GPU streams its heads' whole KV (MLA: the whole latent);
    * ``dcp``: DCP = ``dcp`` (vLLM's rules), ``1/dcp`` of the tokens, plus the query
      all-gather and the combine;
    * ``dcp_tpa``: the same without the query all-gather (``tensor_parallel_size_attention``
      for GQA, ``dcp_q_replicate`` for MLA), plus reading ``dcp - 1`` more ``q_proj`` shards.

    The collectives and their bytes are :func:`cpbook.tpa.tpa_comm_bytes` (activations of
    ``act_bytes``), the extra weights :func:`cpbook.tpa.tpa_costs`; the KV heads a GPU holds
    come from :func:`cpbook.tpa.attention_kv_heads`.  Every term is linear in
    ``context_tokens``, so :func:`decode_break_even` solves for the crossing exactly.
    """
    from ..tpa import attention_kv_heads, tpa_comm_bytes, tpa_costs

    if not 0 < hbm_efficiency <= 1:
        raise ValueError(
            f"[hbm-efficiency] requires 0 < hbm_efficiency <= 1; got {hbm_efficiency=}"
        )
    if context_tokens < 0:
        raise ValueError(f"[non-negative-tokens] requires >= 0; got {context_tokens=}")
    cfg = _decode_config(model, mode, tp, dcp)
    heads = attention_kv_heads(cfg, 0)
    per_head = kv_bytes_per_token(model, kv_dtype) / model.num_layers / model.num_kv_heads
    kv_bytes = per_head * (heads.stop - heads.start) / cfg.dcp * context_tokens * num_reqs
    hbm = gpu.hbm_bw_bytes_per_s * hbm_efficiency
    if model.use_mla:
        q_dim, out_dim = model.kv_lora_rank + model.qk_rope_head_dim, model.kv_lora_rank
    else:
        q_dim = out_dim = model.head_dim
    calls = tpa_comm_bytes(
        "tpa" if mode == "dcp_tpa" else "standard",
        num_reqs,
        cfg.q_heads_per_rank,
        q_dim,
        out_dim,
        cfg.dcp,
        cfg.tp,
        model.hidden_size,
        dcp_comm_backend,
        act_bytes,
    )
    sized = tuple((op, cfg.tp if op == "all_reduce" else cfg.dcp, b) for op, b in calls)
    q_in = model.q_lora_rank or model.hidden_size
    extra = tpa_costs(cfg, q_in, num_reqs, model.head_dim, model.weight_bytes_per_param)
    return DecodeLayerTime(
        kv_read_s=kv_bytes / hbm,
        comm_s=sum(collective_time(op, b, n, link) for op, n, b in sized),
        q_proj_extra_s=extra["extra_weight_bytes"] / hbm,
        calls=sized,
    )


def decode_break_even(model: ModelSpec, gpu: GPUSpec, mode: str, **kwargs) -> float:
    """Context length (tokens per request) above which ``mode`` beats ``no_cp`` per decode step.

    Both times are linear in the context, ``a + s·L``; the crossing is ``(a_mode - a_no_cp) /
    (s_no_cp - s_mode)``: ``0.0`` if ``mode`` never loses, ``inf`` if it never wins.  ``kwargs``
    go to :func:`decode_layer_time` for both modes.
    """
    if mode == "no_cp":
        raise ValueError("[decode-mode] requires mode in ('dcp', 'dcp_tpa'); got mode='no_cp'")
    big = float(2**20)
    a0, a1 = (decode_layer_time(model, gpu, 0, m, **kwargs).total_s for m in ("no_cp", mode))
    b0, b1 = (decode_layer_time(model, gpu, big, m, **kwargs).total_s for m in ("no_cp", mode))
    saved_per_token = ((b0 - a0) - (b1 - a1)) / big
    if a1 <= a0:
        return 0.0
    if saved_per_token <= 0:
        return math.inf
    return (a1 - a0) / saved_per_token
