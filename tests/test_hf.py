"""cpbook.engine.hf: Hugging Face checkpoints load and serve token-exact against transformers.

Random-initialised tiny ``LlamaForCausalLM`` (Llama-3 RoPE scaling, attention bias),
``MistralForCausalLM`` (no sliding window), ``Qwen2ForCausalLM`` (QKV bias, tied embeddings),
``Qwen3ForCausalLM`` (q/k RMSNorm),
``DeepseekV2ForCausalLM`` (MLA, MoE with a shared expert; with and without q-LoRA + YaRN) and
``DeepseekV3ForCausalLM`` (q-LoRA, YaRN, grouped top-k with bias correction) are saved with
``save_pretrained`` and served by cpbook's engine; transformers runs in float64 throughout
(:func:`hf_models.float64_transformers`), so logits agree to <= 1e-8 (measured ~1e-14).
"""

from __future__ import annotations

import json

import pytest
import torch

from cpbook.core.config import ConfigError
from cpbook.core.launch import run
from cpbook.demos.ch09_engine import serve_grid_rank
from cpbook.engine.engine import engine_config, make_prompts, serve_rank
from cpbook.engine.hf import from_pretrained, hf_config
from tests.hf_models import FAMILIES, build, float64_transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORK = dict(num_requests=3, max_new_tokens=4)


def serve_kwargs(folder: str, tp: int, dcp: int, pcp: int) -> dict:
    """:func:`serve_rank`'s keywords for ``folder`` on a TP x DCP x PCP grid (float64)."""
    return dict(
        model=folder,
        parallel_config=dict(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
        ),
        cache_config=dict(num_gpu_blocks=40),
        runner_config=dict(dtype="float64"),
        workload=WORK,
    )


# GQA (4 query heads over 2 KV heads) accepts 6 of these, MLA all 8: KV-head replication at TP 4,
# DCP with and without PCP, uneven zigzag shards
LAYOUTS = [(1, 1, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1), (4, 2, 1), (2, 2, 2), (4, 2, 2), (4, 4, 1)]
TOL = 1e-8


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[str, list, list]]:
    """family -> (folder, prompts, [(tokens, logits [n, vocab]) per prompt] from transformers)."""
    out = {}
    with float64_transformers():
        for fam in FAMILIES:
            folder = tmp_path_factory.mktemp(fam)
            hf = build(fam, folder)
            prompts = make_prompts(WORK["num_requests"], 0, hf.config.vocab_size)
            refs = []
            for p in prompts:
                n = WORK["max_new_tokens"]
                seq = hf.generate(
                    torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False
                )[0]
                with torch.no_grad():
                    logits = hf(seq[None]).logits[0, len(p) - 1 : -1]
                refs.append((seq[len(p) :].tolist(), logits))
            out[fam] = (str(folder), prompts, refs)
    return out


def valid_layouts(folder: str) -> list[tuple[int, int, int]]:
    cfg = from_pretrained(folder, torch.float64).config
    ok = []
    for tp, dcp, pcp in LAYOUTS:
        try:
            engine_config(cfg, tp, dcp, pcp)
        except ConfigError:
            continue
        ok.append((tp, dcp, pcp))
    return ok


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_and_logits_equal_transformers_on_every_layout(saved, family):
    """One rank and >= 6 TP x DCP x PCP layouts: greedy tokens equal transformers' ``generate``
    and every sampled logits row is within 1e-8 of transformers' forward (float64)."""
    folder, prompts, refs = saved[family]
    layouts = [(1, 1, 1)] + valid_layouts(folder)
    assert len(layouts) >= 7, layouts
    worst = 0.0
    for tp, dcp, pcp in layouts:
        kw = serve_kwargs(folder, tp, dcp, pcp)
        res = run(serve_rank, tp * pcp, "inline", kw, report=False)
        assert res[0]["prompts"] == prompts
        for rank in res:
            assert rank["tokens"] == [t for t, _ in refs], (family, tp, dcp, pcp)
        for got, (_, want) in zip(res[0]["logits"], refs):
            worst = max(worst, float((got - want).abs().max()))
    assert worst <= TOL, (family, worst)


def test_sharded_checkpoint_and_float32(tmp_path):
    """A checkpoint split over several safetensors files (``model.safetensors.index.json``)
    loads to the same weights; the float32 engine picks transformers' float64 tokens here."""
    with float64_transformers():
        hf = build("deepseek_v3", tmp_path / "one")
        hf.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    a, b = from_pretrained(tmp_path / "one"), from_pretrained(tmp_path / "many")
    assert a.embed.dtype == torch.float32
    for la, lb in zip(a.layers, b.layers):
        assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "extra": 1,
                              "original_max_position_embeddings": 8}}, "rope_scaling.extra"),
        ({"some_new_field": 1}, "some_new_field"),
    ],
)  # fmt: skip
def test_unsupported_config_fields_are_refused(saved, change, field):
    folder = saved["llama"][0]
    raw = json.loads(open(f"{folder}/config.json").read())
    raw.update(change)
    with pytest.raises(ValueError, match=r"\[hf-config-supported\].*" + field.replace(".", r"\.")):
        hf_config(raw)


def test_deepseek_fields_are_refused(saved):
    raw = json.loads(open(f"{saved['deepseek_v3'][0]}/config.json").read())
    for change, field in [
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"attention_bias": True}, "attention_bias"),
    ]:
        with pytest.raises(ValueError, match=field):
            hf_config({**raw, **change})


@pytest.mark.torchrun
def test_torchrun_hf_layouts(saved):
    """One torchrun launch (world 4, gloo): Llama on TP 2 x PCP 2, DeepSeek-V3 on TP 4 x DCP 2
    and Qwen3 on TP 4; every rank's tokens equal transformers'."""
    runs = []
    for fam, (tp, dcp, pcp) in [("llama", (2, 1, 2)), ("deepseek_v3", (4, 2, 1)),
                                ("qwen3", (4, 1, 1))]:  # fmt: skip
        runs.append(serve_kwargs(saved[fam][0], tp, dcp, pcp))
    res = run(serve_grid_rank, 4, "torchrun", {"runs": runs}, dist_backend="gloo", report=False)
    for j, fam in enumerate(["llama", "deepseek_v3", "qwen3"]):
        want = [t for t, _ in saved[fam][2]]
        assert all(rank[j]["tokens"] == want for rank in res), fam


def test_serve_cli_on_a_folder(saved, tmp_path, capsys):
    """``python -m cpbook serve --model FOLDER``: ``--json`` request lines carry the prompt's
    ids and transformers' tokens; with ``tokenizer.json`` a ``--prompt`` prints text; a folder
    without ``config.json`` is one line naming the rule, exit 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from cpbook.__main__ import main

    folder, prompts, refs = saved["qwen3"]
    args = ["serve", "--model", folder, "--requests", "3", "--max-new-tokens", "4"]
    assert main([*args, "--dtype", "float64", "--dcp", "1", "--tp", "2", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines[:3]] == prompts
    assert [x["tokens"] for x in lines[:3]] == [t for t, _ in refs]
    assert main([*args, "--prompt", "hi"]) == 2
    assert "[serve-prompt-text]" in capsys.readouterr().err
    words = {f"w{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    (tmp_path / "tok").mkdir()
    for f in ("config.json", "model.safetensors"):
        (tmp_path / "tok" / f).write_bytes(open(f"{folder}/{f}", "rb").read())
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    text = " ".join(f"w{t}" for t in prompts[0])
    assert main(["serve", "--model", str(tmp_path / "tok"), "--prompt", text, "--json"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["prompt"] == prompts[0]
    assert line["text"] == " ".join(f"w{t}" for t in line["tokens"])
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cpbook: error: [hf-folder]") and "\n" not in err
