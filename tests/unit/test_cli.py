"""The `kvserve` command line as a newcomer meets it: an unknown flag gets its own command's usage, a closed pipe
ends it quietly, and a batch's outputs say which prompt each belongs to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.cli import _generated_text, main
from kvserve.outputs import CompletionOutput, RequestOutput


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["serve", "--no-such-flag"], "usage: kvserve serve"),
        (["bench", "throughput", "--no-such-flag"], "usage: kvserve bench throughput"),
        (["estimate", "--no-such-flag"], "usage: kvserve estimate"),
    ],
)
def test_an_unknown_flag_gets_its_commands_usage(argv: list[str], usage: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and usage in err and "unrecognized arguments: --no-such-flag" in err


def test_a_reader_that_leaves_ends_the_command_quietly() -> None:
    """`kvserve estimate --list-models | head -1`: no BrokenPipeError traceback, exit status 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "estimate", "--list-models"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"name")
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err


def _output(prompt: str, *texts: str) -> RequestOutput:
    samples = [CompletionOutput(i, text, [], None, None, "length") for i, text in enumerate(texts)]
    return RequestOutput("r", prompt, [2], None, samples, True)


def test_one_output_is_printed_as_it_is_and_a_batch_under_headers() -> None:
    assert _generated_text([_output("Hi", " there")], echo=False) == " there"
    assert _generated_text([_output("Hi", " there")], echo=True) == "Hi there"
    batch = _generated_text([_output("Hello", ", you"), _output("The sky is", " blue", " grey")], echo=False)
    assert batch.split("\n") == [
        "=== prompt 1 of 2: 'Hello' ===",
        ", you",
        "=== prompt 2 of 2, completion 1 of 2: 'The sky is' ===",
        " blue",
        "=== prompt 2 of 2, completion 2 of 2: 'The sky is' ===",
        " grey",
    ]


def test_the_top_level_help_names_every_api_serve_serves(capsys) -> None:
    """`kvserve --help` described serve as completions and chat only: the Responses and Messages APIs were missing."""
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = " ".join(capsys.readouterr().out.split())
    assert "Responses" in listing and "Messages" in listing
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve_help = " ".join(capsys.readouterr().out.split())
    assert "/v1/responses" in serve_help and "/v1/messages" in serve_help
