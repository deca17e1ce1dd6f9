"""Shared pytest fixtures: the embedded model file, its tokenizer and the text corpus.

The corpus lives in ``shared/corpus`` beside the repository checkout (``../shared``);
set ``HISPARSE_CORPUS`` to use another folder. A test that takes a ``corpus_file``
argument runs once per ``*.txt`` file there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CORPUS_ENV = "HISPARSE_CORPUS"


def find_corpus_dir() -> Path:
    """``$HISPARSE_CORPUS``, else ``<checkout>/../shared/corpus``."""
    override = os.environ.get(CORPUS_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "shared" / "corpus"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "corpus_file" in metafunc.fixturenames:
        files = sorted(find_corpus_dir().glob("*.txt"))
        metafunc.parametrize("corpus_file", files, ids=[f.name for f in files])


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """Folder of the ``*.txt`` test documents (may be missing or empty)."""
    return find_corpus_dir()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (skips if not installed)."""
    from engine.weights.embedded import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smollm2_gguf_reader(smollm2_gguf_path: Path):
    """``gguf.GGUFReader`` on the embedded model (parsing takes ~3 s, so one per run)."""
    import gguf

    return gguf.GGUFReader(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_reader):
    """:class:`engine.text.tokenizer.TextTokenizer` of the embedded model."""
    from engine.text.tokenizer import TextTokenizer

    return TextTokenizer.from_gguf(smollm2_gguf_reader)


# --- kernels: Triton's interpreter for tests/test_kernels.py ---------------------------

KERNEL_TESTS = Path(__file__).with_name("test_kernels.py")


def pytest_configure(config: pytest.Config) -> None:
    _interpret_triton_for_kernel_tests(config)


def _interpret_triton_for_kernel_tests(config: pytest.Config) -> None:
    """Switch Triton's CPU interpreter on when ``test_kernels.py`` is part of the run on a
    machine without CUDA. It must be set before anything imports triton (kernels are
    decorated at import), hence here rather than in the module."""
    if "TRITON_INTERPRET" in os.environ or not _collects(config, KERNEL_TESTS):
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _collects(config: pytest.Config, target: Path) -> bool:
    """Whether the command-line paths (or the invocation folder) include ``target``."""
    here = config.invocation_params.dir
    args = [a.split("::")[0] for a in config.args if not a.startswith("-")] or [str(here)]
    for arg in args:
        path = (here / arg).resolve()
        if path == target.resolve() or path in target.resolve().parents:
            return True
    return False
