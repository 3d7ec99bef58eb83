"""Layer 11, the command line: ``python -m cpbook demo NAME --world-size N [--backend
inline|torchrun]``.

``python -m cpbook serve --model tiny-gqa --tp T --dcp D --pcp P [--json]`` serves generated
prompts with the chapter 9 engine on ``T·P`` ranks (inline, or ``--backend torchrun``, or
started by ``torchrun --nproc-per-node T·P -m cpbook serve ...``).  ``--device cuda:0`` puts
simulated ranks on one GPU; under torchrun each rank's device follows its dist backend.
``--model FOLDER`` serves a Hugging Face checkpoint (:func:`cpbook.engine.hf.from_pretrained`);
with the folder's ``tokenizer.json`` and the ``tokenizers`` extra, ``--prompt TEXT`` is
encoded and the output printed as text; ``--json`` request lines carry the prompt's token ids.
``--input FILE|-`` serves JSON lines of requests (:mod:`.requests`; bad lines skipped with
their line number, ``--strict`` stops); when every request is refused, ``serve`` exits 2.
``--spec ngram|draft --num-spec-tokens K`` serves with speculative decoding (chapter 10;
``--draft-model`` an engine model name or folder) and adds the acceptance rate and the mean
tokens per decode step to the summary.

``python -m cpbook plan --model DeepSeek-V3 --gpu H200 --gpus 8 --context 1M --output 1K
--concurrency 16 [--ttft 10s] [--tpot 50ms] [--hf-config PATH] [--json]`` prints the
deployment planner's ``vllm serve`` line, its top layouts and why
(:func:`cpbook.planner.plan.plan`).

Under torchrun (``torchrun --nproc-per-node N -m cpbook demo NAME``) the processes torchrun
started run the demo directly; rank 0 prints the deterministic report.  Errors print one line,
``cpbook: error: [rule] requires …; got …``, and exit with status 2 (``--debug``: the traceback).

One module per sub-command (:mod:`.demo`, :mod:`.serve`, :mod:`.plan`: its parser and its
command), the options they share in :mod:`.options`; :func:`main` parses and dispatches.  A
sub-command's module is imported only when it runs (or for ``--help`` of the whole command
line): ``plan`` needs no torch, and ``python -m cpbook plan`` imports none.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

__all__ = ["build_parser", "main"]

_RULE = re.compile(r"(\[[\w-]+\] requires .*)")
_DESCRIPTION = (
    "Command line: ``python -m cpbook demo NAME --world-size N [--backend inline|torchrun]``."
)
_COMMANDS = ("demo", "serve", "plan")


def _module(cmd: str):
    """The sub-command's module, imported now (``cpbook.cli.demo`` and ``serve`` import torch)."""
    return importlib.import_module(f"cpbook.cli.{cmd}")


def build_parser(commands: tuple[str, ...] = _COMMANDS) -> argparse.ArgumentParser:
    """The ``python -m cpbook`` parser with ``commands`` (default: all three sub-commands)."""
    p = argparse.ArgumentParser(prog="python -m cpbook", description=_DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd in commands:
        _module(cmd).add_parser(sub)
    return p


def _requested(argv: list[str]) -> tuple[str, ...]:
    """The one sub-command ``argv`` names first, or all of them (``--help``, a typo)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return (first,) if first in _COMMANDS else _COMMANDS


def _root_message(e: BaseException) -> str:
    """The ``[rule] requires …`` line behind ``e`` (its cause chain, or a rank's traceback)."""
    while e is not None:
        if isinstance(e, ValueError):
            return str(e)
        found = _RULE.findall(str(e))
        if found:
            return found[-1]
        e = e.__cause__
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; its exit status.  An error prints one line, ``cpbook: error: …``
    (the rule behind it where there is one), and returns 2; ``--debug`` re-raises it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser(_requested(argv))
    a = p.parse_args(argv)
    try:
        return _module(a.cmd).command(a, p)
    except BrokenPipeError:  # the reader closed our stdout (``| head``): stop quietly, exit 0
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - one line for a command-line user, all with --debug
        if a.debug:
            raise
        msg = _root_message(e) or f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"cpbook: error: {msg}", file=sys.stderr)
        return 2
