"""Fixtures of the CLI tests: ``cli`` runs ``hisparse run`` through Typer's CliRunner with a
scripted fake engine (:mod:`hisparse_cli.testing`), ``docs`` makes two small documents."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hisparse_cli import runner as runner_module
from hisparse_cli import settings, testing
from hisparse_cli.main import app


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """Run ``hisparse`` in ``tmp_path`` with a fake engine and an empty preset."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(settings, "preset_overrides", lambda name: {})
    monkeypatch.setattr(runner_module, "cuda_device_count", lambda: 0)  # --preset auto -> cpu
    monkeypatch.setattr(runner_module, "cuda_device_memory_gib", lambda index: 24.0)
    monkeypatch.setattr(runner_module, "warm_cuda", lambda config, marks: None)  # fake engine
    monkeypatch.setattr(runner_module, "import_engine_modules", lambda: None)  # no torch
    monkeypatch.setenv("HISPARSE_HOST_MEMORY_GB", "256")
    monkeypatch.setattr(
        runner_module, "free_cpu_threads", lambda config: None
    )  # not this box's load  # host-pool checks: not this machine's
    factory = testing.fake_engine_factory()
    monkeypatch.setattr(runner_module, "load_engine", factory)

    def no_tokenizer(config, model):  # the fake engines' tokenizers are not the model's
        raise RuntimeError("no tokenizer before the load in these tests")

    monkeypatch.setattr(runner_module, "load_tokenizer", no_tokenizer)

    def invoke(*args, engine=None, **kwargs):
        if engine is not None:
            monkeypatch.setattr(runner_module, "load_engine", engine)
        return CliRunner().invoke(app, ["run", *args], catch_exceptions=False, **kwargs)

    invoke.factory = factory
    return invoke


@pytest.fixture
def docs(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "alpha.txt").write_text("The alpha document talks about sorting.\n")
    (tmp_path / "docs" / "beta.txt").write_text("Beta is about graphs and trees.\n")
    return tmp_path / "docs"
