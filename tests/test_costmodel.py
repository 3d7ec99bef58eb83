"""Tests for cpbook.costmodel, including the tables of the hardware/model appendix.

The appendix page (book/appendix_hardware_models.md) prints the specs and a
few derived numbers as static tables; the last group of tests parses that
page and recomputes every number, so prose and code cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook import costmodel as cm
from cpbook.core.errors import RuleError
from cpbook.costmodel.decode import decode_attention_calls

ROOT = Path(__file__).resolve().parents[1]
APPENDIX = ROOT / "book" / "appendix_hardware_models.md"
INTRO = ROOT / "book" / "intro.md"
BIB = ROOT / "book" / "references.bib"

DSV3 = cm.MODELS["DeepSeek-V3"]
L8B, L70B = cm.MODELS["Llama-3.1-8B"], cm.MODELS["Llama-3.1-70B"]
QWEN3 = cm.MODELS["Qwen3-235B-A22B"]


def valid_layouts(model: cm.ModelSpec, max_tp: int = 128):
    """Every (tp, dcp) the model accepts, found by asking the model itself."""
    out = []
    for tp in range(1, max_tp + 1):
        for dcp in range(1, tp + 1):
            try:
                cm.kv_bytes_per_token_per_gpu(model, tp, dcp)
            except ValueError:
                continue
            out.append((tp, dcp))
    return out


# --------------------------------------------------------------- KV per token


@pytest.mark.parametrize(
    "key, bf16, fp8",
    [
        ("DeepSeek-V3", 70_272, 35_136),
        ("Kimi-K2", 70_272, 35_136),
        ("Llama-3.1-8B", 131_072, 65_536),
        ("Llama-3.1-70B", 327_680, 163_840),
        ("Llama-3.1-405B", 516_096, 258_048),
        ("Qwen2.5-7B-1M", 57_344, 28_672),
        ("Qwen3-235B-A22B", 192_512, 96_256),
    ],
)
def test_kv_bytes_per_token_matches_published_table(key, bf16, fp8):
    model = cm.MODELS[key]
    assert cm.kv_bytes_per_token(model) == bf16
    assert cm.kv_bytes_per_token(model, "fp8") == fp8
    assert isinstance(cm.kv_bytes_per_token(model), int)


def test_mla_fp8_kv_is_576_bytes_and_fp8_ds_mla_656():
    # dense MLA (FlashMLA, kv_cache_dtype fp8 / fp8_e4m3): 512 + 64 values of one byte
    assert cm.kv_bytes_per_token(DSV3, "fp8") == 576 * DSV3.num_layers
    # sparse MLA's fp8_ds_mla (DeepSeek-V3.2): 512 fp8 + 16 B scales + 64 bf16 rope
    assert cm.FP8_DS_MLA_BYTES_PER_TOKEN_PER_LAYER == 656
    assert cm.kv_bytes_per_token(DSV3, "fp8_ds_mla") == 656 * DSV3.num_layers
    with pytest.raises(ValueError, match=r"\[kv-dtype-ds-mla\].*Llama-3.1-70B"):
        cm.kv_bytes_per_token(L70B, "fp8_ds_mla")
    with pytest.raises(ValueError, match=r"\[kv-dtype\]"):
        cm.kv_bytes_per_token(DSV3, "int4")


def test_kv_bytes_for_context_is_linear():
    assert cm.kv_bytes_for_context(L70B, 0) == 0
    assert cm.kv_bytes_for_context(L70B, 2**17) == 40 * cm.GIB  # 128K tokens: 40 GiB
    assert cm.kv_bytes_for_context(DSV3, 3, "fp8") == 3 * 35_136


# ---------------------------------------------------------------- replication


@pytest.mark.parametrize(
    "key, tp, copies",
    [
        ("DeepSeek-V3", 1, 1),
        ("DeepSeek-V3", 8, 8),
        ("Kimi-K2", 16, 16),
        ("Llama-3.1-70B", 4, 1),
        ("Llama-3.1-70B", 8, 1),
        ("Llama-3.1-70B", 16, 2),
        ("Llama-3.1-70B", 64, 8),
        ("Qwen3-235B-A22B", 8, 2),
        ("Qwen2.5-7B-1M", 28, 7),
    ],
)
def test_kv_replication(key, tp, copies):
    assert cm.kv_replication(cm.MODELS[key], tp) == copies


@pytest.mark.parametrize("key", sorted(cm.MODELS))
def test_tp_group_holds_replication_copies_of_the_cache(key):
    """Summed over the TP group, per-GPU KV = one copy times the replication."""
    model = cm.MODELS[key]
    for tp, dcp in valid_layouts(model):
        if dcp == 1:
            group_total = cm.kv_bytes_per_token_per_gpu(model, tp) * tp
            assert group_total == cm.kv_bytes_per_token(model) * cm.kv_replication(model, tp)


# ------------------------------------------------------------------------ DCP


@pytest.mark.parametrize("key", sorted(cm.MODELS))
def test_dcp_divides_per_gpu_bytes_exactly(key):
    model = cm.MODELS[key]
    layouts = valid_layouts(model)
    assert any(dcp > 1 for _, dcp in layouts), "every model here admits some DCP"
    for tp, dcp in layouts:
        with_dcp = cm.kv_bytes_per_token_per_gpu(model, tp, dcp)
        assert with_dcp * dcp == cm.kv_bytes_per_token_per_gpu(model, tp, 1)


def test_dcp_never_exceeds_the_copies_tp_made():
    """vLLM's GQA rules allow DCP only up to the replication factor."""
    for model in cm.MODELS.values():
        for tp, dcp in valid_layouts(model):
            assert dcp <= cm.kv_replication(model, tp)


def test_article_example_8k_tokens_over_4_dcp_ranks():
    """8K tokens on a DCP group of 4: each GPU stores what 2K tokens need without DCP."""
    for model, tp in [(DSV3, 4), (L8B, 32)]:
        per_gpu_8k = cm.kv_bytes_per_token_per_gpu(model, tp, dcp=4) * 8192
        assert per_gpu_8k == cm.kv_bytes_per_token_per_gpu(model, tp, dcp=1) * 2048
    assert cm.kv_bytes_per_token_per_gpu(DSV3, 4, 4) * 8192 == cm.kv_bytes_for_context(DSV3, 2048)


def test_max_context_scales_with_dcp_up_to_rounding():
    gpu = cm.GPUS["H200"]
    base = cm.max_context_tokens(DSV3, gpu, tp=8, dcp=1)
    for dcp in (2, 4, 8):
        scaled = cm.max_context_tokens(DSV3, gpu, tp=8, dcp=dcp)
        assert dcp * base <= scaled < dcp * (base + 1)


# ---------------------------------------------------------- budget, monotone


@settings(max_examples=60, deadline=None)
@given(
    key=st.sampled_from(["DeepSeek-V3", "Llama-3.1-70B", "Qwen3-235B-A22B"]),
    gpu_key=st.sampled_from(["H200", "B200"]),
    util=st.floats(0.8, 1.0),
    extra=st.floats(0.001, 0.1),
    reserve=st.integers(0, 8 * cm.GIB),
)
def test_max_context_is_monotone(key, gpu_key, util, extra, reserve):
    model, gpu = cm.MODELS[key], cm.GPUS[gpu_key]
    lo = cm.max_context_tokens(
        model,
        gpu,
        8,
        1,
        gpu_memory_utilization=util * (1 - extra),
        activation_reserve_bytes=reserve,
    )
    hi = cm.max_context_tokens(
        model, gpu, 8, 1, gpu_memory_utilization=util, activation_reserve_bytes=reserve
    )
    assert 0 <= lo <= hi
    less_reserve = cm.max_context_tokens(
        model, gpu, 8, 1, gpu_memory_utilization=util, activation_reserve_bytes=reserve // 2
    )
    assert less_reserve >= hi
    assert cm.max_context_tokens(model, gpu, 8, 1, "fp8", util, reserve) >= hi


@settings(max_examples=40, deadline=None)
@given(a=st.integers(0, 2**22), b=st.integers(0, 2**22), key=st.sampled_from(sorted(cm.MODELS)))
def test_kv_bytes_for_context_monotone(a, b, key):
    lo, hi = sorted((a, b))
    model = cm.MODELS[key]
    assert cm.kv_bytes_for_context(model, lo) <= cm.kv_bytes_for_context(model, hi)


def test_budget_and_max_context_agree():
    gpu = cm.GPUS["H100"]
    budget = cm.kv_budget_bytes_per_gpu(L70B, gpu, 8)
    assert budget == gpu.hbm_bytes * 0.9 - 70.6e9 * 2 / 8 - 4 * cm.GIB
    n = cm.max_context_tokens(L70B, gpu, tp=8)
    per_token = cm.kv_bytes_per_token_per_gpu(L70B, 8)
    assert n * per_token <= budget < (n + 1) * per_token


def test_weights_per_gpu():
    assert cm.weight_bytes_per_gpu(DSV3, 8) == 671e9 / 8
    assert cm.weight_bytes_per_gpu(L70B, 1) == 70.6e9 * 2


# ---------------------------------------------------------------- ValueErrors


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: cm.kv_replication(L8B, 0), "positive int"),
        (lambda: cm.kv_replication(L8B, True), "positive int"),
        (lambda: cm.kv_replication(L8B, 2.0), "positive int"),
        (lambda: cm.kv_replication(L8B, 3), r"\[heads-divisible-by-tp\]"),
        (lambda: cm.kv_replication(QWEN3, 2 * 64), r"\[heads-divisible-by-tp\]"),
        (lambda: cm.kv_replication(cm.MODELS["Qwen2.5-7B-1M"], 14), r"\[heads-divisible-by-tp\]"),
        (lambda: cm.kv_bytes_per_token_per_gpu(DSV3, 8, 3), r"\[tp-divisible-by-dcp\]"),
        (lambda: cm.kv_bytes_per_token_per_gpu(DSV3, 8, 0), r"\[positive-sizes\]"),
        (lambda: cm.kv_bytes_per_token_per_gpu(L70B, 8, 2), r"\[gqa-dcp-needs-replicated-kv\]"),
        (lambda: cm.kv_bytes_per_token_per_gpu(QWEN3, 8, 4), r"\[gqa-dcp-within-replicas\]"),
        (
            lambda: cm.kv_bytes_per_token_per_gpu(cm.MODELS["Qwen2.5-7B-1M"], 28, 2),
            r"\[gqa-q-per-kv-divisible-by-dcp\]",
        ),
        (lambda: cm.kv_bytes_per_token(L8B, "int4"), r"\[kv-dtype\]"),
        (lambda: cm.kv_bytes_for_context(L8B, -1), "non-negative int"),
        (
            lambda: cm.kv_budget_bytes_per_gpu(L8B, cm.GPUS["H100"], 1, 0.0),
            "gpu_memory_utilization",
        ),
        (
            lambda: cm.kv_budget_bytes_per_gpu(L8B, cm.GPUS["H100"], 1, 1.5),
            "gpu_memory_utilization",
        ),
        (
            lambda: cm.kv_budget_bytes_per_gpu(L8B, cm.GPUS["H100"], 1, 0.9, -1),
            "activation_reserve",
        ),
        (
            lambda: cm.max_context_tokens(cm.MODELS["Kimi-K2"], cm.GPUS["H200"], 8),
            r"\[model-fits\]",
        ),
        (
            lambda: cm.max_context_tokens(cm.MODELS["Llama-3.1-405B"], cm.GPUS["H100"], 8),
            r"\[model-fits\]",
        ),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_error_messages_name_the_numbers():
    with pytest.raises(ValueError) as err:
        cm.kv_bytes_per_token_per_gpu(QWEN3, 8, 4)
    assert (
        "decode_context_parallel_size=4" in str(err.value)
        and "tensor_parallel_size=8" in str(err.value)
        and "num_kv_heads=4" in str(err.value)
    )


# ------------------------------------------------------------------- sources


def bib_keys() -> set[str]:
    return set(re.findall(r"^@\w+\{([^,\s]+),", BIB.read_text(), flags=re.M))


def test_every_source_key_is_in_the_bibliography():
    keys = bib_keys()
    specs = list(cm.GPUS.values()) + list(cm.MODELS.values())
    for spec in specs:
        cited = spec.source.split(",")
        assert cited and all(cited), spec.name
        assert set(cited) <= keys, (spec.name, set(cited) - keys)


def test_bibliography_keys_are_unique_and_have_urls():
    text = BIB.read_text()
    found = re.findall(r"^@\w+\{([^,\s]+),", text, flags=re.M)
    assert len(found) == len(set(found))
    entries = re.split(r"^@", text, flags=re.M)[1:]
    for entry in entries:
        assert re.search(r"^\s*url\s*=\s*\{https://", entry, flags=re.M), entry.splitlines()[0]


def test_every_cited_key_in_the_book_pages_exists():
    keys = bib_keys()
    for page in (ROOT / "book").glob("*.md"):
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", page.read_text()):
            for key in group.split(","):
                assert key.strip() in keys, (page.name, key)


# --------------------------------------------------------- appendix tables


def appendix_table(name: str) -> list[dict[str, str]]:
    """Rows of the MyST table with ``:name: name``, as header -> cell text."""
    lines = APPENDIX.read_text().splitlines()
    start = lines.index(f":name: {name}")  # options, then the pipe table
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    header, _separator, *body = rows
    assert all(len(row) == len(header) for row in body), name
    return [dict(zip(header, row)) for row in body]


def key(cell: str) -> str:
    return cell.strip("`")


def num(cell: str) -> float:
    return float(cell.replace(",", ""))


def cited(cell: str) -> str:
    match = re.fullmatch(r"\{cite\}`([^`]+)`", cell)
    assert match, cell
    return match.group(1)


def test_appendix_gpu_table_matches_costmodel():
    rows = appendix_table("tab-gpus")
    assert [key(r["Key"]) for r in rows] == list(cm.GPUS)
    for row in rows:
        gpu = cm.GPUS[key(row["Key"])]
        assert num(row["HBM (GB)"]) * cm.GB == gpu.hbm_bytes
        assert math.isclose(num(row["HBM bandwidth (TB/s)"]) * 1e12, gpu.hbm_bw_bytes_per_s)
        assert math.isclose(num(row["BF16 dense (TFLOP/s)"]) * 1e12, gpu.bf16_flops)
        assert math.isclose(
            num(row["Scale-up link, per direction (GB/s)"]) * 1e9, gpu.link_bw_bytes_per_s
        )
        assert cited(row["Source"]) == gpu.source


def test_appendix_model_tables_match_costmodel():
    shapes, weights = appendix_table("tab-models"), appendix_table("tab-model-weights")
    assert [key(r["Key"]) for r in shapes] == [key(r["Key"]) for r in weights] == list(cm.MODELS)
    for row in shapes:
        model = cm.MODELS[key(row["Key"])]
        assert num(row["Layers"]) == model.num_layers
        assert num(row["Q heads"]) == model.num_q_heads
        assert num(row["KV heads"]) == model.num_kv_heads
        assert num(row["head_dim"]) == model.head_dim
        width = row["MLA cache width"]
        if model.use_mla:
            assert width == f"{model.kv_lora_rank} + {model.qk_rope_head_dim}"
        else:
            assert width == "—" and model.kv_lora_rank == model.qk_rope_head_dim == 0
    for row in weights:
        model = cm.MODELS[key(row["Key"])]
        assert math.isclose(num(row["Parameters (billions)"]) * 1e9, model.num_params)
        assert num(row["Bytes per parameter"]) == model.weight_bytes_per_param
        assert cited(row["Source"]) == model.source


def test_appendix_kv_context_table_matches_costmodel():
    rows = appendix_table("tab-kv-context")
    assert [key(r["Key"]) for r in rows] == list(cm.MODELS)
    for row in rows:
        model = cm.MODELS[key(row["Key"])]
        assert num(row["Bytes per token (bf16)"]) == cm.kv_bytes_per_token(model)
        assert num(row["Bytes per token (fp8)"]) == cm.kv_bytes_per_token(model, "fp8")
        gib_128k = cm.kv_bytes_for_context(model, 2**17) / cm.GIB
        gib_1m = cm.kv_bytes_for_context(model, 2**20) / cm.GIB
        assert row["128K tokens, bf16 (GiB)"] == f"{gib_128k:.2f}"
        assert row["1M tokens, bf16 (GiB)"] == f"{gib_1m:.2f}"


def test_appendix_capacity_table_matches_costmodel():
    rows = appendix_table("tab-capacity")
    assert len(rows) >= 6
    for row in rows:
        model, gpu = cm.MODELS[key(row["Model"])], cm.GPUS[key(row["GPU"])]
        tp, dcp = int(row["TP"]), int(row["DCP"])
        assert num(row["KV copies"]) == cm.kv_replication(model, tp)
        per_gpu = cm.kv_bytes_per_token_per_gpu(model, tp, dcp)
        assert row["KV bytes/token/GPU"] == f"{per_gpu:,.0f}"
        budget = cm.kv_budget_bytes_per_gpu(model, gpu, tp)
        assert row["KV budget/GPU (GB)"] == f"{budget / cm.GB:.1f}"
        assert num(row["Longest request (tokens)"]) == cm.max_context_tokens(model, gpu, tp, dcp)


def test_appendix_prose_numbers():
    text = APPENDIX.read_text()
    # the stated assumptions are the module's defaults
    assert cm.DEFAULT_GPU_MEMORY_UTILIZATION == 0.9 and "`gpu_memory_utilization` of 0.9" in text
    assert cm.DEFAULT_ACTIVATION_RESERVE_BYTES == 4 * cm.GIB and "reserve of 4 GiB" in text
    # Kimi-K2 on one H200 node: 130.0 GB of weights per GPU vs 126.9 GB usable
    kimi, h200 = cm.MODELS["Kimi-K2"], cm.GPUS["H200"]
    weights, usable = cm.weight_bytes_per_gpu(kimi, 8) / cm.GB, h200.hbm_bytes * 0.9 / cm.GB
    assert f"need {weights:.1f} GB per GPU" in text.replace("\n", " ")
    assert f"than the {usable:.1f} GB" in text.replace("\n", " ")
    assert weights > usable
    # the FP8 layouts of MLA: dense 576 B (one byte per value), sparse fp8_ds_mla 656 B
    flat = text.replace("\n", " ")
    assert "values in FP8 with one scale per tensor, 576 bytes per token and layer" in flat
    assert cm.kv_bytes_per_token(DSV3, "fp8") == 576 * DSV3.num_layers
    assert "656 bytes of vLLM's `fp8_ds_mla` layout" in flat
    assert f"{cm.kv_bytes_per_token(DSV3, 'fp8_ds_mla'):,} bytes per token" in flat
    # "Qwen3-235B-A22B ... DCP can be at most 2" at TP 8
    assert max(d for t, d in valid_layouts(QWEN3) if t == 8) == 2
    # "DSV3 ... stores less KV per token than Llama-3.1-8B"
    assert cm.kv_bytes_per_token(DSV3) < cm.kv_bytes_per_token(L8B)


def test_intro_prose_numbers():
    """The landing page's rounded claims about Llama-3.1-405B's KV cache."""
    text = " ".join(INTRO.read_text().split())
    per_token = cm.kv_bytes_per_token(cm.MODELS["Llama-3.1-405B"])
    assert "about half a megabyte per token" in text and 0.45e6 < per_token < 0.55e6
    assert "roughly half a terabyte" in text and 0.45e12 < per_token * 2**20 < 0.6e12
    assert "stores its whole cache eight times over" in text
    assert cm.kv_replication(DSV3, 8) == 8


def test_prefill_flops_crossover_and_decode_bytes():
    m = cm.MODELS["Llama-3.1-8B"]
    cross = m.num_params / (m.num_layers * m.num_q_heads * m.head_dim)
    lin, att = cm.prefill_flops(m, int(cross))
    assert att < lin
    lin, att = cm.prefill_flops(m, int(cross) + 1)
    assert att > lin
    assert cm.prefill_flops(m, 0) == (0.0, 0.0)
    w, kv = cm.decode_bytes_per_step(cm.MODELS["Llama-3.1-70B"], 131072, tp=8)
    assert w == 70.6e9 * 2 / 8 and kv == 131072 * 327680 / 8
    w2, kv2 = cm.decode_bytes_per_step(cm.MODELS["DeepSeek-V3"], 8192, 8, 8)
    assert kv2 == 8192 * 70272 / 8
    with pytest.raises(ValueError, match=r"\[non-negative-tokens\]"):
        cm.prefill_flops(m, -1)


# ------------------------------------------------- collectives (α–β) and the decode step


NVL = cm.LINKS["NVLink4"]
H200 = cm.GPUS["H200"]


def test_collective_time_is_alpha_plus_bytes_over_bandwidth():
    assert cm.collective_time("all_gather", 10**6, 1, NVL) == 0.0
    for op in cm.COLLECTIVES:
        assert cm.collective_time(op, 0, 8, NVL) == NVL.alpha_s
        t = cm.collective_time(op, 450e6, 8, NVL)
        assert math.isclose(t, NVL.alpha_s + 450e6 / 450e9)
    assert NVL.bw_bytes_per_s == H200.link_bw_bytes_per_s == cm.GPUS["H100"].link_bw_bytes_per_s


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: cm.collective_time("broadcast", 1, 2, NVL), r"\[collective-op\]"),
        (lambda: cm.collective_time("all_gather", 1, 0, NVL), r"\[positive-group\]"),
        (lambda: cm.collective_time("all_gather", 1, True, NVL), r"\[positive-group\]"),
        (lambda: cm.collective_time("all_gather", -1, 2, NVL), r"\[non-negative-bytes\]"),
        (lambda: cm.decode_layer_time(DSV3, H200, 8, "tpa"), r"\[decode-mode\]"),
        (lambda: cm.decode_layer_time(DSV3, H200, -1, "dcp"), r"\[non-negative-tokens\]"),
        (
            lambda: cm.decode_layer_time(
                DSV3, H200, 8, "dcp", knobs=cm.CostKnobs(hbm_efficiency=1.5)
            ),
            r"\[hbm-efficiency\]",
        ),
        (lambda: cm.decode_break_even(DSV3, H200, "no_cp"), r"\[decode-mode\]"),
        (lambda: cm.decode_layer_time(L70B, H200, 8, "dcp", dcp=2), r"\[gqa-dcp-needs"),
        (lambda: cm.decode_layer_time(L70B, H200, 8, "dcp_tpa", dcp=3), r"\[tpa-dcp-is-tp"),
    ],
)
def test_decode_model_errors_name_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_link_sources_are_in_the_bibliography():
    keys = bib_keys()
    for link in cm.LINKS.values():
        assert set(link.source.split(",")) <= keys, link.name


def test_every_model_has_its_projection_widths():
    for model in cm.MODELS.values():
        assert model.hidden_size > 0 and model.hidden_size % model.num_q_heads == 0
        assert (model.q_lora_rank > 0) == model.use_mla
    assert L70B.hidden_size == L70B.num_q_heads * L70B.head_dim == 8192


def test_decode_collectives_are_the_tpa_formula():
    from cpbook.core.heads import tpa_config
    from cpbook.dcp.tpa import tpa_comm_bytes

    for mode, tpa, n in (("no_cp", False, 1), ("dcp", False, 8), ("dcp_tpa", True, 8)):
        t = cm.decode_layer_time(DSV3, H200, 4096, mode, num_reqs=3)
        cfg = tpa_config(
            tpa, tensor_parallel_size=8, decode_context_parallel_size=n, **DSV3.attention_shape
        )
        expected = tpa_comm_bytes(cfg, 3, 576, 512, 7168, 2, 4)
        assert [(op, b) for op, _, b in t.calls] == expected
        assert [g for op, g, _ in t.calls] == [8 if op == "all_reduce" else n for op, _ in expected]
        graph = dataclasses.replace(NVL, alpha_s=cm.gpu_terms.DECODE_ALLREDUCE_ALPHA_S)
        links = {"all_reduce": graph}  # decode all-reduces run in CUDA graphs
        assert math.isclose(
            t.comm_s, sum(cm.collective_time(o, b, g, links.get(o, NVL)) for o, g, b in t.calls)
        )
    std = cm.decode_layer_time(DSV3, H200, 4096, "dcp")
    tpa = cm.decode_layer_time(DSV3, H200, 4096, "dcp_tpa")
    # vLLM's LSEs are fp32: ag_rs gathers 8 x 16 of them per request, a2a packs 4 bytes each
    assert std.calls[1] == ("all_gather", 8, 8 * 16 * 4 * 7)
    a2a = cm.decode_layer_time(DSV3, H200, 4096, "dcp", knobs=cm.CostKnobs(dcp_comm_backend="a2a"))
    assert a2a.calls[1] == ("all_to_all", 8, 16 * (512 * 2 + 4) * 7)
    # vLLM v0.34.0's up-projected MLA a2a: from 8 requests 128 values per head, not 512
    cfg = cm.Deployment(tp=8, dcp=8).config(DSV3, "a2a")
    for reqs, width in ((7, 512), (8, 128)):
        calls = decode_attention_calls(DSV3, cfg, False, reqs, 2, v_up_proj_combine=True)
        assert calls[1] == ("all_to_all", 8, reqs * 16 * (width * 2 + 4) * 7)
        assert decode_attention_calls(DSV3, cfg, False, reqs)[1][2] == reqs * 16 * 1028 * 7
    ag_rs = cm.Deployment(tp=8, dcp=8).config(DSV3)
    with pytest.raises(ValueError, match="v-up-proj-combine-a2a"):
        decode_attention_calls(DSV3, ag_rs, False, 8, 2, v_up_proj_combine=True)
    (_, _, q_bytes), *_ = std.calls
    assert math.isclose(std.comm_s - tpa.comm_s, NVL.alpha_s + q_bytes / NVL.bw_bytes_per_s)
    # TPA reads dcp - 1 more q_b_proj shards: 16 heads x 192 x 1536 fp8 bytes each
    hbm = H200.hbm_bw_bytes_per_s * 0.8
    assert tpa.q_proj_extra_s * hbm == pytest.approx(7 * 16 * 192 * 1536)
    assert std.q_proj_extra_s == 0 == cm.decode_layer_time(DSV3, H200, 1, "no_cp").q_proj_extra_s
    # and dcp - 1 more shards of W_UK_T_dcp_qrep: 16 heads x 128 x 512 bf16 values each
    assert tpa.w_uk_t_extra_s * hbm == pytest.approx(7 * 16 * 128 * 512 * 2)
    assert std.w_uk_t_extra_s == 0 == cm.decode_layer_time(L70B, H200, 1, "no_cp").w_uk_t_extra_s
    gqa = cm.decode_layer_time(cm.MODELS["Qwen3-235B-A22B"], H200, 1, "dcp_tpa", dcp=8)
    assert gqa.q_proj_extra_s > 0 == gqa.w_uk_t_extra_s  # GQA has no absorbed W_UK_T
    assert math.isclose(
        tpa.total_s, tpa.kv_read_s + tpa.comm_s + tpa.q_proj_extra_s + tpa.w_uk_t_extra_s
    )


@pytest.mark.parametrize("key", sorted(cm.MODELS))
def test_decode_kv_read_matches_the_capacity_model(key):
    """Standard layouts: the per-GPU KV bytes of ``kv_bytes_per_token_per_gpu``; TPA (GQA):
    never less than, and at best equal to, the largest DCP plain DCP admits at that TP."""
    model, hbm = cm.MODELS[key], H200.hbm_bw_bytes_per_s * 0.8
    for tp, dcp in valid_layouts(model, max_tp=16):
        mode = "no_cp" if dcp == 1 else "dcp"
        t = cm.decode_layer_time(model, H200, 1000, mode, tp=tp, dcp=dcp, num_reqs=8)
        per_gpu = cm.kv_bytes_per_token_per_gpu(model, tp, dcp) / model.num_layers
        assert t.kv_read_s * hbm == pytest.approx(per_gpu * 1000 * 8)  # 8: at full efficiency
    if not model.use_mla:
        for tp in (8, 16):
            plain = [
                cm.kv_bytes_per_token_per_gpu(model, t, d)
                for t, d in valid_layouts(model, 16)
                if t == tp
            ]
            if not plain:  # 28 heads: neither TP = 8 nor 16
                continue
            best = min(plain)
            reads = []
            for dcp in (d for d in (2, 4, 8, 16) if tp % d == 0):
                try:
                    t = cm.decode_layer_time(model, H200, 1, "dcp_tpa", tp=tp, dcp=dcp, num_reqs=8)
                except ValueError:
                    continue
                reads.append(t.kv_read_s * hbm * model.num_layers / 8)
            assert reads and min(reads) == pytest.approx(best)
            assert all(r >= best * (1 - 1e-12) for r in reads)


def test_break_even_is_where_the_times_cross():
    for mode in ("dcp", "dcp_tpa"):
        a2a, fp8 = cm.CostKnobs(dcp_comm_backend="a2a"), cm.CostKnobs(kv_dtype="fp8")
        for kw in ({}, {"num_reqs": 16}, {"knobs": a2a}, {"knobs": fp8}):
            x = cm.decode_break_even(DSV3, H200, mode, **kw)
            assert 0 < x < math.inf
            t0 = cm.decode_layer_time(DSV3, H200, x, "no_cp", **kw).total_s
            t1 = cm.decode_layer_time(DSV3, H200, x, mode, **kw).total_s
            assert math.isclose(t0, t1, rel_tol=1e-9)
            assert cm.decode_layer_time(DSV3, H200, 2 * x, mode, **kw).total_s < (
                cm.decode_layer_time(DSV3, H200, 2 * x, "no_cp", **kw).total_s
            )
    # no saving without replicated KV: GQA with TPA at TP = 8 and 8 KV heads never wins
    assert cm.decode_break_even(L70B, H200, "dcp_tpa", dcp=2) == math.inf
    # a free link never loses
    free = cm.LinkSpec("free", 0.0, math.inf, "none")
    assert cm.decode_break_even(DSV3, H200, "dcp", knobs=cm.CostKnobs(link=free)) == 0.0


def test_break_even_sensitivities():
    base = {m: cm.decode_break_even(DSV3, H200, m) for m in ("dcp", "dcp_tpa")}
    assert base["dcp_tpa"] < base["dcp"]
    doubled = dataclasses.replace(DSV3, num_layers=2 * DSV3.num_layers)
    for mode, x in base.items():  # per-layer costs: the number of layers cancels
        assert math.isclose(cm.decode_break_even(doubled, H200, mode), x, rel_tol=1e-12)
        slow = cm.LinkSpec("slow", 2 * NVL.alpha_s, NVL.bw_bytes_per_s, "")
        assert cm.decode_break_even(DSV3, H200, mode, knobs=cm.CostKnobs(link=slow)) > x
        assert cm.decode_break_even(DSV3, H200, mode, num_reqs=4) < x / 3
        assert cm.decode_break_even(DSV3, H200, mode, knobs=cm.CostKnobs(hbm_efficiency=1.0)) > x
        assert cm.decode_break_even(DSV3, H200, mode, knobs=cm.CostKnobs(kv_dtype="fp8")) > 1.5 * x


# ------------------------------------------------------- GPU-side terms (gpu_terms, issue 23)

GT = cm.gpu_terms


def test_attention_mfu_ramps_with_length_and_is_flat_outside():
    assert GT.attention_mfu(1024) == GT.attention_mfu(4096) == 0.49
    assert GT.attention_mfu(32768) == GT.attention_mfu(131072) == 0.65
    assert 0.49 < GT.attention_mfu(8192) < GT.attention_mfu(16384) < 0.65
    assert math.isclose(GT.attention_mfu(8192), 0.49 + 0.16 / 3)  # one third of the log2 span


def test_prefill_gemm_flops_skip_the_embedding_and_run_the_lm_head_once():
    head = L8B.vocab_size * L8B.hidden_size
    dense, experts = cm.prefill_gemm_flops(L8B, 4096)
    assert experts == 0 and dense == 2 * ((L8B.num_params - 2 * head) * 4096 + head)
    assert cm.prefill_flops(L8B, 4096)[0] / dense > 1.13  # 13 % of the textbook count
    two = cm.prefill_gemm_flops(L8B, 8192, requests=2)[0]
    assert two == 2 * dense  # one LM head per request
    d3, e3 = cm.prefill_gemm_flops(DSV3, 1)
    routed = DSV3.active_params - (DSV3.num_params - DSV3.expert_params)
    assert e3 == 2 * routed and d3 == 2 * (DSV3.active_params - routed - DSV3.lm_head_params)


def test_fp8_weights_use_the_fp8_peak():
    h200 = cm.GPUS["H200"]
    assert h200.peak_flops(1) == 1979e12 == 2 * h200.peak_flops(2) + 1e12
    assert cm.GPUS["Ascend910C"].peak_flops(1) == cm.GPUS["Ascend910C"].bf16_flops
    fp8 = cm.ttft(DSV3, h200, cm.Deployment(tp=8), 32768)
    slow = cm.ttft(DSV3, dataclasses.replace(h200, fp8_flops=0.0), cm.Deployment(tp=8), 32768)
    assert fp8.compute_s < slow.compute_s


def test_decode_all_reduce_runs_at_the_cuda_graph_latency():
    t = cm.tpot(L70B, H200, cm.Deployment(tp=8), 4096)
    nbytes = 2 * 8192 * 2 * 7 // 8  # ring all-reduce of one token's 8192 bf16 values
    one = GT.DECODE_ALLREDUCE_ALPHA_S + nbytes / H200.link_bw_bytes_per_s
    assert math.isclose(t.comm_s, 80 * 2 * one)
    assert GT.DECODE_ALLREDUCE_ALPHA_S < NVL.alpha_s  # prefill's NCCL α stays 15 µs


def test_decode_fixed_costs_per_layer():
    t = cm.tpot(L8B, H200, cm.Deployment(), 4096)
    per_layer = 4 * GT.DECODE_GEMM_FIXED_S + 3 * GT.ELEMENTWISE_FLOOR_S
    assert math.isclose(t.fixed_s, 32 * (per_layer + GT.DECODE_ATTENTION_FIXED_S))
    mla = cm.tpot(DSV3, H200, cm.Deployment(tp=8), 4096)
    assert mla.fixed_s > DSV3.num_layers * GT.MLA_DECODE_FIXED_S  # + MoE floor and norms
    assert cm.tpot(DSV3, H200, cm.Deployment(tp=8), 4096, 64).fixed_s > mla.fixed_s


def test_small_batch_moe_and_mla_decode_are_far_from_bandwidth_bound():
    """DeepSeek-V3 TP8 batch 1 at 4K: the peer's 14.3 ms; bandwidth alone gives ~3 ms."""
    t = cm.tpot(DSV3, H200, cm.Deployment(tp=8), 4096 + 128)
    assert 13e-3 < t.total_s < 16e-3 and t.memory_s < 3e-3
    stream, extra = GT.moe_decode_s(10e6, 1, 3.84e12)
    assert stream + extra == GT.MOE_DECODE_FLOOR_S[1]
    stream, extra = GT.moe_decode_s(1e9, 1, 3.84e12)
    assert math.isclose(stream + extra, GT.MOE_DECODE_FIXED_S[1] + 1e9 / 3.84e12)
    # a GQA model's FP8 experts decode in the BF16 time of the same experts
    stream, extra = GT.moe_decode_s(1e9, 1, 3.84e12, gqa=True)
    assert math.isclose(
        stream + extra, GT.moe_decode_s(2e9, 2, 3.84e12)[0] + GT.MOE_DECODE_FIXED_S[2]
    )


def test_a_static_batch_prefills_its_tokens_through_each_gemm_at_once():
    one = cm.ttft(L8B, H200, cm.Deployment(tp=1), 2048)
    assert cm.batch_ttft(L8B, H200, cm.Deployment(tp=1), 2048, 1) == one
    moe, tp8 = cm.MODELS["Qwen3-235B-A22B"], cm.Deployment(tp=8)
    single = cm.ttft(moe, H200, tp8, 2048).total_s
    batched = cm.batch_ttft(moe, H200, tp8, 2048, 16).total_s
    assert batched < 16 * single  # more tokens per expert: the routed GEMMs run nearer the peak
    wide = cm.ttft(moe, H200, tp8, 2048 * 16).total_s
    assert batched < wide  # attention stays per prompt
    with pytest.raises(ValueError, match="positive-tokens"):
        cm.batch_ttft(L8B, H200, cm.Deployment(tp=1), 2048, 0)


def test_fp8_decode_gemm_fixed_cost_overlaps_the_weights():
    """The peer's Llama-3.1-70B TP1 FP8 gate-up at batch 1: 131 µs for 122 µs of streaming."""
    bw = 4.8e12 * 0.8
    stream = 8192 * 57344 / bw
    assert 125e-6 < stream + GT.fp8_decode_gemm_s(8192 * 57344, bw, 1) < 140e-6
    assert GT.fp8_decode_gemm_s(1e3, bw, 8) == pytest.approx(58e-6, rel=1e-3)
    assert GT.fp8_decode_gemm_s(1e3, bw, 64) == pytest.approx(86e-6, rel=1e-3)


def test_ep_routing_imbalance_is_the_busiest_rank():
    mean = 16 * (1 - (15 / 16) ** 8)
    busiest = GT.busiest_rank_experts(128, 8, 8, 8)
    assert mean < busiest < 16 and 1.55 < busiest / mean < 1.7
    assert GT.busiest_rank_experts(128, 1, 8, 8) == GT.touched_experts(128, 8, 8)
    assert GT.busiest_rank_experts(128, 8, 8, 10_000) == 16  # every local expert
    qwen = cm.MODELS["Qwen3-235B-A22B"]
    ep = cm.ttft(qwen, H200, cm.Deployment(dp=8, ep=True), 4096)
    tp = cm.ttft(qwen, H200, cm.Deployment(tp=8), 4096)
    assert ep.ep_comm_s > 0 == tp.ep_comm_s
    step = cm.tpot(qwen, H200, cm.Deployment(dp=8, ep=True), 4096, 8)
    sent = 1 * 8 * 4096 * 2 * 7 / 8  # one token per rank to 8 experts, 7/8 of them remote
    a2a = GT.ALL_TO_ALL_ALPHA_S + sent / (H200.link_bw_bytes_per_s * GT.ALL_TO_ALL_BW_EFFICIENCY)
    assert math.isclose(step.comm_s, 2 * 94 * a2a)  # no TP all-reduce at TP1


def test_tpot_under_continuous_batching_carries_prefill_chunks():
    lay = cm.Deployment(tp=8)
    static = cm.tpot(L70B, H200, lay, 4096 + 512, 96)
    agg = cm.tpot(L70B, H200, lay, 4096 + 512, 96, batching=cm.ContinuousBatching(4096, 1024))
    per_token = cm.ttft(L70B, H200, lay, 4096).total_s / 4096
    assert agg.step_s == static.total_s
    assert math.isclose(agg.prefill_s, 95 * 4096 / 1024 * per_token)
    assert 1.8 < agg.total_s / static.total_s < 2.2  # the peer: 29.5 vs 14.7 ms
    capped = cm.tpot(L70B, H200, lay, 4096, 96, batching=cm.ContinuousBatching(4096, 16, 2048))
    assert math.isclose(capped.prefill_s, 2048 * per_token)
    alone = cm.tpot(L70B, H200, lay, 4096, batching=cm.ContinuousBatching(4096, 16))
    assert alone.prefill_s == 0  # its own prefill ends before its first token
    for call, rule in (
        (lambda: cm.ContinuousBatching(1, 0), "positive-tokens"),
        (lambda: cm.ContinuousBatching(1, 1, 0), "positive-tokens"),
        (lambda: cm.CostKnobs(mfu=0.0), "mfu"),
        (lambda: cm.CostKnobs(kv_dtype="int4"), "kv-dtype"),
    ):
        with pytest.raises(RuleError, match=rf"\[{rule}\]"):
            call()


def test_batch_for_is_the_smallest_batch_reaching_the_target():
    def even(b: int) -> float:
        return cm.decode_break_even(DSV3, H200, "dcp", num_reqs=b)

    for target in (4096, 32768):
        linear = next(b for b in range(1, 1025) if even(b) <= target)
        assert cm.batch_for(even, target) == linear
    assert cm.batch_for(even, 4096) == 86 and cm.batch_for(even, 10**9) == 1
    with pytest.raises(RuleError, match=r"\[batch-reaches-target\]") as e:
        cm.batch_for(even, 1.0, max_batch=4)
    assert e.value.values == {"max_batch": 4, "target": 1.0}


def test_kv_read_efficiency_is_occupancy_bound_at_one_request():
    eff = cm.kv_read_efficiency
    assert eff(0.8, 1, 1) == GT.DECODE_ATTENTION_UNIT_EFFICIENCY == 0.35
    assert eff(0.8, 2, 1) == eff(0.8, 1, 2) == 0.7 and eff(0.8, 8, 1) == eff(0.8, 1, 8) == 0.8
    # chapter 6's per-layer model streams at hbm_efficiency; the whole-model TPOT at one
    # request's occupancy, so its DCP8 crossing is chapter 6's break-even at 0.35 of HBM
    lay, base = cm.Deployment(tp=8, dcp=8), cm.Deployment(tp=8)
    at = cm.decode_break_even(DSV3, H200, "dcp", knobs=cm.CostKnobs(hbm_efficiency=0.35))
    assert abs(cm.tpot_break_even(DSV3, H200, lay, base) / at - 1) < 0.01
    assert at < cm.decode_break_even(DSV3, H200, "dcp") / 2


def test_appendix_gpu_terms_table_matches_gpu_terms():
    rows = {key(r["Constant"]): r["Value"] for r in appendix_table("tab-gpu-terms")}
    us = {k: v * 1e6 for k, v in vars(GT).items() if k.endswith("_S") and isinstance(v, float)}
    for name, cell in rows.items():
        base, _, idx = name.partition("[")
        value = getattr(GT, base)
        if idx:
            value = value[int(idx.rstrip("]"))]
        if isinstance(value, dict):
            value = " / ".join(f"{v * 1e6:g}" if base.endswith("_S") else f"{v:g}"
                               for v in (value[2], value[1]))  # fmt: skip
            assert cell == value, name
        elif isinstance(value, tuple):
            scale = 1e6 if base.endswith("_S") else 1
            lo, hi = value[0][1] * scale, value[-1][1] * scale
            assert cell == f"{lo:g} to {hi:g}" or cell == f"{lo:g}"
        else:
            assert num(cell) == pytest.approx(us.get(base, value)), name


def test_a_moe_model_must_state_its_experts():
    bare = dataclasses.replace(cm.MODELS["Qwen3-235B-A22B"], num_experts=0)
    for call in (
        lambda: cm.tpot(bare, H200, cm.Deployment(tp=8), 4096),
        lambda: cm.ttft(bare, H200, cm.Deployment(tp=8), 4096),
    ):
        with pytest.raises(ValueError, match=r"\[moe-shape\]"):
            call()
    assert (
        cm.ttft(bare, H200, cm.Deployment(tp=8), 4096, knobs=cm.CostKnobs(mfu=0.5)).total_s > 0
    )  # former model


# ------------------------------------------------------------------- several nodes (nodes.py)


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    pcp=st.sampled_from([1, 2, 4]),
    dcp_pick=st.integers(0, 2),
)
def test_node_groups_are_vllm_groups(tp, pcp, dcp_pick):
    """The rank sets of costmodel.nodes equal core.groups' (vLLM's order) for one replica."""
    from cpbook.core.groups import RankGrid
    from cpbook.costmodel.nodes import group_ranks

    dcps = sorted({1, pcp, tp * pcp}) if pcp > 1 else [d for d in (1, 2, 4, 8) if tp % d == 0]
    dcp = dcps[dcp_pick % len(dcps)]
    d = cm.Deployment(tp=tp, pcp=pcp, dcp=dcp)
    grid = RankGrid(tp, pcp, dcp)
    for kind in ("tp", "pcp", "dcp"):
        ours = sorted(sorted(g) for g in group_ranks(d, kind))
        assert ours == sorted(sorted(g) for g in grid.groups(kind)), kind


def test_which_groups_span_two_nodes():
    from cpbook.costmodel.nodes import node_count, spans_nodes

    def spans(d):
        return {k for k in ("tp", "pcp", "dcp", "ep") if spans_nodes(d, k, 8)}

    assert spans(cm.Deployment(tp=16)) == {"tp", "ep"}
    assert spans(cm.Deployment(tp=8, pcp=2, dcp=2)) == {"pcp", "dcp", "ep"}
    assert spans(cm.Deployment(tp=8, dp=2, ep=True)) == {"ep"}
    assert spans(cm.Deployment(tp=8, dcp=8)) == set()
    # vLLM's --nnodes puts world // nnodes ranks on each node, so a replica can straddle two
    assert spans(cm.Deployment(tp=3, dp=5)) == {"tp", "ep"}  # 3 nodes of 5: [3, 4, 5]
    assert spans(cm.Deployment(tp=2, dp=5)) == {"tp", "ep"}  # 2 nodes of 5: [4, 5]
    assert spans(cm.Deployment(tp=5, dp=2)) == {"ep"}
    assert spans(cm.Deployment(tp=6, dp=2, pcp=1)) == {"ep"}  # 2 nodes of 6
    assert [node_count(n, 8) for n in (8, 9, 12, 15, 16)] == [1, 3, 2, 3, 2]


def test_405b_tp16_on_two_nodes_is_priced_on_rdma():
    """Llama-3.1-405B, a 128K prompt: TP16 in one NVLink domain beats TP8; on two 8-GPU nodes
    its all-reduces cross RDMA400 and TP8 wins (the ranking flips)."""
    from cpbook.costmodel.nodes import Nodes

    m, k = cm.MODELS["Llama-3.1-405B"], 128 * 1024
    one, two = cm.CostKnobs(), cm.CostKnobs(nodes=Nodes(8))
    tp8, tp16 = cm.Deployment(tp=8), cm.Deployment(tp=16)
    t8 = cm.ttft(m, H200, tp8, k, knobs=two).total_s
    assert t8 == cm.ttft(m, H200, tp8, k, knobs=one).total_s  # one node: nothing changes
    t16_nvl = cm.ttft(m, H200, tp16, k, knobs=one).total_s
    t16_rdma = cm.ttft(m, H200, tp16, k, knobs=two).total_s
    assert t16_nvl < t8 < t16_rdma
    rdma = cm.LINKS["RDMA400"]
    step = cm.tpot(m, H200, tp16, k, knobs=two)
    assert step.comm_s > cm.tpot(m, H200, tp16, k, knobs=one).comm_s
    slower = dataclasses.replace(rdma, bw_bytes_per_s=rdma.bw_bytes_per_s / 2)
    assert cm.ttft(m, H200, tp16, k, knobs=cm.CostKnobs(nodes=Nodes(8, slower))).total_s > (
        t16_rdma
    )  # the inter-node link is overridable


def test_ep_across_nodes_uses_the_inter_node_link():
    from cpbook.costmodel.nodes import Nodes

    m = cm.MODELS["DeepSeek-V3"]
    d = cm.Deployment(tp=1, dp=16, ep=True)
    one = cm.ttft(m, H200, d, 4096)
    two = cm.ttft(m, H200, d, 4096, knobs=cm.CostKnobs(nodes=Nodes(8)))
    assert two.ep_comm_s > one.ep_comm_s and two.tp_comm_s == one.tp_comm_s == 0
    with pytest.raises(ValueError, match=r"\[gpus-per-node\]"):
        Nodes(0)
