"""Hardware, link and model specs, each number sourced.

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

import numbers
from dataclasses import dataclass, replace
from typing import Any

from cpbook.core.errors import RuleError

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
    #: FP8 dense tensor FLOP/s (twice BF16 on Hopper and Blackwell); 0 where the datasheet gives
    #: none, and FP8 GEMMs then run at the BF16 rate
    fp8_flops: float = 0.0
    #: GPUs one scale-up domain joins (one HGX / DGX node: 8); a collective group wider than
    #: that crosses the inter-node link (:mod:`cpbook.costmodel.nodes`)
    gpus_per_node: int = 8

    def peak_flops(self, weight_bytes_per_param: float) -> float:
        """Dense peak of GEMMs on weights of ``weight_bytes_per_param`` bytes: the FP8 peak for
        1-byte (FP8) weights where the GPU has one, else the BF16 peak."""
        if weight_bytes_per_param <= 1 and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


GPUS: dict[str, GPUSpec] = {
    # FP8 dense 1,979 TFLOP/s on H100 and H200 SXM (the datasheets' 3,958 is with sparsity).
    "H100": GPUSpec("H100 SXM", 80 * GB, 3.35e12, 989e12, 450e9, "nvidia_h100", 1979e12),
    "H200": GPUSpec("H200 SXM", 141 * GB, 4.8e12, 989e12, 450e9, "nvidia_h200", 1979e12),
    # DGX B200: 1,440 GB, 64 TB/s HBM and 14.4 TB/s NVLink for 8 GPUs, i.e.
    # 180 GB, 8 TB/s, 1.8 TB/s bidirectional = 900 GB/s per direction per GPU.
    # BF16 dense 2.25 PFLOP/s = half the 4.5 PFLOP/s sparse figure; FP8 dense 4.5 PFLOP/s =
    # half the 72 PFLOP/s (sparse) of 8 GPUs.
    "B200": GPUSpec("B200 (DGX B200)", 180 * GB, 8e12, 2.25e15, 900e9, "nvidia_dgx_b200", 4.5e15),
    # CloudMatrix384 (arXiv 2506.12708): 384 chips, ~300 PFLOP/s BF16,
    # 1,229 TB/s HBM, 269 TB/s interconnect in total, i.e. ~780 TFLOP/s,
    # 3.2 TB/s and ~0.7 TB/s per chip. Other sources disagree on the link
    # (392 GB/s unidirectional, 400 GB/s, 784 GB/s) and whether 0.7 TB/s is
    # per direction is not confirmed: treat the link figure as approximate.
    # One CloudMatrix384 supernode joins its 384 chips on the UB fabric (the paper's scale-up
    # domain), so 384 chips count as one node.
    "Ascend910C": GPUSpec(
        "Ascend 910C", 128 * GB, 3.2e12, 780e12, 0.7e12, "zuo2025cloudmatrix", gpus_per_node=384
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """Attention shape and weight size of one model (see the module docstring for MLA).

    More than eight parameters: a frozen record of a model's published shape, one field per
    ``config.json`` quantity the cost model reads, built once per model in :data:`MODELS`.
    """

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    use_mla: bool
    kv_lora_rank: int  #: 0 for GQA models
    qk_rope_head_dim: int  #: 0 for GQA models
    num_params: float
    weight_bytes_per_param: float
    source: str
    hidden_size: int = 0  #: width of the residual stream (input of GQA's ``q_proj``)
    q_lora_rank: int = 0  #: MLA: input width of ``q_b_proj``, the sharded query projection
    active_params: float = 0.0  #: MoE: parameters used per token (0: dense, all of them)
    expert_params: float = 0.0  #: MoE: parameters in routed experts (shardable by EP)
    #: sparse MLA (DeepSeek-V3.2's DSA): KV tokens each query attends; 0 for dense attention.
    #: vLLM tells sparse MLA by the ``index_topk`` field of ``config.json``.
    index_topk: int = 0
    #: vocabulary (embedding rows and LM-head columns); 0 if unknown (then no LM-head term)
    vocab_size: int = 0
    tie_word_embeddings: bool = False  #: LM head shares the embedding matrix
    #: width of the dense MLP (``intermediate_size``): what the activation kernel reads
    intermediate_size: int = 0
    num_experts: int = 0  #: MoE: routed experts per MoE layer
    num_experts_per_tok: int = 0  #: MoE: routed experts each token picks (top-k)
    moe_layers: int = 0  #: MoE: layers with routed experts
    #: ``max_position_embeddings`` of ``config.json``: the longest ``--max-model-len`` vLLM
    #: accepts without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` (its YaRN and ``llama3`` RoPE scalings
    #: are already folded in, ``_get_and_verify_max_len`` in ``vllm/config/model.py``); 0 if
    #: unknown
    max_position_embeddings: int = 0

    @property
    def lm_head_params(self) -> float:
        """Parameters of the LM head (``vocab_size x hidden_size``), tied or not."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def expert_size_params(self) -> float:
        """Parameters of one routed expert (gate, up, down), 0 for a dense model."""
        if not (self.expert_params and self.num_experts and self.moe_layers):
            return 0.0
        return self.expert_params / (self.num_experts * self.moe_layers)

    @property
    def attention_shape(self) -> dict[str, Any]:
        """What :meth:`~cpbook.core.config.ParallelConfig.for_model` reads."""
        return dict(
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            use_mla=self.use_mla,
        )

    @property
    def sparse_mla(self) -> bool:
        """Whether this is a sparse-MLA model (``index_topk`` set), the one kind whose attention
        vLLM v0.34 runs under PCP x DCP."""
        return self.use_mla and self.index_topk > 0

    @property
    def params_per_token(self) -> float:
        """Parameters one token multiplies through (``num_params`` for a dense model)."""
        return self.active_params or self.num_params


def _gqa(
    name: str,
    layers: int,
    q: int,
    kv: int,
    params: float,
    source: str,
    hidden: int = 0,
    vocab: int = 0,
    inter: int = 0,
    positions: int = 131072,
) -> ModelSpec:
    """A GQA model with 128-dim heads, bf16 weights and an untied LM head (``positions``: its
    ``max_position_embeddings``)."""
    return ModelSpec(
        name, layers, q, kv, 128, False, 0, 0, params, 2, source, hidden,
        vocab_size=vocab, intermediate_size=inter, max_position_embeddings=positions,
    )  # fmt: skip


def _mla(
    name: str,
    layers: int,
    q: int,
    params: float,
    source: str,
    active: float,
    moe: tuple[int, int],
    vocab: int,
    positions: int = 163840,
) -> ModelSpec:
    """A DeepSeek-V3-shaped MLA model with FP8 weights (hidden 7168, ``q_lora_rank`` 1536,
    dense MLP 18432 wide, experts 2048 wide, 8 per token); ``moe``: ``(MoE layers, routed
    experts)``."""
    # qk_nope 128 + rope 64 = 192; latent 512 + rope 64 = 576 stored per token.
    moe_layers, experts = moe
    return ModelSpec(
        name, layers, q, 1, 192, True, 512, 64, params, 1, source, 7168, 1536, active,
        _routed(moe_layers, experts, 7168, 2048), vocab_size=vocab, intermediate_size=18432,
        num_experts=experts, num_experts_per_tok=8, moe_layers=moe_layers,
        max_position_embeddings=positions,
    )  # fmt: skip


def _routed(moe_layers: int, experts: int, hidden: int, moe_intermediate: int) -> float:
    """Parameters of the routed experts: gate, up and down projections of every expert."""
    return float(moe_layers * experts * 3 * hidden * moe_intermediate)


MODELS: dict[str, ModelSpec] = {
    # Both MLA models ship FP8 weights (1 byte per parameter).
    # Active parameters per token: 37B (DeepSeek-V3), 32B (Kimi-K2), 22B (Qwen3-235B-A22B),
    # from the papers; routed experts from each config.json (layers after
    # ``first_k_dense_replace`` x ``n_routed_experts`` x 3 x hidden x ``moe_intermediate_size``);
    # ``vocab_size``, ``intermediate_size``, the expert counts and ``max_position_embeddings``
    # (DeepSeek-V3 163840, Kimi-K2-Instruct and Llama-3.1 131072, Qwen2.5-7B-Instruct-1M
    # 1010000, Qwen3-235B-A22B 40960) from the same config.json.
    "DeepSeek-V3": _mla(
        "DeepSeek-V3", 61, 128, 671e9, "hf_deepseek_v3,deepseekai2024v3", 37e9, (58, 256), 129280
    ),
    "Kimi-K2": _mla(
        "Kimi-K2",
        61,
        64,
        1.04e12,
        "hf_kimi_k2,kimiteam2025k2",
        32e9,
        (60, 384),
        163840,
        positions=131072,
    ),
    "Llama-3.1-8B": _gqa(
        "Llama-3.1-8B",
        32,
        32,
        8,
        8.03e9,
        "hf_llama31_8b,grattafiori2024llama3",
        4096,
        128256,
        14336,
    ),  # fmt: skip
    "Llama-3.1-70B": _gqa(
        "Llama-3.1-70B",
        80,
        64,
        8,
        70.6e9,
        "hf_llama31_70b,grattafiori2024llama3",
        8192,
        128256,
        28672,
    ),  # fmt: skip
    "Llama-3.1-405B": _gqa(
        "Llama-3.1-405B",
        126,
        128,
        8,
        405.9e9,
        "hf_llama31_405b,grattafiori2024llama3",
        16384,
        128256,
        53248,
    ),  # fmt: skip
    "Qwen2.5-7B-1M": _gqa(
        "Qwen2.5-7B-Instruct-1M",
        28,
        28,
        4,
        7.61e9,
        "hf_qwen25_7b_1m,yang2025qwen25_1m",
        3584,
        152064,
        18944,
        1010000,
    ),  # fmt: skip
    "Qwen3-235B-A22B": replace(
        _gqa(
            "Qwen3-235B-A22B",
            94,
            64,
            4,
            235e9,
            "hf_qwen3_235b,yang2025qwen3",
            4096,
            151936,
            positions=40960,
        ),
        active_params=22e9,
        expert_params=_routed(94, 128, 4096, 1536),
        num_experts=128,
        num_experts_per_tok=8,
        moe_layers=94,
    ),
}

#: bytes per cached element, GQA and dense MLA alike: vLLM's ``fp8`` / ``fp8_e4m3`` cache of a
#: dense MLA model (FlashMLA) stores the 512 + 64 latent in FP8 with one scale per tensor, 576 B
#: per token and layer for DeepSeek-V3 and Kimi-K2
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: vLLM's ``fp8_ds_mla`` KV layout of *sparse* MLA (DeepSeek-V3.2, FlashMLA-sparse): 512 fp8 latent
#: + 16 B scales + 64 bf16 rope; the ``kv_dtype`` of that name, for MLA models only
FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER = 512 + 16 + 64 * 2
#: every ``kv_dtype`` the memory model accepts
KV_DTYPES: tuple[str, ...] = (*KV_DTYPE_BYTES, "fp8_ds_mla")
#: placeholder for activations, CUDA graphs and comm buffers (vLLM profiles it)
DEFAULT_ACTIVATION_RESERVE_BYTES = 4 * GIB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


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


#: vLLM PR #24111's isolated all-reduce benchmark on 8 x H100 (CUDA graphs, bf16, a tensor of
#: shape (32, 8192), 0.5 MB): µs per call by group size.  ``pynccl`` is NCCL, the library DCP's
#: all-gathers and reduce-scatters go through; ``ca_1stage`` is vLLM's one-stage custom
#: all-reduce, which only all-reduces use.
ALLREDUCE_BENCH_US: dict[str, dict[int, float]] = {
    "pynccl": {4: 17.0, 6: 23.0, 8: 28.0},
    "ca_1stage": {4: 10.0, 6: 13.0},
}
ALLREDUCE_BENCH_BYTES = 32 * 8192 * 2  #: the benchmark's 0.5 MB bf16 tensor
ALLREDUCE_BENCH_SOURCE = "vllm_pr24111"

LINKS: dict[str, LinkSpec] = {
    # 900 GB/s bidirectional NVLink 4 per GPU = 450 GB/s per direction (datasheets).  α = 15 µs
    # per call is an assumption, the book's base case: at the low end of the NCCL latencies of
    # ALLREDUCE_BENCH_US once the ~2 µs of transfer is taken out (15 µs on 4 GPUs, 26 µs on the
    # 8 GPUs modelled); chapter 6 draws every result that depends on it against α.
    "NVLink4": LinkSpec(
        "NVLink 4 + NVSwitch (H100/H200 HGX), NCCL", 15e-6, 450e9, "nvidia_h200,vllm_pr24111"
    ),
    # Meta's CP runs (arXiv 2411.01783): H100 hosts joined by RDMA at 400 Gb/s per GPU, i.e.
    # 50 GB/s per direction.  α = 30 µs per call is an assumption (two NVLink α's: one hop
    # through the NIC), not a measurement.
    "RDMA400": LinkSpec("RDMA 400 Gb/s per GPU, between hosts", 30e-6, 50e9, "yang2024cp"),
}


def link_of(gpu: GPUSpec) -> LinkSpec:
    """The scale-up link of ``gpu``'s node: NVLink 4's α with the GPU's own bandwidth."""
    nv = LINKS["NVLink4"]
    return LinkSpec(f"scale-up link of {gpu.name}", nv.alpha_s, gpu.link_bw_bytes_per_s, gpu.source)


def get_model(name: str | ModelSpec) -> ModelSpec:
    """``MODELS[name]`` (a ``ModelSpec`` passes through); ValueError naming the known keys."""
    if isinstance(name, ModelSpec):
        return name
    if name not in MODELS:
        raise RuleError("known-model", f"a key of MODELS {sorted(MODELS)}", name=name)
    return MODELS[name]


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """``GPUS[name]`` (a ``GPUSpec`` passes through); ValueError naming the known keys."""
    if isinstance(name, GPUSpec):
        return name
    if name not in GPUS:
        raise RuleError("known-gpu", f"a key of GPUS {sorted(GPUS)}", name=name)
    return GPUS[name]


def check_tokens(name: str, tokens: object, minimum: int = 0, integer: bool = True) -> None:
    """Rules ``non-negative-tokens`` (``minimum=0``) and ``positive-tokens`` (``minimum=1``): a
    token count is an ``int`` (a ``bool`` is not; with ``integer=False`` a float too, for the
    linear decode terms that :func:`~cpbook.costmodel.decode.decode_break_even` solves) of at
    least ``minimum``."""
    kinds = numbers.Integral if integer else numbers.Real  # numpy scalars too
    if isinstance(tokens, bool) or not isinstance(tokens, kinds) or tokens < minimum:
        rule = "positive-tokens" if minimum else "non-negative-tokens"
        what = ("a positive " if minimum else "a non-negative ") + ("int" if integer else "number")
        raise RuleError(rule, what, **{name: tokens})


def check_moe_shape(model: ModelSpec) -> None:
    """Rule ``moe-shape``: a MoE model (``expert_params > 0``) states its routed experts, the
    experts per token and its MoE layers, which the GPU-side time model reads."""
    if model.expert_params and not (
        model.num_experts and model.num_experts_per_tok and model.moe_layers
    ):
        raise RuleError(
            "moe-shape",
            "num_experts, num_experts_per_tok and moe_layers for a MoE model",
            model=model.name,
            num_experts=model.num_experts,
            num_experts_per_tok=model.num_experts_per_tok,
            moe_layers=model.moe_layers,
        )


def check_hbm_efficiency(hbm_efficiency: float) -> None:
    """Rule ``hbm-efficiency``: the fraction of HBM bandwidth a kernel reaches is in (0, 1]."""
    if not 0 < hbm_efficiency <= 1:
        raise RuleError("hbm-efficiency", "0 < hbm_efficiency <= 1", hbm_efficiency=hbm_efficiency)
