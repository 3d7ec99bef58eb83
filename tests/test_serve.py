"""``python -m cpbook serve``: requests from ``--input FILE|-`` (cpbook/cli/requests.py), the
model's position limit enforced in the engine and the command, and a non-zero exit naming how
many requests were refused when none was served."""

from __future__ import annotations

import io
import json

import pytest

from cpbook.__main__ import main
from cpbook.cli.requests import read_requests
from cpbook.engine.engine import Engine, make_prompts
from cpbook.engine.models import TinyModel, reference_generate
from tests.hf_models import build

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny Llama folder whose ``max_position_embeddings`` is 64, with a word-level
    ``tokenizer.json`` (``"w5 w7"`` -> ``[5, 7]``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("llama")
    build("llama", folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def serve_json(argv: list[str], capsys) -> tuple[int, list[dict], str]:
    code = main(["serve", *argv, "--json"])
    out = capsys.readouterr()
    return code, [json.loads(x) for x in out.out.splitlines()], out.err


def write_lines(tmp_path, *lines) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_engine_refuses_a_request_past_max_position_embeddings(llama):
    """64 positions: 56 + 8 tokens are served, 60 + 8 are refused alone before any step, with
    the rule (and not for the cache: 200 blocks hold it)."""
    eng = Engine(llama, cache_config=dict(num_gpu_blocks=200), runner_config=dict(seed=0))
    long = eng.add_request(list(range(60)), 8)
    assert eng.output(long).error.startswith("[request-fits-model] requires prompt + max_new")
    assert "tokens=68, max_model_len=64" in eng.output(long).error
    assert not eng.has_unfinished and eng.history == []  # refused before any step
    ok = eng.generate([list(range(56))], 8)[0]
    assert ok.error is None and len(ok.tokens) == 8
    assert eng.output(long).tokens == ()


def test_serve_refuses_past_the_limit_and_serves_the_rest(llama, tmp_path, capsys):
    path = write_lines(
        tmp_path,
        {"prompt": list(range(60)), "max_new_tokens": 8, "id": "long"},
        {"prompt": "w5 w7 w9", "max_new_tokens": 3, "id": "text"},
    )
    code, lines, _ = serve_json(["--model", llama, "--input", path], capsys)
    assert code == 0
    assert [x["id"] for x in lines[:2]] == ["long", "text"]
    assert lines[0]["error"].startswith("[request-fits-model]") and lines[0]["tokens"] == []
    assert "request_id='long'" in lines[0]["error"]
    assert lines[1]["prompt"] == [5, 7, 9] and len(lines[1]["tokens"]) == 3
    assert lines[1]["text"] == " ".join(f"w{t}" for t in lines[1]["tokens"])
    assert lines[-1]["refused"] == 1 and lines[-1]["requests"] == 2


def test_every_request_refused_exits_2_and_says_how_many(capsys):
    """3 KV blocks hold no request: each line shows its refusal, then one error line, exit 2."""
    argv = ["--model", "tiny-gqa", "--requests", "3", "--num-kv-blocks", "3"]
    code, lines, err = serve_json(argv, capsys)
    assert code == 2
    assert all(x["error"].startswith("[request-fits-cache]") for x in lines[:3])
    assert err == (
        "cpbook: error: [serve-some-request] requires at least one request the model and the KV "
        "cache can hold (each refusal above); got refused=3, requests=3\n"
    )
    assert main(["serve", "--model", "tiny-gqa", "--requests", "3", "--num-kv-blocks", "3"]) == 2
    assert "3 of 3 requests refused" in capsys.readouterr().out


def test_input_lines_are_served_and_bad_ones_skipped_with_their_line_number(tmp_path, capsys):
    """Token-id prompts from a file, per-line ``max_new_tokens`` and ids; each bad line is
    reported with its line number and rule and skipped; the tokens equal the reference."""
    prompts = make_prompts(2, 3)
    path = write_lines(
        tmp_path,
        {"prompt": prompts[0], "max_new_tokens": 3, "id": "a"},
        "not json",
        {"prompt": "some text"},
        "",
        {"prompt": [1, 2], "temperature": 0.5},
        {"prompt": [1, 200]},
        {"prompt": [1, 2], "max_new_tokens": 0},
        {"prompt": [3, 4], "id": "a"},
        {"prompt": prompts[1], "id": 7},
        {"prompt": []},
    )
    code, lines, err = serve_json(
        ["--model", "tiny-gqa", "--input", path, "--max-new-tokens", "2"], capsys
    )
    assert code == 0
    model = TinyModel.from_name("tiny-gqa")
    assert [(x["id"], x["tokens"]) for x in lines[:2]] == [
        ("a", reference_generate(model, prompts[0], 3)),
        ("7", reference_generate(model, prompts[1], 2)),
    ]
    assert lines[2]["name"] == "engine_summary" and lines[2]["requests"] == 2
    rules = [
        (line.split("line=")[1].split(",")[0], line.split("]")[0].split("[")[1])
        for line in err.splitlines()
    ]
    assert rules == [
        ("2", "serve-input-json"),
        ("3", "serve-prompt-text"),
        ("5", "serve-input-fields"),
        ("6", "serve-input-prompt"),
        ("7", "serve-input-max-new-tokens"),
        ("8", "serve-input-id"),
        ("10", "serve-input-prompt"),
    ]
    assert all(
        line.startswith(f"cpbook: skipped: [{r}]") for line, (_, r) in zip(err.splitlines(), rules)
    )
    assert main(["serve", "--model", "tiny-gqa", "--input", path, "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpbook: error: [serve-input-json] requires a JSON object per line; ")
    assert f"input='{path}', line=2" in err and err.count("\n") == 1


def test_input_from_stdin_and_text_output(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": [5, 6, 7], "max_new_tokens": 2}\n'))
    assert main(["serve", "--model", "tiny-gqa", "--input", "-"]) == 0
    out = capsys.readouterr().out.splitlines()
    want = reference_generate(TinyModel.from_name("tiny-gqa"), [5, 6, 7], 2)
    assert out[1] == f"  request 1: prompt   3 tokens -> {want}"


def test_no_valid_line_is_an_error(tmp_path, capsys):
    path = write_lines(tmp_path, "[1, 2]")
    assert main(["serve", "--model", "tiny-gqa", "--input", path]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("cpbook: skipped: [serve-input-json] requires a JSON object per line")
    assert err[1].startswith("cpbook: error: [serve-input-empty]")
    assert main(["serve", "--model", "tiny-gqa", "--input", str(tmp_path / "nope")]) == 2
    assert "[serve-input-file]" in capsys.readouterr().err


def test_autotokenizer_from_tokenizer_config(llama, tmp_path):
    """A folder with ``tokenizer_config.json`` is read by transformers' AutoTokenizer."""
    import shutil

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from cpbook.cli.requests import load_tokenizer

    folder = tmp_path / "m"
    shutil.copytree(llama, folder)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    fast.save_pretrained(folder)
    codec = load_tokenizer(str(folder))
    assert codec.hf and isinstance(codec.tokenizer, type(AutoTokenizer.from_pretrained(folder)))
    good, bad = read_requests(['{"prompt": "w3 w4"}'], "-", 128, 2, codec)
    assert bad == [] and good[0].prompt == [3, 4]


def test_workload_takes_one_budget_and_id_per_prompt():
    from cpbook.engine.config import ServeWorkload

    ServeWorkload(prompts=[[1], [2]], max_new_tokens=[1, 2], request_ids=["a", "b"])
    with pytest.raises(ValueError, match=r"\[workload-per-prompt\].*max_new_tokens=2"):
        ServeWorkload(prompts=[[1]], max_new_tokens=[1, 2])
    with pytest.raises(ValueError, match=r"\[workload-per-prompt\].*request_ids=2"):
        ServeWorkload(prompts=[[1]], request_ids=["a", "b"])
    with pytest.raises(ValueError, match=r"\[positive-sizes\]"):
        ServeWorkload(num_requests=2, max_new_tokens=[0, 1])
