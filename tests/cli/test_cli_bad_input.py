"""Fresh-user findings on bad input to the commands beside ``run``: every one is refused with
a one-line error that names the file or the option, exit 2, never a traceback (as ``run``,
``eval`` and ``plan`` refuse theirs)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from hisparse_cli.main import app
from hisparse_cli.testing import one_line_error


def invoke(*args, **kwargs):
    return CliRunner().invoke(app, list(args), **kwargs)


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


@pytest.fixture
def haystack(monkeypatch):
    """Stop ``hisparse eval`` once its arguments are checked and its haystack read, keeping
    the texts (``read``) and the task lists (``read.tasks``); no model."""
    from hisparse_cli import eval_cmd
    from hisparse_cli import runner as runner_module

    class Read(list):
        tasks: list

    read = Read()
    read.tasks = []

    def run(model, base, configs, texts, tasks, *rest):
        read.append(texts)
        read.tasks.append(tasks)
        raise SystemExit(0)

    monkeypatch.setattr(eval_cmd, "_run", run)
    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)
    return read


def run_eval(tmp_path, *args):
    return invoke("eval", "--preset", "cpu", "-o", str(tmp_path / "out"), *args)


def test_eval_takes_the_options_its_haystack_hints_name(tmp_path, haystack):
    """Fresh-user finding: a latin-1 or binary haystack file was refused with "pass
    --errors replace ... or --encoding" / "pass --allow-binary", options eval did not have."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café au lait, an old document\n".encode("latin-1"))
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"text \x01\x02\x03\x04\x05 and bytes\n" * 20)

    result = run_eval(tmp_path, str(latin))
    one_line_error(result, "no readable haystack file")
    assert "--errors replace" in result.stderr and "--encoding" in result.stderr
    result = run_eval(tmp_path, str(binary))
    one_line_error(result, "no readable haystack file")
    assert "--allow-binary" in result.stderr

    assert run_eval(tmp_path, str(latin), "--encoding", "latin-1").exit_code == 0
    assert run_eval(tmp_path, str(latin), "--errors", "replace").exit_code == 0
    result = run_eval(tmp_path, str(binary), "--allow-binary")
    assert result.exit_code == 0, result.output
    assert f"warning: {binary}: looks binary" in " ".join(result.stderr.split())
    assert haystack == [
        ["café au lait, an old document\n"],
        ["caf\ufffd au lait, an old document\n"],
        ["text  and bytes\n" * 20],
    ]


def test_eval_refuses_an_unknown_encoding_before_reading(tmp_path, haystack):
    (tmp_path / "doc.txt").write_text("a document\n")
    result = run_eval(tmp_path, str(tmp_path / "doc.txt"), "--encoding", "klingon")
    one_line_error(result, "unknown --encoding 'klingon'")
    assert haystack == []


def test_eval_haystack_messages_name_no_standard_input_it_does_not_read(tmp_path, haystack):
    """The document reader's hint "pipe it to `hisparse run -`" is run's: eval reads files."""
    import os

    os.mkfifo(tmp_path / "pipe.txt")
    for doc in (str(tmp_path / "pipe.txt"), "-"):
        result = run_eval(tmp_path, doc)
        one_line_error(result, "no readable haystack file")
        assert "save the text to a file" in result.stderr
        assert "hisparse run" not in result.stderr
        assert "no bytes of standard input" not in result.stderr


def test_eval_tasks_all_beside_other_names_means_every_task(tmp_path, haystack):
    """Fresh-user finding: ``--tasks all,niah_single`` said "unknown task(s) all", though
    ``all`` is one of the listed values."""
    from engine.measure import ruler

    for tasks in ("all", "all,niah_single", "niah_single,all", "all,all"):
        result = run_eval(tmp_path, "--tasks", tasks)
        assert result.exit_code == 0, (tasks, result.output)
    assert haystack.tasks == [list(ruler.TASKS)] * 4
    one_line_error(run_eval(tmp_path, "--tasks", "all,niah_triple"), "unknown task(s) niah_triple")
    one_line_error(
        run_eval(tmp_path, "--tasks", "vt,niah_single,vt"), "--tasks: 'vt' is given twice"
    )


def test_quantize_says_a_file_is_not_the_model_folder_it_takes(tmp_path):
    """Fresh-user finding: ``hisparse quantize model.gguf out`` said "model folder not
    found: model.gguf", though the file is there: it is a file, and quantize takes a Hugging
    Face model folder."""
    model = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    out = tmp_path / "out"

    result = invoke("quantize", str(model), str(out), env={"COLUMNS": "60"})  # never wrapped
    one_line_error(result, f"{model} is a file, not a model folder", "Hugging Face model folder",
                   "a GGUF file needs no quantize step", "hisparse run --model")  # fmt: skip
    assert "not found" not in result.stderr
    result = invoke("quantize", str(tmp_path / "hf" / "config.json"), str(out))
    one_line_error(result, "is a file, not a model folder", f"holding it, {tmp_path / 'hf'}")
    result = invoke("quantize", str(tmp_path / "missing"), str(out))
    one_line_error(result, f"model folder not found: {tmp_path / 'missing'}")
    assert not out.exists()


def test_replay_names_a_file_that_is_not_a_trace_but_binary(tmp_path):
    """Fresh-user finding: ``hisparse replay binary.bin`` said only "'utf-8' codec can't
    decode byte 0xad ...", naming no file."""
    import json

    from engine.measure.trace import TraceHeader

    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes([0xAD, 0x00, 0xFF, 0x10]) * 64)
    result = invoke("replay", str(binary))
    one_line_error(result, f"{binary}: not a hisparse selection trace", "not UTF-8 text")
    assert "codec" not in result.stderr

    header = json.dumps(TraceHeader("m", 16, 64, 4, 2, 1).to_json()).encode()
    for gap in (b"\n", b"\n" * 20_000):  # binary bytes in the header's block, or later
        damaged = tmp_path / "damaged.jsonl"
        damaged.write_bytes(header + gap + bytes([0xAD, 0xFF]) * 64)
        result = invoke("replay", str(damaged))
        one_line_error(result, f"{damaged}: not a hisparse selection trace", "not UTF-8 text")


def test_eval_says_on_stderr_that_ctrl_c_stopped_it_and_what_was_written(tmp_path, monkeypatch):
    """Fresh-user finding: Ctrl-C in eval exited 130 without a word."""
    from hisparse_cli import eval_cmd, eval_report
    from hisparse_cli import runner as runner_module

    monkeypatch.setattr(runner_module, "free_cpu_threads", lambda config: None)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_cmd, "_run", interrupted)
    out = tmp_path / "out"
    result = run_eval(tmp_path)
    assert result.exit_code == 130, result.output
    err = " ".join(result.stderr.split())
    assert f"interrupted (Ctrl-C) before writing {out / 'eval.json'}: no result was written" in err
    assert "earlier run" not in err and not (out / "eval.json").exists()

    out.mkdir()
    earlier = '{"format": "hisparse-eval"}\n'  # an earlier run's, replaced only with --force
    (out / "eval.json").write_text(earlier)
    result = run_eval(tmp_path, "--force")
    assert result.exit_code == 130
    err = " ".join(result.stderr.split())
    assert "the eval.json there is an earlier run's, left as it was" in err
    assert (out / "eval.json").read_text() == earlier

    monkeypatch.setattr(eval_cmd, "_run", lambda *args: {"configs": [], "table": []})
    monkeypatch.setattr(eval_report, "heatmap", interrupted)  # Ctrl-C after eval.json
    result = run_eval(tmp_path, "--force")
    assert result.exit_code == 130
    err = " ".join(result.stderr.split())
    assert f"interrupted (Ctrl-C) after writing {out / 'eval.json'}" in err
    assert (out / "eval.json").read_text() != "{}\n"


@pytest.mark.parametrize("codec", ["base64", "rot13"])
def test_an_encoding_that_is_no_text_encoding_is_refused_by_run_and_eval(
    tmp_path, cli, docs, haystack, codec
):
    """``--encoding base64`` passed the codec lookup, then ``bytes.decode`` raised a
    LookupError traceback on the first document (run and eval alike)."""
    message = f"--encoding {codec!r} is not a text encoding"
    one_line_error(cli("docs/alpha.txt", "--encoding", codec), message)
    assert cli.factory.engines == []
    one_line_error(run_eval(tmp_path, str(docs / "alpha.txt"), "--encoding", codec), message)
    assert haystack == []


def flipped_gguf(path):
    """A GGUF file whose tokenizer string array has a corrupt length: 0xff bytes written
    over the second token's ``u64`` length (a flipped download), as at byte 20000 of the
    embedded model."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_token_list(["a", "bb", "ccc"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"bb") - 8
    data[at : at + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    return path, at


def test_run_refuses_a_gguf_with_a_corrupt_string_length_in_one_line(tmp_path):
    """Fresh-user finding: ``run --model flipped.gguf`` (0xff bytes inside the tokenizer's
    string array) gave an OverflowError traceback from the header reader's skip, exit 1,
    where ``plan`` said "not a readable GGUF file (GGUF string at byte N runs past ...)"."""
    from engine.weights.header import GGUFHeaderError, read_gguf_fields

    model, at = flipped_gguf(tmp_path / "flipped.gguf")
    (tmp_path / "doc.txt").write_text("hello\n")
    with pytest.raises(GGUFHeaderError, match=f"GGUF string at byte {at} runs past the end"):
        read_gguf_fields(model, {"general.architecture", "llama.context_length", "absent"})
    scores = tmp_path / "scores.gguf"  # an array of floats whose count is corrupt
    writer = gguf.GGUFWriter(str(scores), "llama")
    writer.add_array("tokenizer.ggml.scores", [0.0, 1.0, 2.0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = bytearray(scores.read_bytes())
    count = data.index(b"tokenizer.ggml.scores") + len("tokenizer.ggml.scores") + 4 + 4
    data[count : count + 8] = b"\xff" * 8
    scores.write_bytes(bytes(data))
    with pytest.raises(GGUFHeaderError, match=f"GGUF array at byte {count - 4} runs past"):
        read_gguf_fields(scores, {"absent"})
    result = invoke("run", "--model", str(model), str(tmp_path / "doc.txt"), "--preset", "cpu",
                    "-o", str(tmp_path / "out"))  # fmt: skip
    one_line_error(result, str(model), "not a readable GGUF file",
                   f"GGUF string at byte {at} runs past the end of the file")  # fmt: skip


def test_run_says_what_plan_says_of_a_gguf_cut_inside_its_metadata(tmp_path):
    """Fresh-user finding: ``head -c 1000000 SmolLM2-...gguf > trunc.gguf`` then ``run
    --model trunc.gguf`` said "... (unpack_from requires a buffer of at least 1000007 bytes
    for unpacking 8 bytes at offset 999999 ...)", Python's words, where ``plan`` said
    "truncated, its header runs past the end of the file"; ``run`` now says the same."""
    from tiny_models import build_hf, write_gguf  # imports transformers: only where needed

    model = build_hf(tmp_path / "hf", "llama", max_position_embeddings=1024)
    whole = write_gguf(tmp_path / "m.gguf", model, "llama").read_bytes()
    cut = tmp_path / "cut.gguf"  # a key read, its value type (4 bytes) cut after 2
    cut.write_bytes(whole[: whole.index(b"general.name") + len("general.name") + 2])
    (tmp_path / "doc.txt").write_text("hello\n")
    plan = invoke("plan", "-n", "2", "-c", "4K", "--model", str(cut))
    said = " ".join(plan.stderr.split()).removeprefix("error: ")
    assert plan.exit_code == 2 and "truncated, its header runs past the end" in said, said
    run = invoke("run", "--model", str(cut), str(tmp_path / "doc.txt"), "--preset", "cpu",
                 "-o", str(tmp_path / "out"))  # fmt: skip
    one_line_error(run, f"cannot load the model: {said}")
    assert "unpack" not in run.stderr and not (tmp_path / "out").exists()


def test_print_config_lists_a_gguf_whose_header_cannot_be_read(tmp_path):
    """Fresh-user finding: ``run --model flipped.gguf --print-config`` printed the config and
    exited 0, although the run is refused at the load; it now lists the refusal, and a run
    stops before the load with the same words."""
    model, at = flipped_gguf(tmp_path / "flipped.gguf")
    (tmp_path / "doc.txt").write_text("hello\n")
    result = invoke("run", "--model", str(model), str(tmp_path / "doc.txt"), "--preset", "cpu",
                    "-o", str(tmp_path / "out"), "--print-config")  # fmt: skip
    printed = json.loads(result.stdout)
    assert any(
        f"{model}: not a readable GGUF file" in p and f"GGUF string at byte {at}" in p
        for p in printed["problems"]
    ), printed.get("problems")
    assert not (tmp_path / "out").exists()


def test_print_config_lists_a_gguf_whose_tensor_data_is_cut_short(tmp_path):
    """Fresh-user finding: ``head -c 50000000 SmolLM2-...Q4_1.gguf > cut.gguf`` (the header
    whole, the tensor data cut short): ``run --print-config`` exited 0 with no problem,
    while ``run`` and ``plan`` refused it ("tensor blk.16.ffn_down.weight ... missing; the
    file is truncated"). --print-config now lists the load's tensor check (no torch), and
    a run stops before the load with the same words, in one line."""
    from tiny_models import build_hf, write_gguf  # imports transformers: only where needed

    whole = write_gguf(tmp_path / "m.gguf", build_hf(tmp_path / "hf", "llama"), "llama")
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])  # inside the tensor data, past the header
    (tmp_path / "doc.txt").write_text("hello\n")
    args = ("run", "--model", str(cut), str(tmp_path / "doc.txt"), "--preset", "cpu",
            "--max-new-tokens", "4", "-o", str(tmp_path / "out"))  # fmt: skip
    shown = invoke(*args, "--print-config")
    assert shown.exit_code == 0, shown.output
    problems = json.loads(shown.stdout).get("problems", [])
    said = f"cannot load the model: {cut}: tensor "
    assert any(said in p and "the file is truncated" in p for p in problems), problems
    run = invoke(*args)
    one_line_error(run, said, "missing); the file is truncated")
    assert "loading model" not in run.output and not (tmp_path / "out").exists()


def header_only_gguf(path, arch):
    """A GGUF file of ``arch`` with a context length and no tokenizer or tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(2048)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_run_names_an_unsupported_architecture_before_the_tokenizer(tmp_path):
    """Fresh-user finding: ``run --model falcon.gguf`` (no tokenizer in the file) said
    "tokenizer.ggml.model=None is not supported ... use TextTokenizer.from_folder", where
    ``plan`` names the architecture; and no message points a CLI user at a Python API."""
    from engine.load import load_tokenizer

    (tmp_path / "doc.txt").write_text("hello\n")
    falcon = header_only_gguf(tmp_path / "falcon.gguf", "falcon")
    result = invoke("run", "--model", str(falcon), str(tmp_path / "doc.txt"), "--preset", "cpu",
                    "-o", str(tmp_path / "out"))  # fmt: skip
    one_line_error(result, str(falcon), "general.architecture='falcon' is not supported",
                   "(supported: llama,")  # fmt: skip
    assert "tokenizer" not in result.stderr
    with pytest.raises(ValueError, match="general.architecture='falcon' is not supported"):
        load_tokenizer(str(falcon))  # what run uses to count long documents before the load

    llama = header_only_gguf(tmp_path / "llama.gguf", "llama")  # no tokenizer: that is named
    result = invoke("run", "--model", str(llama), str(tmp_path / "doc.txt"), "--preset", "cpu",
                    "-o", str(tmp_path / "out"))  # fmt: skip
    one_line_error(result, str(llama), "tokenizer.ggml.model=None is not supported",
                   "Hugging Face folder")  # fmt: skip
    assert "TextTokenizer" not in result.stderr and "from_folder" not in result.stderr


@pytest.mark.parametrize(
    ("files", "what"),
    [
        ((), "(it is empty"),
        (("tokenizer.json", "model.safetensors"), "(config.json is missing"),
        (("config.json", "pytorch_model.bin"), "tokenizer.json and *.safetensors are missing"),
        (("config.json", "tokenizer.json", "model-00001-of-00002.safetensors"), None),
        (("m.Q4_0.gguf",), "it holds m.Q4_0.gguf: give the file"),
    ],
)
def test_run_says_what_a_model_folder_needs_and_which_files_are_missing(tmp_path, files, what):
    """Fresh-user finding: ``run --model adir`` (an empty folder, or one without
    config.json) said only "no tokenizer.json in this model folder", after the model line.
    It is refused before anything loads (exit 2), naming what a model folder holds and
    which of it is missing, or that a GGUF file is expected."""
    from hisparse_cli.runner import UsageError, check_model_folder

    folder = tmp_path / "adir"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    if what is None:  # all three there (shards count): nothing to say before the load
        check_model_folder(folder)
        return
    with pytest.raises(UsageError) as info:
        check_model_folder(folder)
    assert what in str(info.value)
    (tmp_path / "doc.txt").write_text("hello\n")
    result = invoke("run", "--model", str(folder), str(tmp_path / "doc.txt"), "--preset", "cpu",
                    "-o", str(tmp_path / "out"))  # fmt: skip
    one_line_error(result, f"--model {folder}: not a model folder", what,
                   "a Hugging Face model folder holds config.json, tokenizer.json and its "
                   "weights as *.safetensors; or give a GGUF file")  # fmt: skip
    assert "loading model" not in result.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p: p.mkdir(), "not a model folder (it is empty"),
        (
            lambda p: (p.mkdir(), (p / "config.json").write_text("{}")),
            "not a model folder (tokenizer.json and *.safetensors are missing",
        ),
        (lambda p: p.write_text("hello, a text file\n"), "not a GGUF file (it starts with"),
        (lambda p: os.mkfifo(p), "not a regular file or a model folder"),
        (lambda p: None, "model not found"),
    ],
    ids=["empty-folder", "config-only", "text-file", "fifo", "missing"],
)
def test_eval_checks_its_model_as_run_does_before_anything_loads(tmp_path, haystack, make, what):
    """Fresh-user finding: `hisparse eval --model FOLDER` had no check of the model
    before the load: an empty folder, or one with only config.json, said "no
    tokenizer.json in this model folder" after torch's 7 s import, not what else was
    missing; a FIFO hung. Eval now checks --model with run's check (a folder's missing
    files, the GGUF magic, a missing path, a pipe): one error line, exit 2, before the
    model (here: eval's _run) is reached."""
    model = tmp_path / "adir"
    make(model)
    result = run_eval(tmp_path, "--model", str(model))
    one_line_error(result, f"{model}", what)
    assert haystack == []  # refused before _run, where the model loads
    assert not (tmp_path / "out").exists()
