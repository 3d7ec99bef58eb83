"""Hugging Face decoder blocks for the mini engine: what :mod:`cpbook.engine.hf` loads into.

:class:`HFModel` is a :class:`~cpbook.engine.models.TinyModel` with the pieces real checkpoints
need, written (like the tiny models) on a slice of heads or MLP columns so one code path is
both the single-device model and one TP rank's share:

* RoPE from a checkpoint's inverse frequencies (``default``, Llama-3 ``llama3``, ``yarn``) and
  its cos/sin ``attention_factor``; rotate-half layout.  DeepSeek's interleaved pairs are turned
  into that layout at load time by permuting the rope columns of the query and ``k_pe``
  projections (scores are unchanged by one permutation applied to both sides).
* QKV / output biases (Qwen2, Llama ``attention_bias``), per-head q/k RMSNorm (Qwen3).
* MLA with or without q-LoRA (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) and a softmax scale set
  by the config (YaRN's ``mscale**2 / sqrt(qk_head_dim)``).
* MoE layers (from ``first_k_dense_replace`` on): a replicated router (DeepSeek-V2 softmax
  ``greedy`` / ``group_limited_greedy``, V3 sigmoid ``noaux_tc`` with ``e_score_correction_bias``),
  routed and shared experts whose intermediate columns are split over TP, as vLLM's ``FusedMoE``
  does without expert parallelism (``vllm/model_executor/layers/fused_moe/layer.py``, v0.34.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpbook.core.config import ConfigError
from cpbook.engine.gemm import PackedLinear
from cpbook.engine.models import ModelConfig, TinyModel, _rms

__all__ = ["HFConfig", "HFModel", "rope_rotate", "rope_tables"]


@dataclass(frozen=True)
class HFConfig(ModelConfig):
    """A :class:`ModelConfig` plus what a Hugging Face checkpoint adds (HF field names)."""

    model_type: str = "llama"
    rope_attention_factor: float = 1.0  # cos/sin multiplier (YaRN's attention_factor)
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    q_lora_rank: int | None = None
    softmax_scale: float | None = None  # None: 1/sqrt(qk_head_dim)
    n_routed_experts: int = 0  # 0: every layer is dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    topk_method: str = "greedy"  # greedy | group_limited_greedy (softmax), noaux_tc (sigmoid)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def is_moe(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and the signed ``sin`` (``[-sin, sin]`` over the two halves) ``[T, 1, R]`` of
    :func:`rope_rotate` (scaled by ``factor``)."""
    ang = positions.to(inv_freq.dtype)[:, None] * inv_freq[None]
    sin = ang.sin()
    return (
        (torch.cat([ang, ang], dim=-1)[:, None].cos() * factor).to(dtype),
        (torch.cat([-sin, sin], dim=-1)[:, None] * factor).to(dtype),
    )


def rope_rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    factor: float = 1.0,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, h, R]`` at ``positions [T]`` with ``inv_freq [R/2]``; cos and
    sin scaled by ``factor`` (HF's ``attention_scaling``); ``tables``: :func:`rope_tables` of
    the same arguments, computed once for several calls.  ``rotate_half(x) * sin`` is the
    halves swapped (one ``roll``) times the signed sin."""
    cos, sin = tables or rope_tables(positions, inv_freq, factor, x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


@dataclass
class HFModel(TinyModel):
    """Weights of a loaded checkpoint.  Beyond :class:`TinyModel`'s names, ``layers[i]`` may
    hold ``bq``/``bk``/``bv [n|k, D]``, ``bo [H]``, ``q_norm``/``k_norm [D]``, MLA's ``wq_a [H,
    Q]`` + ``q_a_norm [Q]`` (then ``wq [Q, n, Dn+R]``), and MoE's ``router [H, E]``,
    ``e_bias [E]``, ``e_gate``/``e_up [E, H, I]``, ``e_down [E, I, H]``, ``s_gate``/``s_up``/
    ``s_down`` (shared experts)."""

    inv_freq: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE; the cos/sin tables of one ``positions`` tensor are built once (a step's
        every layer passes the same tensor) and reused."""
        memo = self.__dict__.get("_rope_memo")
        if memo is None or memo[0] is not positions or memo[1] != x.dtype:
            f = self.config.rope_attention_factor
            memo = (positions, x.dtype, rope_tables(positions, self.inv_freq, f, x.dtype))
            self.__dict__["_rope_memo"] = memo
        return rope_rotate(x, positions, self.inv_freq, tables=memo[2])

    def qkv(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor, heads: slice, kv_heads: slice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lw, cfg = self.layers[layer], self.config
        if cfg.use_mla:
            q, latent = self.mla_q_and_latent(layer, h, positions, heads)
            q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
            return self.mla[layer].absorb_q(q_nope, q_pe, heads), latent[:, None], None
        qk, v, nq = self.packed_qkv(layer, h, heads, kv_heads)
        if cfg.qk_norm:  # per-head RMSNorm: q_norm's weight on query heads, k_norm's on keys
            nk = qk.shape[1] - nq
            w = self.packed(
                ("qk_norm", layer, nq, nk),
                lambda: torch.cat([lw["q_norm"].expand(nq, -1), lw["k_norm"].expand(nk, -1)]),
            )
            qk = torch.nn.functional.rms_norm(qk, w.shape[-1:], None, cfg.rms_norm_eps).mul_(w)
        q, k = self._rope(qk, positions).split([nq, qk.shape[1] - nq], dim=1)  # one RoPE
        return q, k, v

    def mla_q_and_latent(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor, heads: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lw, cfg = self.layers[layer], self.config
        hq = _rms(h @ lw["wq_a"], lw["q_a_norm"], cfg.rms_norm_eps) if cfg.q_lora_rank else h
        q = torch.einsum("th,hnd->tnd", hq, lw["wq"][:, heads])
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv_c = _rms(h @ lw["w_dkv"], lw["kv_norm"], cfg.rms_norm_eps)
        k_pe = self._rope((h @ lw["w_kr"])[:, None], positions)[:, 0]
        return (
            torch.cat([q_nope, self._rope(q_pe, positions)], dim=-1),
            torch.cat([kv_c, k_pe], dim=-1),
        )

    def attn_scale(self, layer: int) -> float | None:
        return self.config.softmax_scale

    def o_proj(self, layer: int, attn: torch.Tensor, heads: slice) -> torch.Tensor:
        out = super().o_proj(layer, attn, heads)
        bo = self.layers[layer].get("bo")
        # the bias once over the TP sum: on the rank that holds head 0
        return out + bo if bo is not None and heads.start in (None, 0) else out

    def mlp_shard(self, tp_rank: int, tp: int) -> tuple[int, int]:
        """This TP rank's share of every MLP (dense, routed and shared experts): ``(rank, tp)``.
        Rule ``mlp-divisible-by-tp``: every intermediate size divides by ``tp``."""
        c = self.config
        sizes = dict(intermediate_size=c.intermediate_size)
        if c.n_routed_experts:
            sizes["moe_intermediate_size"] = c.moe_intermediate_size
        for name, size in sizes.items():
            if size % tp:
                raise ConfigError("mlp-divisible-by-tp", f"{name} % tp == 0", **{name: size}, tp=tp)
        return tp_rank, tp

    def mlp(self, layer: int, x: torch.Tensor, cols: tuple[int, int] | slice) -> torch.Tensor:
        lw, cfg = self.layers[layer], self.config
        rank, tp = (0, 1) if isinstance(cols, slice) else cols
        h = _rms(x, lw["mlp_norm"], cfg.rms_norm_eps)
        if not cfg.is_moe(layer):
            key = ("gate_up", layer, rank, tp)
            gate_up = self.packed(key, lambda: PackedLinear(_gate_up(lw, rank, tp)))
            g, u = gate_up(h).chunk(2, dim=-1)
            n = lw["w_down"].shape[0] // tp
            key = ("down", layer, rank, tp)
            down = self.packed(key, lambda: PackedLinear(lw["w_down"][rank * n : (rank + 1) * n]))
            g = torch.nn.functional.silu(g, inplace=True).mul_(u)  # in the matmul's output
            return down(g)
        weights = self._route(layer, h)  # [T, E], zero off the top-k
        out = _swiglu(h, lw["s_gate"], lw["s_up"], lw["s_down"], rank, tp) if "s_gate" in lw else 0
        routed = torch.zeros_like(h)
        for e in torch.nonzero(weights.any(0)).flatten().tolist():
            rows = torch.nonzero(weights[:, e]).flatten()
            y = _swiglu(h[rows], lw["e_gate"][e], lw["e_up"][e], lw["e_down"][e], rank, tp)
            routed.index_add_(0, rows, y * weights[rows, e, None])
        return routed + out

    def _route(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Routing weights ``[T, E]`` (zero outside each token's top-k), as the checkpoint's
        router defines them (HF ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``)."""
        lw, c = self.layers[layer], self.config
        logits = h @ lw["router"]
        E, k, g = c.n_routed_experts, c.num_experts_per_tok, c.n_group
        if c.topk_method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + lw["e_bias"]
            group = choice.view(-1, g, E // g).topk(2, dim=-1)[0].sum(-1)
        else:
            scores = choice = logits.softmax(dim=-1)
            group = scores.view(-1, g, E // g).amax(-1)
        if c.topk_method != "greedy":
            keep = torch.zeros_like(group).scatter_(1, group.topk(c.topk_group, dim=-1)[1], 1.0)
            keep = keep.bool()[:, :, None].expand(-1, g, E // g).reshape(-1, E)
            fill = float("-inf") if c.topk_method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~keep, fill)
        idx = choice.topk(k, dim=-1)[1]
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return torch.zeros_like(scores).scatter_(1, idx, w * c.routed_scaling_factor)


def _gate_up(lw: dict[str, torch.Tensor], rank: int, tp: int) -> torch.Tensor:
    """This rank's gate and up columns side by side ``[H, 2 * I / tp]``."""
    n = lw["w_gate"].shape[1] // tp
    cols = slice(rank * n, (rank + 1) * n)
    return torch.cat([lw["w_gate"][:, cols], lw["w_up"][:, cols]], dim=1)


def _swiglu(
    h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, rank: int, tp: int
) -> torch.Tensor:
    """SwiGLU on this rank's ``1/tp`` of the intermediate columns (a partial sum over TP)."""
    n = gate.shape[1] // tp
    cols = slice(rank * n, (rank + 1) * n)
    return (torch.nn.functional.silu(h @ gate[:, cols]) * (h @ up[:, cols])) @ down[cols]
