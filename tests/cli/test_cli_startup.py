"""Commands that load no model start without torch (a second or two saved each), and
``run --print-config`` resolves the config without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import sys
    from typer.testing import CliRunner
    from hisparse_cli import runner
    from hisparse_cli.main import app

    runner.no_gpu_driver = lambda: True  # as on a machine without a GPU driver
    for args in (["--help"], ["--version"], ["presets"], ["presets", "show", "cpu"],
                 ["plan", "-n", "4", "-c", "32K"], ["run", "--help"],
                 ["run", "--preset", "cpu", "--print-config", "README.md"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    print(sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules))
    """
)


def test_help_presets_plan_and_print_config_import_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_no_gpu_driver_follows_the_driver_nodes(monkeypatch):
    from hisparse_cli import runner

    monkeypatch.setattr(runner.sys, "platform", "linux")
    monkeypatch.setattr(runner.os.path, "exists", lambda p: False)
    assert runner.no_gpu_driver() and runner.cuda_device_count() == 0
    monkeypatch.setattr(runner.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert not runner.no_gpu_driver()
