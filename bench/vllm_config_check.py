"""Run one ``vllm serve`` line through vLLM's own argument parser and config classes, on a CPU.

    from vllm_config_check import check_line
    ok, message = check_line(line, config_json)   # message: vLLM's own words when not ok

The one place cpbook imports vLLM (a downloaded release, :mod:`vllm_wheel`; never installed):
:func:`load` puts the release's source first on ``sys.path`` and stands in for the two things
a CPU lacks, all outside the rules checked:

* the CUDA extensions: ``vllm.vllm_flash_attn`` (FlashAttention 3, imported by the FP8
  quantisation configs) is a module whose kernels raise if called, and the compiled
  ``cutlass_scaled_mm_supports_*`` queries of ``vllm._custom_ops`` answer for SM90;
* the CUDA platform: vLLM's own ``NonNvmlCudaPlatform`` (``vllm/platforms/cuda.py``) with the
  device queries answered for an SM90 node (capability 9.0, ``gpus_per_node`` devices), and its
  compiled op library ``vllm._C_stable_libtorch`` replaced by an empty module;
* the model-class inspection (it imports CUDA kernels): ``_LazyRegisteredModel.
  inspect_model_cls`` returns the ``_ModelInfo`` of a plain decoder-only text generator (what
  ``_ModelInfo.from_model_cls`` gives the DeepSeek, Kimi, Llama and Qwen classes).

:func:`run_line` (and :func:`check_line`, its verdict as text) then does what ``vllm serve``
does before it touches a GPU, each step vLLM's own code: ``vllm serve``'s own parser
(``make_arg_parser``, ``vllm/entrypoints/common/cli_args.py``) parses the arguments (an unknown
flag or a bad choice fails here), the ``NAME=VALUE`` prefix sets the
environment (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``), and ``EngineArgs.create_engine_config``
builds ``VllmConfig``: ``ModelConfig`` (``_get_and_verify_max_len``, the EP check),
``ParallelConfig`` (the TP / PCP / DCP sizes, ``--nnodes``), ``CacheConfig``,
``verify_with_parallel_config`` and the models' ``verify_and_update_config`` hooks.  Then
``PCPManager.validate_config`` (``vllm/v1/worker/gpu/pcp_manager.py``), the engine core's
``VllmConfig.validate_block_size`` (the interleave against the block size) and, with DCP or
PCP, the worker's ``check_attention_cp_compatibility`` (``vllm/v1/worker/cp_utils.py``: PCP
support, the LSE and the speculative-decoding interleave rule) on a stand-in attention layer
whose backend vLLM's own selector picks (:func:`_attention_layer_stand_in`).  The attention
backend's start-up checks run in ``FlashMLASparseMetadataBuilder.__init__``, which allocates CUDA
tensors, so for sparse MLA with DCP :func:`flashmla_sparse_check` restates its three
``NotImplementedError`` conditions literally (``vllm/v1/attention/backends/mla/
flashmla_sparse.py``, v0.34.0) over the built ``VllmConfig`` (``cache_dtype``,
``get_num_attention_heads``, the sizes) and returns its message.

A bench helper (it needs the wheel and a few light packages, see ``vllm_accepts.py``); a later
chapter that shows vLLM's own rule messages can call :func:`check_line` too.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shlex
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_wheel import ANCHOR_RELEASE, source_dir  # noqa: E402

_LOADED: dict[str, object] = {}


def load(version: str = ANCHOR_RELEASE, gpus_per_node: int = 8) -> dict[str, object]:
    """Import vLLM ``version``'s config modules with the CPU stand-ins above; returns the
    names :func:`check_line` uses (once per process)."""
    if _LOADED:
        return _LOADED
    root = str(source_dir(version))
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "CRITICAL")
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    fa = sys.modules.setdefault("vllm.vllm_flash_attn", _flash_attn_stand_in())
    sys.modules.setdefault("vllm.vllm_flash_attn.flash_attn_interface", fa)
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class SM90Node(NonNvmlCudaPlatform):
        """vLLM's CUDA platform, its device queries answered for one SM90 node."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def device_count(cls) -> int:
            return gpus_per_node

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 * 10**9

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

    platforms.current_platform = SM90Node()
    import vllm._custom_ops as ops

    for name in dir(ops):  # the compiled capability queries the FP8 configs ask (SM90: yes)
        if name.startswith("cutlass_scaled_mm_supports"):
            setattr(ops, name, lambda capability: capability >= 90)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.model_executor.models import registry
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.worker.cp_utils import check_attention_cp_compatibility
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    def decoder_info(self: object) -> object:
        return registry._ModelInfo(
            architecture=getattr(self, "class_name", "decoder"),
            is_text_generation_model=True,
            is_pooling_model=False,
            attn_type="decoder",
            default_seq_pooling_type="LAST",
            default_tok_pooling_type="ALL",
            score_type="bi-encoder",
            supports_multimodal=False,
            supports_multimodal_raw_input_only=False,
            requires_raw_input_tokens=False,
            supports_multimodal_encoder_tp_data=False,
            supports_pp=True,
            supports_lora=True,
            supports_hc_sp=False,
            has_inner_state=False,
            is_attention_free=False,
            is_hybrid=False,
            has_noops=False,
            supports_replayssm=False,
            supports_transcription=False,
            supports_transcription_only=False,
            supports_kv_cache_grouping=False,
            supported_video_pruning_methods=(),
            supports_mm_device_do_normalize=False,
            speculator_config_class=None,
            may_use_target_embed=False,
        )

    registry._LazyRegisteredModel.inspect_model_cls = decoder_info
    parser = make_arg_parser(FlexibleArgumentParser(exit_on_error=False))
    logging.getLogger("vllm").setLevel(logging.ERROR)
    _LOADED.update(EngineArgs=AsyncEngineArgs, parser=parser, PCPManager=PCPManager)
    _LOADED.update(version=version, check_attention_cp=check_attention_cp_compatibility)
    return _LOADED


def vllm_version() -> str:
    """The vLLM release :func:`load` imported."""
    return str(load()["version"])


def _flash_attn_stand_in() -> types.ModuleType:
    """``vllm.vllm_flash_attn`` (and its ``flash_attn_interface``, the same module here)
    without its CUDA extensions: FA3 reported supported (as on SM90), every kernel entry point
    raising if called (no rule calls one)."""
    fa = types.ModuleType("vllm.vllm_flash_attn")

    def kernel(*args: object, **kwargs: object) -> None:
        raise RuntimeError("flash-attention kernel called on the CPU stand-in")

    fa.flash_attn_varlen_func = fa.get_scheduler_metadata = kernel
    fa.compile_flash_attn_varlen_func_from_specs = kernel
    fa.is_fa_version_supported = lambda version, device=None: version == 3
    fa.fa_version_unsupported_reason = lambda version, device=None: (
        None if version == 3 else f"FA{version} not on SM90"
    )
    fa.FA2_AVAILABLE, fa.FA3_AVAILABLE = False, True
    return fa


def model_folder(config_json: dict, cache: dict[str, str] = {}) -> str:  # noqa: B006
    """A folder holding ``config_json`` as its ``config.json`` (one per distinct config)."""
    key = json.dumps(config_json, sort_keys=True)
    if key not in cache:
        folder = tempfile.mkdtemp(prefix="cpbook_vllm_model_")
        (Path(folder) / "config.json").write_text(key)
        cache[key] = folder
    return cache[key]


def split_line(line: str) -> tuple[dict[str, str], list[str]]:
    """``(environment, arguments after the model)`` of
    ``[NAME=VALUE ...] vllm serve MODEL ARGS``."""
    argv = shlex.split(line)
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    if argv[:2] != ["vllm", "serve"]:
        raise ValueError(f"not a vllm serve line: {line!r}")
    return env, argv[3:]


FP8_CACHES = ("fp8_ds_mla", "nvfp4_ds_mla")


def flashmla_sparse_check(vllm_config: object) -> str | None:
    """The ``NotImplementedError`` message ``FlashMLASparseMetadataBuilder.__init__`` (v0.34.0)
    raises for this config, or ``None``: restated literally, since the builder needs a GPU."""
    par, cache, model = vllm_config.parallel_config, vllm_config.cache_config, None
    model = vllm_config.model_config
    heads = model.get_num_attention_heads(par)
    pcp, dcp, tp = (
        par.prefill_context_parallel_size,
        par.decode_context_parallel_size,
        par.tensor_parallel_size,
    )
    pcp_dcp_kv_gather = pcp > 1 and dcp > 1
    use_hisparse = vllm_config.attention_config.hisparse_config is not None
    fp8_use_mixed_batch = heads < 32 and not use_hisparse and not pcp_dcp_kv_gather
    if pcp_dcp_kv_gather and cache.cache_dtype != "fp8_ds_mla":
        return (
            "PCP+DCP sparse prefill gathers the KV through the fp8_ds_mla "
            f"upconvert; got a {cache.cache_dtype} cache"
        )
    if dcp > 1 and cache.cache_dtype in FP8_CACHES:
        if not fp8_use_mixed_batch and not pcp_dcp_kv_gather:
            return (
                "DCP for FlashMLA sparse is only supported on the mixed-batch fp8 path "
                "(num_heads < 32); the separate prefill/decode path returns the LSE for "
                "decode tokens only, while the DCP merge needs it for every token"
            )
        if pcp > 1:
            gathered = heads * tp if dcp > pcp else heads
        else:
            gathered = heads * dcp

        def pad(h: int) -> int:
            return 64 if h <= 64 else 128

        if pad(heads) != pad(gathered):
            return (
                "DCP for FlashMLA sparse requires the local and DCP-gathered head counts to "
                f"pad to the same fp8 decode kernel envelope; got {heads} local heads (pad to "
                f"{pad(heads)}) vs {gathered} gathered heads (pad to {pad(gathered)})"
            )
    return None


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _attention_layer_stand_in(vllm_config: object) -> object:
    """One decoder attention layer as ``check_attention_cp_compatibility`` reads it: an
    ``Attention`` (GQA) or ``MLAAttention`` whose backend is the one vLLM's own selector
    (``get_attn_backend``, ``vllm/v1/attention/selector.py``) picks for the config on the SM90
    stand-in, and whose ``impl`` is a bare instance of that backend's implementation class:
    its class attributes vLLM's own, ``dcp_world_size`` and ``need_to_return_lse_for_decode``
    set as ``AttentionImplBase.__new__`` sets them (it needs the process groups).  On a CPU the
    selector passes over FlashMLA (its compiled-kernel probe, ``vllm._flashmla_C``, fails);
    FlashAttention-MLA, SM90's first choice, and Triton-MLA declare the same two attributes the
    check reads."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.selector import get_attn_backend

    model, par = vllm_config.model_config, vllm_config.parallel_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(
            model.get_head_size(),
            model.dtype,
            vllm_config.cache_config.cache_dtype,
            use_mla=model.use_mla,
            use_sparse=hasattr(model.hf_text_config, "index_topk"),
            num_heads=model.get_num_attention_heads(par),
        )
    impl = object.__new__(backend.get_impl_cls())
    impl.dcp_world_size = par.decode_context_parallel_size
    impl.need_to_return_lse_for_decode = impl.dcp_world_size > 1 and impl.can_return_lse_for_decode
    layer = object.__new__(MLAAttention if model.use_mla else Attention)
    object.__setattr__(layer, "impl", impl)
    object.__setattr__(layer, "get_attn_backend", lambda: backend)
    return layer


def run_line(line: str, config_json: dict) -> tuple[object | None, str, BaseException | None]:
    """``(VllmConfig, stage, exception)``: what vLLM's own code makes of the ``vllm serve``
    ``line`` for a model whose ``config.json`` is ``config_json``, stage by stage: ``parse``
    (``vllm serve``'s parser, ``make_arg_parser``), ``config`` (``create_engine_config``, with
    ``headless`` as the line says), ``pcp`` (``PCPManager.validate_config``), ``engine``
    (``VllmConfig.validate_block_size``, which the engine core calls once the backend's block
    size is known: the line's ``--block-size``, else ``CacheConfig.DEFAULT_BLOCK_SIZE``, 64,
    which FlashMLA and FlashAttention both run, so ``update_block_size_for_backend``, which
    needs the backend classes, would keep it) and, with DCP or PCP, ``worker``
    (``check_attention_cp_compatibility``,
    ``vllm/v1/worker/cp_utils.py``, on :func:`_attention_layer_stand_in`).  The exception is
    ``None`` when vLLM accepts the line (then the stage is ``"accepted"``)."""
    names = load()
    env, args = split_line(line)
    argv = ["--model", model_folder(config_json), "--skip-tokenizer-init", *args]
    err = io.StringIO()
    with _environment(env), contextlib.redirect_stderr(err):
        try:
            ns = names["parser"].parse_args(argv)
        except (SystemExit, Exception) as e:  # argparse's error paths
            said = [s for s in err.getvalue().splitlines() if s.strip()]
            return None, "parse", ValueError(said[-1] if said else str(e))
        try:
            engine_args = names["EngineArgs"].from_cli_args(ns)
            vllm_config = engine_args.create_engine_config(headless=bool(ns.headless))
        except Exception as e:  # vLLM's ValueError, pydantic's ValidationError, asserts
            return None, "config", e
        try:
            names["PCPManager"].validate_config(vllm_config, supports_mm_inputs=False)
        except Exception as e:
            return vllm_config, "pcp", e
    model = vllm_config.model_config
    try:
        vllm_config.validate_block_size()
    except AssertionError as e:
        return vllm_config, "engine", e
    par = vllm_config.parallel_config
    if par.decode_context_parallel_size * par.prefill_context_parallel_size > 1:
        context = vllm_config.compilation_config.static_forward_context
        context["model.layers.0.self_attn.attn"] = _attention_layer_stand_in(vllm_config)
        try:
            names["check_attention_cp"](vllm_config)
        except (AssertionError, ValueError) as e:  # ValueError: no backend for the config
            return vllm_config, "worker", e
        finally:
            context.pop("model.layers.0.self_attn.attn")
    hf = model.hf_text_config
    if hasattr(hf, "index_topk") and vllm_config.parallel_config.decode_context_parallel_size > 1:
        message = flashmla_sparse_check(vllm_config)
        if message:
            return vllm_config, "attention", NotImplementedError(message)
    return vllm_config, "accepted", None


def check_line(line: str, config_json: dict) -> tuple[bool, str]:
    """``(True, "")`` if vLLM accepts the ``vllm serve`` ``line`` for a model whose
    ``config.json`` is ``config_json``, else ``(False, vLLM's message)``, naming the stage
    (:func:`run_line`)."""
    _, stage, e = run_line(line, config_json)
    if e is None:
        return True, ""
    if stage == "parse":
        return False, f"parse: {e}"
    return False, f"{stage}: {type(e).__name__}: {first_line(e)}"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    for s in lines:  # pydantic puts the rule's message on a later line
        if "Value error" in s or "Assertion" in s:
            return s
    return lines[0] if lines else type(e).__name__
