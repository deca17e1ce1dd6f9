"""``hisparse run --audit N``: the results line's ``audit`` field, the flag and its
warning, the dashboard's running figure (scripted fake engine; the engine side is
tests/engine/test_audit.py)."""

from __future__ import annotations

from engine.events import AuditStep
from hisparse_cli.dashboard import render_dashboard
from hisparse_cli.progress import ProgressTracker
from hisparse_cli.results import read_results as _read


def read_results(out):
    return {r["id"]: r for r in _read(out / "results.jsonl").latest.values()}


def test_audit_reaches_the_results_line_and_flags_a_bad_job(cli, docs, tmp_path, monkeypatch):
    from hisparse_cli import testing

    factory = testing.fake_engine_factory(audit_disagree={"beta"})
    result = cli(
        "docs/alpha.txt", "docs/beta.txt", "--max-new-tokens", "20", "--audit", "4",
        "--audit-seed", "3", engine=factory,
    )
    assert result.exit_code == 0, result.output  # flagged, not failed: the text is there
    assert factory.engines[0].config.audit_steps == 4
    assert factory.engines[0].config.audit_seed == 3
    records = read_results(tmp_path / "hisparse-out")
    alpha, beta = records["alpha"]["audit"], records["beta"]["audit"]
    assert alpha["steps"] == 4 and alpha["top1_agreement"] == 1.0 and not alpha["flagged"]
    assert alpha["kl_mean"] == 0.01 and alpha["mass_kept_mean"] == 0.95
    assert beta["steps"] == 4 and beta["top1_agreement"] == 0.0 and beta["flagged"]
    assert "top-1 agreement with dense 0% < 75%" in beta["flag_reason"]
    assert "beta: audit flagged over 4 step(s)" in result.output
    assert "alpha: audit flagged" not in result.output


def test_audit_thresholds_and_off_by_default(cli, docs, tmp_path):
    result = cli("docs/alpha.txt", "--max-new-tokens", "6")
    assert "audit" not in read_results(tmp_path / "hisparse-out")["alpha"]
    result = cli(
        "docs/alpha.txt", "--max-new-tokens", "6", "--audit", "2", "--force",
        "--audit-min-agreement", "0", "--audit-max-kl", "0.001",
    )
    audit = read_results(tmp_path / "hisparse-out")["alpha"]["audit"]
    assert audit["flagged"] and "mean KL 0.01 > 0.001 nats" in audit["flag_reason"]
    assert "alpha: audit flagged" in result.output
    bad = cli("docs/alpha.txt", "--audit-min-agreement", "1.5")
    assert bad.exit_code == 2


def test_dashboard_shows_the_running_audit():
    tracker = ProgressTracker(started_t=0.0)
    text = _text(render_dashboard(tracker.state, now=1.0))
    assert "audit" not in text
    for i, (agree, kl, mass) in enumerate([(True, 0.02, 0.9), (False, 0.5, 0.7)]):
        tracker.update(AuditStep(0.1 * i, "a", i + 1, agree, kl, mass))
    text = _text(render_dashboard(tracker.state, now=1.0))
    assert "audit (vs dense)" in text and "top-1 50.0% · KL 0.260 · mass 80.0% · 2 steps" in text


def _text(renderable):
    from rich.console import Console

    console = Console(record=True, width=160, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_an_audit_of_no_step_reports_no_figures():
    """A reply shorter than the first scheduled audit step compares nothing: the line says
    0 steps and no agreement, KL or mass (not a perfect score), and is not flagged."""
    from engine.events import AuditStats
    from hisparse_cli.results import AuditLimits, audit_record

    record = audit_record(AuditStats(steps=0), AuditLimits(min_agreement=0.9))
    assert record["steps"] == 0 and not record["flagged"]
    assert record["top1_agreement"] is None and record["kl_mean"] is None
    assert record["mass_kept_mean"] is None
    done = audit_record(AuditStats(steps=2, top1_agreement=0.5, mass_kept_mean=1.0000001), AuditLimits())
    assert done["flagged"] and done["mass_kept_mean"] == 1.0
