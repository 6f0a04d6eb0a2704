"""`specheads train drafter` holds its settings to account (issue 70): bad ones refused in one line before the data
step, a resumed run refused under changed settings, one run at a time per `--out`, and a loss that turns non-finite
stops the run without a drafter."""

import pytest
from test_dspark import DSPARK
from test_eagle3 import recipe_args

from specheads.cli import main
from specheads.plumbing.lock import folder_lock


def one_line(capsys) -> str:
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0, error
    return error


@pytest.mark.parametrize("flags, problem", [
    (["--val-fraction", "0.0001"], "--val-fraction 0.0001 holds out 0 of the 12 prompts"),
    (["--lr", "-1"], "--lr"),
    (["--precision", "bogus"], "--precision"),
    (["--max-new-tokens", "1000000"], "past the target's context"),
    ([*DSPARK, "--block-size", "100000"], "--block-size 100000 is longer than any response"),
    ([*DSPARK, "--markov-rank", "100000"], "--markov-rank 100000 exceeds the draft vocabulary (64)"),
])
def test_bad_settings_are_refused_in_one_line_before_the_data_step(tiny_model, prompts_file, tmp_path, capsys, flags,
                                                                   problem):
    pytest.importorskip("speculators.models.dspark")
    out = tmp_path / "run"
    assert main(recipe_args(tiny_model, prompts_file, out, "--max-steps", "2", *flags)) == 2
    assert problem in one_line(capsys) and not out.exists()


@pytest.fixture(scope="module")
def finished(tiny_model, prompts_file, tmp_path_factory):
    """A finished two-step EAGLE-3 run."""
    pytest.importorskip("speculators.models.eagle3")
    out = tmp_path_factory.mktemp("settings") / "run"
    assert main(recipe_args(tiny_model, prompts_file, out, "--max-steps", "2")) == 0
    return out


def test_a_resume_under_other_settings_is_refused_naming_the_first_that_differs(finished, tiny_model, prompts_file,
                                                                                capsys):
    before = (finished / "fingerprint.json").read_text()
    assert main(recipe_args(tiny_model, prompts_file, finished, "--max-steps", "3", "--lr", "1e-3",
                            "--ttt-steps", "2")) == 2
    error = one_line(capsys)
    assert "other settings (ttt_steps): --ttt-steps was 3, now 2" in error and "a new --out" in error
    assert (finished / "fingerprint.json").read_text() == before  # nothing trained


def test_a_second_run_into_one_out_is_refused_while_the_first_holds_it(finished, tiny_model, prompts_file, capsys):
    before = (finished / "fingerprint.json").read_text()
    with folder_lock(finished, "train drafter"):  # what a running `train drafter` holds
        assert main(recipe_args(tiny_model, prompts_file, finished, "--max-steps", "3")) == 2
    assert "is being written by another `specheads train drafter`" in one_line(capsys)
    assert (finished / "fingerprint.json").read_text() == before


@pytest.mark.parametrize("lr, problem", [("1e30", "the training loss became nan at step"),
                                          ("1e6", "is NaN or infinite in float16 (the dtype its folder stores)")])
def test_a_run_that_diverges_stops_without_a_drafter(tiny_model, prompts_file, tmp_path, capsys, lr, problem):
    # at 1e30 the loss turns NaN; at 1e6 it stays finite while the weights outgrow the folder's float16
    pytest.importorskip("speculators.models.eagle3")
    out = tmp_path / "run"
    assert main(recipe_args(tiny_model, prompts_file, out, "--max-steps", "6", "--lr", lr, "--warmup-steps", "0")) == 2
    error = one_line(capsys)
    assert problem in error and "lower --lr" in error, error
    assert not (out / "drafter").exists() and not (out / "fingerprint.json").exists()
