"""``scripts/measure_superpage.py``'s paired comparison (superpage vs exact, each against
dense): the block bootstrap's interval and the pooled "no loss" verdict over run files."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_superpage.py"


def load_script():
    spec = importlib.util.spec_from_file_location("measure_superpage", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def steps(n: int, p: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.random() < p) for _ in range(n)]


def test_paired_interval_holds_a_shift_and_zero_for_equal_runs():
    m = load_script()
    exact = steps(400, 0.9, 0)
    same = m.paired([(exact, list(exact))])
    assert same["mean"] == 0 and same["ci95"] == [0.0, 0.0] and same["steps"] == 400
    worse = [0 if i % 4 == 0 else a for i, a in enumerate(exact)]  # ~22 % fewer agreements
    got = m.paired([(exact, worse)])
    assert got["ci95"][0] <= got["mean"] <= got["ci95"][1] < 0
    # two runs of different lengths: each step weighs the same
    two = m.paired([(exact, worse), (exact[:100], exact[:100])])
    assert two["steps"] == 500 and abs(two["mean"] - got["mean"] * 400 / 500) < 1e-12


def run_file(tmp: Path, name: str, exact_agree, sp_agree, exact_kl, sp_kl) -> Path:
    path = tmp / name
    fid = {
        "exact": {"vs_dense": {"agree_steps": exact_agree, "kl_steps": exact_kl}},
        "16x8": {"vs_dense": {"agree_steps": sp_agree, "kl_steps": sp_kl}},
    }
    path.write_text(json.dumps({"doc": name, "tokens": 10, "steps": len(exact_agree),
                                "top_k_tokens": 256, "fidelity": fid}))  # fmt: skip
    return path


def test_pool_says_no_loss_only_when_the_intervals_allow_it(tmp_path, capsys):
    m = load_script()
    a, b = steps(200, 0.95, 1), steps(200, 0.95, 2)
    kl = [0.05 + 0.01 * (i % 7) for i in range(200)]
    equal = [run_file(tmp_path, f"eq{i}.json", x, x, kl, kl) for i, x in enumerate((a, b))]
    out = tmp_path / "pooled.json"
    assert m.pool(equal, out) == 0
    assert json.loads(out.read_text())["variants"]["16x8"]["no_loss_at_95"] is True
    far = [k + 0.05 for k in kl]  # every step further from dense
    lossy = [run_file(tmp_path, f"loss{i}.json", x, x, kl, far) for i, x in enumerate((a, b))]
    m.pool(lossy, out)
    pooled = json.loads(out.read_text())["variants"]["16x8"]
    assert pooled["no_loss_at_95"] is False and pooled["kl_nats"]["ci95"][0] > 0
    assert "NO" in capsys.readouterr().out


def test_sticky_select_with_every_page_a_candidate_is_flat_quest():
    """The measured-only sticky rule: with the previous step's pages covering every page
    (or every superpage kept) every page is a candidate, so it selects as flat Quest's
    normmax does; with one superpage and no previous pages it keeps only that one's pages
    beside the forced ones."""
    import torch

    from kernels.bitmask import unpack_bits
    from kernels.quest_scores import quest_scores_ref
    from kernels.select_topk import select_topk_ref
    from kernels.superpage_select import superpage_meta_ref

    m = load_script()
    gen = torch.Generator().manual_seed(3)
    n, s, hkv, hq, d = 40, 4, 2, 4, 8
    meta = (torch.randint(-8, 8, (n + 3, hkv, 2, d), generator=gen) / 4).sort(dim=2).values
    q = torch.randint(-4, 4, (1, hq, d), generator=gen) / 2
    pages = torch.randperm(n + 3, generator=gen)[:n]
    block_table = pages.int()[None, :]
    num_pages = torch.tensor([n], dtype=torch.int32)
    sup = superpage_meta_ref(meta, pages, s)
    page_super = torch.full((n + 3,), -1, dtype=torch.int32)
    page_super[pages[::s]] = torch.arange(sup.shape[0], dtype=torch.int32)
    args = (q, meta, sup, page_super, block_table, num_pages, 8, 1, 2, s)
    flat = unpack_bits(
        select_topk_ref(quest_scores_ref(q, meta, block_table, num_pages, "normmax", 0.5),
                        num_pages, 8, 1, 2), n)  # fmt: skip
    every = torch.ones(1, hkv, n, dtype=torch.bool)
    assert torch.equal(m.sticky_select_ref(*args, 1, 0.5, every), flat)
    assert torch.equal(m.sticky_select_ref(*args, n // s, 0.5, None), flat)
    cands: list = []  # the diagnosis: exact's normalisation over every page, same candidates
    assert torch.equal(
        m.sticky_select_ref(*args, n // s, 0.5, None, lse_over_all=True, out_cand=cands), flat
    )
    assert cands[0].all()
    one = m.sticky_select_ref(*args, 1, 0.5, None)
    forced = torch.zeros(n, dtype=torch.bool)
    forced[:1] = forced[-2:] = True
    for h in range(hkv):
        free = (one[0, h] & ~forced).nonzero().flatten()
        assert 0 < free.numel() <= s and (free // s).unique().numel() == 1
