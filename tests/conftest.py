"""Shared pytest fixtures: the embedded model file, its tokenizer and the text corpus.

The corpus lives in ``shared/corpus`` beside the repository checkout (``../shared``);
set ``HISPARSE_CORPUS`` to use another folder. Where neither exists (a clone anywhere
else), the tests use the repository's ``examples/`` folder, which carries
``howto-sorting.txt``, the document the real-model tests read. A test that takes a
``corpus_file`` argument runs once per ``*.txt`` file there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CORPUS_ENV = "HISPARSE_CORPUS"


def find_corpus_dir() -> Path:
    """``$HISPARSE_CORPUS``, else ``<checkout>/../shared/corpus`` where it exists, else the
    checkout's ``examples/`` (its bundled corpus document)."""
    override = os.environ.get(CORPUS_ENV)
    if override:
        return Path(override)
    shared = Path(__file__).resolve().parents[2] / "shared" / "corpus"
    if shared.is_dir():
        return shared
    return Path(__file__).resolve().parents[1] / "examples"


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
    """``gguf.GGUFReader`` on the embedded model, as the engine opens it
    (:class:`engine.weights.gguf_reader.FastGGUFReader`; one per run)."""
    from engine.weights.gguf_reader import FastGGUFReader

    return FastGGUFReader(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_reader):
    """:class:`engine.text.tokenizer.TextTokenizer` of the embedded model."""
    from engine.text.tokenizer import TextTokenizer

    return TextTokenizer.from_gguf(smollm2_gguf_reader)


# --- kernels: Triton's interpreter for tests/kernels/test_kernels.py ---------------------------

KERNEL_TESTS = (
    Path(__file__).parent / "kernels" / "test_kernels.py",
    Path(__file__).parent / "kernels" / "test_superpage_select.py",
)


def pytest_configure(config: pytest.Config) -> None:
    _interpret_triton_for_kernel_tests(config)
    # the CPU LM head's recorded choice (engine.weights.quant.lm_head_record_path): each
    # test process measures its own, never reading or writing the user's cache
    if "HISPARSE_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["HISPARSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="hisparse-test-cache-")


def _interpret_triton_for_kernel_tests(config: pytest.Config) -> None:
    """Switch Triton's CPU interpreter on when a :data:`KERNEL_TESTS` file is part of the run on a
    machine without CUDA. It must be set before anything imports triton (kernels are
    decorated at import), hence here rather than in the module."""
    collects = any(_collects(config, path) for path in KERNEL_TESTS)
    if "TRITON_INTERPRET" in os.environ or not collects:
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


# --- slow tests: marked here, not in each file (scripts/test.sh --fast leaves them out) ---

MODEL_PATH_FIXTURE = "smollm2_gguf_path"
VOCABULARY_ONLY = {"smollm2_gguf_reader"}
"""Fixtures that take the embedded model's path but read only its metadata and vocabulary
(once per session), never the weights: their users are not slow on that account."""
MODEL_FIXTURES = {("test_bench.py", "tiny"), ("test_workers.py", "single")}
"""(file, fixture) that load from the embedded model's file without taking its path
fixture (``tiny`` builds a synthetic model with the embedded model's tokenizer; ``single``
loads the embedded model, and the worker fixtures built on it start engines of it)."""
SLOW_TESTS = (
    "test_bench.py::test_pretokenized_corpus_needs_no_tokenizer",  # 5 s
    "test_kv_cache.py::test_cache_state_machine",  # hypothesis state machine, 11 s
    "test_measure_memory.py::test_cpu_pipeline_measures_each_stage",  # 2 processes, 59 s
    "test_measure_memory.py::test_dry_run_plans_every_gpu_scenario",  # a process, 6 s
    "test_tokenizer.py::test_min_tokens_is_unknown_where_text_may_shrink",  # 5 s
    "test_slow_marks.py",  # inner pytest runs, 10-20 s
    "test_cli_eval.py::test_eval_table_and_answers_equal_engine_runs",  # tiny model, 15-25 s
    "test_cli_extract.py::test_fields_run_end_to_end_gives_the_parsed_object",  # synthetic:tiny
    "test_gguf_llamacpp.py",  # llama.cpp quantises, then runs twice per type: 5-8 s each
)
"""Node ids (or their prefixes, e.g. a parametrized test's name) measured over ~5 s on a
shared 2-core box (``--durations``, OMP_NUM_THREADS=1) that load no model fixture."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that loads or runs the real embedded model (through a
    fixture that takes ``smollm2_gguf_path``, other than the vocabulary-only ones, or
    through :data:`MODEL_FIXTURES`) and every test in :data:`SLOW_TESTS`."""
    for item in items:
        if _loads_the_model(item) or _listed_slow(item):
            item.add_marker(pytest.mark.slow)


def _loads_the_model(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a Python test function
        return False
    if MODEL_PATH_FIXTURE in info.argnames:
        return True
    for name in item.fixturenames:
        for fixture in info.name2fixturedefs.get(name, ())[-1:]:
            where = Path(fixture.func.__code__.co_filename).name
            if (where, name) in MODEL_FIXTURES:
                return True
            if MODEL_PATH_FIXTURE in fixture.argnames and name not in VOCABULARY_ONLY:
                return True
    return False


def _listed_slow(item: pytest.Item) -> bool:
    node = item.nodeid.rsplit("/", 1)[-1]  # test_x.py::test_y[param] or ::Class::method
    return any(node == s or node.startswith((s + "[", s + "::")) for s in SLOW_TESTS)  # noqa: E501


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A marker filter that leaves nothing to run here (``-m "not cuda"`` over a file of
    CUDA tests) is not a failure: exit 0 instead of 5, saying so. Nothing collected at
    all (a wrong path) stays exit 5."""
    deselected = session.config.pluginmanager.get_plugin("terminalreporter")
    count = len(deselected.stats.get("deselected", ())) if deselected is not None else 0
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and count:
        session.exitstatus = pytest.ExitCode.OK
        if deselected is not None:
            deselected.write_line(f"all {count} test(s) here were deselected by -m; nothing to run")


# --- signals: every test starts as from a terminal --------------------------------------------


@pytest.fixture(autouse=True)
def _terminal_sigint():
    """SIGINT raises ``KeyboardInterrupt`` (Python's own handler) during each test, as in a
    terminal. A shell that starts the suite in the background (``scripts/test.sh &`` from a
    script) hands it down ignored, and ``hisparse run`` rightly keeps an inherited
    ``SIG_IGN``: the tests that send themselves a Ctrl-C then saw a run finish (exit 0).
    The tests of the inherited ``SIG_IGN`` set it themselves (``sigint_ignored``)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
