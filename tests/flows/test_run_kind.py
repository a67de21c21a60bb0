"""Overrides and configs that would be silently ignored, or would rewind a run, are refused by the
CLI with one config error (exit 2) before anything starts: an override of a section the run's
kind never reads (``grpo.*`` on a DPO run, ``dpo.*`` on a GRPO run), a DPO config given to ``nrl
grpo``, a ``max_num_steps`` below the steps a run has trained, and DPO with every loss weight 0.

The runs resumed here are built cheaply: the run's ``config.yaml`` as a new run writes it
(:func:`flows.run.state.init_run`) and committed ``train`` datasets for its trained steps."""

from __future__ import annotations

import os

import pytest

from tests.flows.conftest import REPO, TINY_CONFIG

DPO_CONFIG = os.path.join(REPO, "configs", "dpo_tiny.yaml")


def _trained_run(root: str, run_id: str, config: str, steps: int) -> str:
    """A run under ``root`` created from ``config`` whose steps ``1..steps`` have committed ``train``."""
    import storage
    import torch

    from flows.run.resolve import resolve_config
    from flows.run.state import init_run
    from nrl_tasks.run_layout import RunLayout

    cfg = resolve_config(config, [], root)
    layout = RunLayout(cfg.storage.root, run_id)
    init_run(layout, cfg, resume=False)
    for step in range(1, steps + 1):
        storage.save_batch({"x": torch.zeros(2)}, layout.stage_uri(step, "train"))
    return cfg.storage.root


def _refused(argv: list[str], capsys) -> str:
    from flows.cli import main

    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("nrl: error:") == 1, err
    return err


def test_a_max_num_steps_below_the_trained_prefix_is_refused(tmp_path, capsys):
    root = _trained_run(str(tmp_path / "runs"), "r12", TINY_CONFIG, steps=4)
    err = _refused(["resume", "r12", "--storage", root, "grpo.max_num_steps=2"], capsys)
    assert "grpo.max_num_steps = 2 is below the 4 steps run 'r12' has trained" in err, err
    assert "cannot be rewound" in err, err
    assert not os.path.exists(os.path.join(root, "r12", "checkpoints")) and not os.path.exists(
        os.path.join(root, "r12", "status.json"))  # nothing started


def test_a_dpo_max_num_steps_below_the_trained_prefix_is_refused(tmp_path, capsys):
    root = _trained_run(str(tmp_path / "runs"), "d", DPO_CONFIG, steps=3)
    err = _refused(["resume", "d", "--storage", root, "dpo.max_num_steps=1"], capsys)
    assert "dpo.max_num_steps = 1 is below the 3 steps run 'd' has trained" in err, err


def test_a_budget_at_or_above_the_trained_prefix_is_not_a_rewind(tmp_path):
    from flows.run.resolve import resolve_config
    from flows.algorithms.grpo import GRPO
    from flows.run.start import check_not_rewound
    from nrl_tasks.run_layout import RunLayout

    root = _trained_run(str(tmp_path / "runs"), "r", TINY_CONFIG, steps=3)
    for steps in (3, 5):
        cfg = resolve_config(None, [f"grpo.max_num_steps={steps}"], root, run_id="r")
        check_not_rewound(cfg, RunLayout(cfg.storage.root, "r"), GRPO)


@pytest.mark.parametrize("run_config, override, needle", [
    (DPO_CONFIG, "grpo.max_num_steps=10", "override grpo.max_num_steps=10 does not apply to a DPO run"),
    (DPO_CONFIG, "loss_fn.reference_policy_kl_penalty=0.1", "does not apply to a DPO run"),
    (TINY_CONFIG, "dpo.max_num_steps=10", "override dpo.max_num_steps=10 does not apply to a GRPO run"),
])
def test_resume_refuses_an_override_of_the_other_kind(run_config, override, needle, tmp_path, capsys):
    root = _trained_run(str(tmp_path / "runs"), "r", run_config, steps=1)
    err = _refused(["resume", "r", "--storage", root, override], capsys)
    assert needle in err and "run 'r'" in err, err


@pytest.mark.parametrize("argv, needle", [
    (["grpo", "--config", DPO_CONFIG], "has a `dpo` section: a DPO config (use `nrl dpo`"),
    (["grpo", "--config", TINY_CONFIG, "dpo.max_num_steps=3"], "does not apply to a GRPO run"),
    (["dpo", "--config", DPO_CONFIG, "grpo.max_num_steps=3"], "does not apply to a DPO run"),
    (["dpo", "--config", DPO_CONFIG, "dpo.preference_loss_weight=0", "dpo.sft_loss_weight=0"],
     "dpo.preference_loss_weight and dpo.sft_loss_weight are both 0"),
])
def test_a_new_run_of_the_wrong_kind_is_refused(argv, needle, tmp_path, capsys):
    root = tmp_path / "runs"
    err = _refused([*argv, "--storage", str(root), "--run-id", "n"], capsys)
    assert needle in err, err
    assert not (root / "n").exists()


def test_the_finished_e2e_run_is_not_rewound(e2e_run, capsys):
    """The real thing on the session's finished 3-step run: refused before anything is written
    (no second final checkpoint, ``nrl runs`` still ``3/3``)."""
    from flows.cli import main
    from tests.flows.conftest import E2E_RUN_ID

    root = e2e_run["root"]
    checkpoints = sorted(os.listdir(os.path.join(root, E2E_RUN_ID, "checkpoints")))
    err = _refused(["resume", E2E_RUN_ID, "--storage", root, "grpo.max_num_steps=2"], capsys)
    assert f"grpo.max_num_steps = 2 is below the 3 steps run '{E2E_RUN_ID}' has trained" in err, err
    assert sorted(os.listdir(os.path.join(root, E2E_RUN_ID, "checkpoints"))) == checkpoints
    assert main(["runs", "--storage", root]) == 0
    assert "3/3" in [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(E2E_RUN_ID)][0]
