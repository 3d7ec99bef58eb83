"""Tiny decoders for the mini engine: a Llama-style GQA model and a DeepSeek-style MLA model.

``tiny-gqa``: RMSNorm, RoPE, GQA attention (8 query heads, 2 KV heads), SwiGLU MLP.
``tiny-mla``: the same blocks with MLA attention (8 heads over one latent KV per token: ``kv_c``
of ``kv_lora_rank`` values, RMS-normed, plus a decoupled RoPE key ``k_pe`` shared by the heads).
Weights are drawn from a seed; a small vocabulary; greedy decoding is not degenerate.

Every projection is written once, on a *slice* of heads (or MLP columns), so the same code is
the single-device model (all heads) and one TP rank's share (its heads; the partial outputs are
summed by an all-reduce over TP).  :func:`reference_generate` is the single-device reference:
one float64 forward per token over a contiguous (not paged) KV cache, MLA in its MHA form.

RoPE convention: both models use :func:`cpbook.core.attention.rope`, the rotate-half form
(pairs ``(x[i], x[i + R/2])``, vLLM's ``is_neox_style=True``).  DeepSeek's MLA checkpoints use
the interleaved form, pairs ``(x[2i], x[2i + 1])`` of the ``qk_rope_head_dim`` part: vLLM builds
their rotary embedding with ``get_rope(..., is_neox_style=False)`` (``DeepseekV2MLAAttention`` in
``vllm/model_executor/models/deepseek_v2.py``, v0.34.0).  The two forms differ by one fixed
permutation of the rope dimensions (of the query and ``k_pe`` projections' rope columns), so
seeded weights are as valid either way; a real checkpoint needs the interleaved form or that
permutation applied to its weights, which is what :func:`cpbook.engine.hf.from_pretrained` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch

from cpbook.core.attention import dense_attention, rope
from cpbook.core.config import ConfigError
from cpbook.dcp.mla import MLAWeights
from cpbook.engine.gemm import PackedLinear

__all__ = [
    "ModelConfig",
    "ENGINE_MODELS",
    "get_engine_model",
    "TinyModel",
    "reference_forward",
    "reference_generate",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a tiny decoder (HF/vLLM names; the heads as cpbook names them everywhere:
    ``num_q_heads`` is HF's ``num_attention_heads``, ``num_kv_heads`` its
    ``num_key_value_heads``)."""

    name: str
    vocab_size: int = 96
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    use_mla: bool = False
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    o_proj_gain: float = 1.0  # larger: attention weighs more than the last token (less repetition)
    max_model_len: int | None = None  # positions a request may reach (None: no limit)

    @property
    def attention_shape(self) -> dict[str, Any]:
        """What :meth:`~cpbook.core.config.ParallelConfig.for_model` reads."""
        return dict(
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.qk_head_dim,
            use_mla=self.use_mla,
        )

    @property
    def qk_head_dim(self) -> int:
        """Width of one query head (MLA: ``nope + rope``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.use_mla else self.head_dim

    @property
    def out_head_dim(self) -> int:
        """Width of one head's attention output."""
        return self.v_head_dim if self.use_mla else self.head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per cached row: ``head_dim`` (K and V rows per KV head) or MLA's ``C + R``."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.use_mla else self.head_dim


ENGINE_MODELS: dict[str, ModelConfig] = {
    "tiny-gqa": ModelConfig("tiny-gqa", o_proj_gain=3.0),
    "tiny-mla": ModelConfig("tiny-mla", num_kv_heads=1, use_mla=True),
}


def get_engine_model(name: str) -> ModelConfig:
    """``ENGINE_MODELS[name]``; rule ``known-model`` names the known keys."""
    if name not in ENGINE_MODELS:
        raise ConfigError("known-model", f"model in {sorted(ENGINE_MODELS)}", model=name)
    return ENGINE_MODELS[name]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, w.shape, w, eps)


@dataclass
class TinyModel:
    """Weights of one tiny decoder.  ``layers[i]`` maps weight names to tensors.

    Shapes (``H`` hidden, ``n``/``k`` query/KV heads, ``D`` head dim, ``I`` MLP width):
    GQA ``wq [H, n, D]``, ``wk``/``wv [H, k, D]``; MLA ``wq [H, n, Dn+R]``, ``w_dkv [H, C]``,
    ``w_kr [H, R]`` and a :class:`~cpbook.dcp.mla.MLAWeights` (``W_UK``, ``W_UV``); both
    ``wo [n, Dv, H]``, ``w_gate``/``w_up [H, I]``, ``w_down [I, H]``.
    """

    config: ModelConfig
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    layers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    mla: list[MLAWeights] = field(default_factory=list)

    @classmethod
    def from_name(
        cls, name: str, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: object
    ) -> "TinyModel":
        """The model ``name`` (a key of :data:`ENGINE_MODELS`) with weights drawn from ``seed``."""
        cfg = replace(get_engine_model(name), **overrides)
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
            x = torch.randn(*shape, generator=gen, dtype=torch.float64) * gain / math.sqrt(fan_in)
            return x.to(dtype)

        H, n, k = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads
        layers, mlas = [], []
        for _ in range(cfg.num_hidden_layers):
            lw = {"attn_norm": torch.ones(H, dtype=dtype), "mlp_norm": torch.ones(H, dtype=dtype)}
            if cfg.use_mla:
                lw.update(
                    wq=w(H, n, cfg.qk_head_dim, fan_in=H),
                    w_dkv=w(H, cfg.kv_lora_rank, fan_in=H),
                    w_kr=w(H, cfg.qk_rope_head_dim, fan_in=H),
                    kv_norm=torch.ones(cfg.kv_lora_rank, dtype=dtype),
                )
                m = MLAWeights.random(
                    n,
                    cfg.kv_lora_rank,
                    cfg.qk_nope_head_dim,
                    cfg.qk_rope_head_dim,
                    cfg.v_head_dim,
                    int(torch.randint(1 << 30, (1,), generator=gen)),
                    dtype,
                )
                mlas.append(m)
            else:
                lw.update(
                    wq=w(H, n, cfg.head_dim, fan_in=H),
                    wk=w(H, k, cfg.head_dim, fan_in=H),
                    wv=w(H, k, cfg.head_dim, fan_in=H),
                )
            lw.update(
                wo=w(n, cfg.out_head_dim, H, fan_in=n * cfg.out_head_dim, gain=cfg.o_proj_gain),
                w_gate=w(H, cfg.intermediate_size, fan_in=H),
                w_up=w(H, cfg.intermediate_size, fan_in=H),
                w_down=w(cfg.intermediate_size, H, fan_in=cfg.intermediate_size),
            )
            layers.append(lw)
        embed = w(cfg.vocab_size, H, fan_in=1)
        lm_head = w(H, cfg.vocab_size, fan_in=H, gain=4.0)
        return cls(cfg, embed, lm_head, torch.ones(H, dtype=dtype), layers, mlas)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, device: torch.device | str) -> "TinyModel":
        """The same weights on ``device`` (``self`` if they are there already), of the same
        class: every field but ``config`` is moved (tensors, per-layer dicts, MLA blocks)."""
        if self.embed.device == torch.device(device):
            return self

        def moved(v):
            if isinstance(v, dict):
                return {k: moved(x) for k, x in v.items()}
            return [moved(x) for x in v] if isinstance(v, list) else v.to(device)

        return replace(
            self,
            **{f.name: moved(getattr(self, f.name)) for f in fields(self) if f.name != "config"},
        )

    # -- packed weights: built once per (layer, slice), reused by every step -------------
    def packed(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per ``key`` for this object (weights packed for one
        matmul; not a dataclass field, so :meth:`to` and ``replace`` start afresh)."""
        cache = self.__dict__.setdefault("_packed", {})
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def packed_qkv(
        self, layer: int, h: torch.Tensor, heads: slice, kv_heads: slice
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """GQA's projections of ``heads``/``kv_heads`` (biases included) in one matmul of the
        packed ``[H, (h + 2k) D]`` weight, no RoPE: the query and key heads side by side
        ``qk [T, h + k, D]`` (a view), the values ``v [T, k, D]`` and ``h``."""
        lw = self.layers[layer]

        def build() -> tuple[PackedLinear, int, int]:
            parts = [lw["wq"][:, heads], lw["wk"][:, kv_heads], lw["wv"][:, kv_heads]]
            w = torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)
            b = None
            if "bq" in lw:
                b = torch.cat([x.reshape(-1) for x in (lw["bq"][heads], lw["bk"][kv_heads])])
                b = torch.cat([b, lw["bv"][kv_heads].reshape(-1)])
            return PackedLinear(w, b), parts[0].shape[1], parts[1].shape[1]

        key = ("qkv", layer, heads.start, heads.stop, kv_heads.start, kv_heads.stop)
        proj, nq, nk = self.packed(key, build)
        out = proj(h)
        qk, v = out.view(h.shape[0], nq + 2 * nk, -1).split([nq + nk, nk], dim=1)
        return qk, v, nq

    # -- the blocks, on a slice of heads / MLP columns ------------------------------------
    def attn_input(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm before attention: ``[T, H] -> [T, H]``."""
        return _rms(x, self.layers[layer]["attn_norm"], self.config.rms_norm_eps)

    def qkv(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor, heads: slice, kv_heads: slice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Projections of the normed rows ``h [T, H]`` at ``positions [T]``, RoPE applied.

        GQA: ``q [T, h, D]``, ``k``/``v [T, k, D]`` for ``heads``/``kv_heads``.  MLA: the
        absorbed latent query ``q [T, h, C+R]`` (``[q_nope W_UK, q_pe]``), the cache row
        ``k [T, 1, C+R]`` (``[norm(kv_c), rope(k_pe)]``) and ``v = None``.
        """
        cfg = self.config
        if not cfg.use_mla:
            qk, v, nq = self.packed_qkv(layer, h, heads, kv_heads)
            q, k = rope(qk, positions, cfg.rope_theta).split([nq, qk.shape[1] - nq], dim=1)
            return q, k, v
        q, latent = self.mla_q_and_latent(layer, h, positions, heads)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return self.mla[layer].absorb_q(q_nope, q_pe, heads), latent[:, None], None

    def mla_q_and_latent(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor, heads: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's MHA-form query ``[q_nope, rope(q_pe)]`` (``[T, h, Dn+R]``) and cache row
        ``[norm(kv_c), rope(k_pe)]`` (``[T, C+R]``)."""
        lw, cfg = self.layers[layer], self.config
        q = torch.einsum("th,hnd->tnd", h, lw["wq"][:, heads])
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv_c = _rms(h @ lw["w_dkv"], lw["kv_norm"], cfg.rms_norm_eps)
        k_pe = rope((h @ lw["w_kr"])[:, None], positions, cfg.rope_theta)[:, 0]
        return (
            torch.cat([q_nope, rope(q_pe, positions, cfg.rope_theta)], dim=-1),
            torch.cat([kv_c, k_pe], dim=-1),
        )

    def attn_scale(self, layer: int) -> float | None:
        """Softmax scale (``None``: ``1/sqrt(head_dim)``; MLA: the MHA form's scale)."""
        return self.mla[layer].scale if self.config.use_mla else None

    def o_proj(self, layer: int, attn: torch.Tensor, heads: slice) -> torch.Tensor:
        """``attn [T, h, ·] -> [T, H]``: this slice's part of the output projection (MLA: the
        latent output goes through ``W_UV`` first).  Summing over all head slices is exact."""
        if self.config.use_mla:
            attn = self.mla[layer].v_up_proj(attn, heads)
        wo = self.layers[layer]["wo"]
        key = ("wo", layer, heads.start, heads.stop)
        proj = self.packed(key, lambda: PackedLinear(wo[heads].flatten(0, 1)))
        return proj(attn.reshape(attn.shape[0], -1))

    def mlp_shard(self, tp_rank: int, tp: int) -> slice:
        """The MLP columns TP rank ``tp_rank`` of ``tp`` computes (what :meth:`mlp` takes)."""
        inter = self.config.intermediate_size
        return slice(tp_rank * inter // tp, (tp_rank + 1) * inter // tp)

    def mlp(self, layer: int, x: torch.Tensor, cols: slice) -> torch.Tensor:
        """RMSNorm then SwiGLU on MLP columns ``cols`` (``[T, H] -> [T, H]``, a partial sum)."""
        lw = self.layers[layer]
        h = _rms(x, lw["mlp_norm"], self.config.rms_norm_eps)
        g = torch.nn.functional.silu(h @ lw["w_gate"][:, cols]) * (h @ lw["w_up"][:, cols])
        return g @ lw["w_down"][cols]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and LM head: ``[T, H] -> [T, vocab_size]``."""
        head = self.packed(("lm_head",), lambda: PackedLinear(self.lm_head))
        return head(_rms(x, self.final_norm, self.config.rms_norm_eps))


def reference_forward(
    model: TinyModel, token_ids: list[int], start: int, cache: list[list[torch.Tensor]]
) -> torch.Tensor:
    """One single-device forward of ``token_ids`` at positions ``start, start+1, ...`` over a
    contiguous KV cache (``cache[layer]``: ``[K, V]`` or MLA's ``[latent]``, ``start`` rows
    long, extended in place).  Causal; MLA in its MHA form.  Returns logits ``[T, vocab]``."""
    cfg = model.config
    every = slice(None)
    pos = torch.arange(start, start + len(token_ids), device=model.device)
    x = model.embed[torch.tensor(token_ids, device=model.device)]
    for layer in range(cfg.num_hidden_layers):
        h = model.attn_input(layer, x)
        if cfg.use_mla:
            q, lat = model.mla_q_and_latent(layer, h, pos)
            cache[layer] = [torch.cat(cache[layer] + [lat])]
            kk, vv = model.mla[layer].expand_kv(cache[layer][0], every)
            a = dense_attention(
                q, kk, vv, causal=True, q_offset=start, scale=model.attn_scale(layer)
            )[0]
            x = x + torch.einsum("tnd,ndh->th", a, model.layers[layer]["wo"])
        else:
            q, k, v = model.qkv(layer, h, pos, every, every)
            if cache[layer]:
                k, v = torch.cat([cache[layer][0], k]), torch.cat([cache[layer][1], v])
            cache[layer] = [k, v]
            a = dense_attention(q, k, v, causal=True, q_offset=start)[0]
            x = x + model.o_proj(layer, a, every)
        x = x + model.mlp(layer, x, every)
    return model.logits(x)


def reference_generate(
    model: TinyModel, prompt: list[int], max_new_tokens: int, return_logits: bool = False
):
    """Greedy tokens of ``prompt`` on one device: a full prefill, then one token per forward
    (:func:`reference_forward`, contiguous KV cache, no paging or batching), in the model's
    dtype.  Returns the ``max_new_tokens`` new tokens, and with ``return_logits`` also the
    logits row ``[vocab]`` each was picked from."""
    cache: list[list[torch.Tensor]] = [[] for _ in range(model.config.num_hidden_layers)]
    tokens, out, rows = list(prompt), [], []
    step, start = list(prompt), 0
    while len(out) < max_new_tokens:
        logits = reference_forward(model, step, start, cache)[-1]
        out.append(int(logits.argmax()))
        rows.append(logits)
        start = len(tokens)
        tokens.append(out[-1])
        step = [out[-1]]
    return (out, torch.stack(rows)) if return_logits else out
