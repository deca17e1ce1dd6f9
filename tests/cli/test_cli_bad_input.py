"""Fresh-user findings on bad input to the commands beside ``run``: every one is refused with
a one-line error that names the file or the option, exit 2, never a traceback (as ``run``,
``eval`` and ``plan`` refuse theirs)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from hisparse_cli.main import app


def invoke(*args, **kwargs):
    return CliRunner().invoke(app, list(args), **kwargs)


def one_line_error(result, *words):
    """Exit 2, one ``error:`` line naming ``words``, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    text = " ".join(result.stderr.split())
    assert "Traceback" not in result.output and "Traceback" not in text
    for word in words:
        assert word in text, text


def truncated_gguf(path):
    """A GGUF file whose tensor data is cut off (an interrupted download)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    return path


@pytest.mark.parametrize(
    ("name", "make", "words"),
    [
        ("some.txt", lambda p: p.write_text("hello, a text file\n"), ["not a GGUF file"]),
        ("small.bin", lambda p: p.write_bytes(bytes(range(100))), ["not a GGUF file"]),
        ("cut.gguf", truncated_gguf, ["cannot load the model", "truncated"]),
    ],
)
def test_bench_refuses_a_model_that_is_not_a_gguf_file_in_one_line(tmp_path, name, make, words):
    model = tmp_path / name
    make(model)
    result = invoke(
        "bench", "--model", str(model), "--contexts", "2K", "--concurrency", "1",
        "--memory-budget", "2", "--preset", "cpu", "--out", str(tmp_path / "bench"),
    )  # fmt: skip
    one_line_error(result, str(model), *words)
    assert not (tmp_path / "bench").exists()
