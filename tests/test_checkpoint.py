"""cpbook.engine.checkpoint: a Hugging Face folder is checked against its config.json before any
weight is read, and ``serve`` says what is wrong in one line naming the rule, the file and the
tensor (exit 2, no ``--debug``)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from cpbook.__main__ import main
from cpbook.core.config import ConfigError
from cpbook.engine.checkpoint import expected_tensors, read_header
from cpbook.engine.hf import check_folder, from_pretrained, hf_config, max_model_len
from tests.hf_models import build

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (``max_position_embeddings=64``) in one file and sharded in several."""
    root = tmp_path_factory.mktemp("ckpt")
    model = build("llama", root / "one")
    model.save_pretrained(root / "many", max_shard_size="40KB")
    return {"one": root / "one", "many": root / "many"}


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def serve_error(folder: Path, capsys) -> str:
    """``serve --model folder``'s one stderr line (asserting exit 2 and one line)."""
    assert main(["serve", "--model", str(folder), "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def edit_config(folder: Path, **change) -> None:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **change}))


def test_every_tensor_is_what_the_config_implies(folders):
    """The check passes on a whole checkpoint, sharded or not, and names every tensor."""
    for folder in folders.values():
        raw, cfg, _, where = check_folder(folder)
        want = expected_tensors(cfg, raw)
        assert set(where) == {k for k, (_, required) in want.items() if required or k in where}
    assert set(check_folder(folders["many"])[3].values()) == {
        p.name for p in folders["many"].glob("*.safetensors")
    }


@pytest.mark.parametrize(
    ("change", "tensor", "expected", "found"),
    [
        ({"hidden_size": 64}, "model.embed_tokens.weight", [128, 64], [128, 48]),
        ({"num_key_value_heads": 4}, "model.layers.0.self_attn.k_proj.weight", [64, 48], [32, 48]),
        ({"intermediate_size": 96}, "model.layers.0.mlp.gate_proj.weight", [96, 48], [64, 48]),
    ],
    ids=["hidden", "kv-heads", "mlp"],
)
def test_a_shape_that_disagrees_with_the_config_is_one_line(
    folders, tmp_path, capsys, change, tensor, expected, found
):
    folder = copy(folders["one"], tmp_path / "m")
    edit_config(folder, **change)
    err = serve_error(folder, capsys)
    assert err.startswith("cpbook: error: [checkpoint-shape] requires each tensor's shape")
    assert f"file='model.safetensors', tensor='{tensor}'" in err
    assert f"expected={expected}, found={found}" in err


def test_a_truncated_file_names_the_file_and_the_tensor(folders, tmp_path, capsys):
    folder = copy(folders["one"], tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    err = serve_error(folder, capsys)
    assert err.startswith("cpbook: error: [safetensors-data] requires every tensor's bytes inside")
    assert "file='model.safetensors', tensor='model." in err and "data_bytes=" in err


@pytest.mark.parametrize(
    ("corrupt", "says"),
    [
        (lambda d: d[:8] + b"#" * 16 + d[24:],
         "requires a JSON header; got file='model.safetensors'"),
        (lambda d: struct.pack("<Q", len(d)) + d[8:], "requires a header that fits in the file"),
        (lambda d: d[:5], "requires 8 bytes of header length"),
    ],
    ids=["json", "length", "stub"],
)  # fmt: skip
def test_a_corrupted_header_names_the_file(folders, tmp_path, capsys, corrupt, says):
    folder = copy(folders["one"], tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    err = serve_error(folder, capsys)
    assert err.startswith("cpbook: error: [safetensors-header] " + says), err


def test_the_index_is_checked_against_the_files(folders, tmp_path, capsys):
    folder = copy(folders["many"], tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    err = serve_error(folder, capsys)
    assert err.startswith(
        "cpbook: error: [checkpoint-index] requires every file the index names in the folder; "
        f"got file='{shard}', tensor="
    )
    folder = copy(folders["many"], tmp_path / "m2")
    name, file = sorted(index["weight_map"].items())[0]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != file)
    index["weight_map"][name] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    err = serve_error(folder, capsys)
    assert "[checkpoint-index] requires each tensor in the file the index names" in err
    assert f"file='{other}', tensor='{name}'" in err
    (folder / "model.safetensors.index.json").write_text("{not json")
    assert "[checkpoint-index] requires a JSON index with a weight_map" in serve_error(
        folder, capsys
    )


def resave(folder: Path, edit) -> None:
    sd = load_file(str(folder / "model.safetensors"))
    edit(sd)
    save_file(sd, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda sd: sd.pop("model.norm.weight"),
         "[checkpoint-tensors] requires every tensor config.json implies; got "
         "file='model.safetensors', tensor='model.norm.weight', expected=[48]"),
        (lambda sd: sd.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2)}),
         "[checkpoint-tensors] requires only tensors config.json implies; got "
         "file='model.safetensors', tensor='model.layers.2.mlp.up_proj.weight'"),
        (lambda sd: sd.update({"model.norm.weight": torch.zeros(48, dtype=torch.int32)}),
         "[checkpoint-dtype] requires a float tensor (F16, BF16, F32, F64); got "
         "file='model.safetensors', tensor='model.norm.weight', dtype='I32'"),
    ],
    ids=["missing", "unexpected", "dtype"],
)  # fmt: skip
def test_names_and_dtypes_are_checked(folders, tmp_path, capsys, edit, says):
    folder = copy(folders["one"], tmp_path / "m")
    resave(folder, edit)
    assert serve_error(folder, capsys).startswith(f"cpbook: error: {says}")
    with pytest.raises(ConfigError, match=r"\[checkpoint-"):
        from_pretrained(folder)


def test_read_header_reads_only_the_header(folders):
    header = read_header(folders["one"] / "model.safetensors")
    assert header["model.embed_tokens.weight"]["shape"] == [128, 48]
    assert header["model.embed_tokens.weight"]["dtype"] == "F64"


def test_a_config_that_is_not_json_names_the_file(folders, tmp_path, capsys):
    folder = copy(folders["one"], tmp_path / "m")
    (folder / "config.json").write_text("not json")
    err = serve_error(folder, capsys)
    assert err.startswith("cpbook: error: [hf-config-json] requires config.json to be a JSON")
    assert str(folder / "config.json") in err


def test_max_model_len_follows_vllm():
    """vLLM v0.34.0's ``_get_and_verify_max_len``: ``max_position_embeddings`` (2048 when
    absent), times the RoPE factor only for types whose length does not include it already."""
    base = {"max_position_embeddings": 64}
    assert max_model_len(base) == 64
    assert max_model_len({}) == 2048
    for kind in ("llama3", "yarn"):
        assert max_model_len({**base, "rope_parameters": {"rope_type": kind, "factor": 4.0}}) == 64
    assert max_model_len({**base, "rope_scaling": {"type": "linear", "factor": 4.0}}) == 256
    assert max_model_len({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2}}) == 128


def test_the_loaded_config_carries_the_limit(folders):
    raw = json.loads((folders["one"] / "config.json").read_text())
    assert hf_config(raw)[0].max_model_len == 64


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(min_value=0, max_value=10**9))
def test_any_truncation_is_a_named_rule(folders, tmp_path_factory, cut):
    """A safetensors file cut anywhere short of its end fails the header check with one of the
    two named rules — never a raw exception, never a partial load."""
    data = (folders["one"] / "model.safetensors").read_bytes()
    path = tmp_path_factory.mktemp("cut") / "model.safetensors"
    path.write_bytes(data[: cut % len(data)])
    with pytest.raises(ConfigError, match=r"^\[safetensors-(header|data)\] .*file='model"):
        read_header(path)
