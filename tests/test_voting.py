"""Temporal self-consistency voting: the vote, the extractors, and the recorded trajectories."""

import time

import jax
import numpy as np
import pytest

from mbd_jax.config import REPO_ROOT, DecodeConfig, VotingConfig
from mbd_jax.decoding import voting
from mbd_jax.engine import Engine
from mbd_jax.errors import UserError
from mbd_jax.tokenizer import load_tokenizer


def test_vote_recovers_the_answer_late_steps_agree_on():
    """20 steps: early noise, most late steps say 42, the final step flips to 41 (wrong)."""
    texts = ["", "The answer", "The answer is 7", "The answer is 4"] + ["The answer is 42"] * 12 + [
        "The answer is 41", "The answer is 42", "The answer is 42", "The answer is 41"]
    for weighting in ("fixed", "linear", "exp"):
        cfg = VotingConfig(weighting=weighting)
        answers = [voting.extract(t, cfg) for t in texts]
        assert answers[-1] == "41"
        winner, scores = voting.vote(answers, cfg)
        assert winner == "42", (weighting, scores)
    # exp weighting with a large alpha trusts the last step: the vote follows it.
    cfg = VotingConfig(weighting="exp", alpha=60.0)
    assert voting.vote([voting.extract(t, cfg) for t in texts], cfg)[0] == "41"


def test_step_weights():
    cfg = VotingConfig(weighting="linear")
    assert [voting.step_weight(t, 4, cfg) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    e = VotingConfig(weighting="exp", alpha=5.0)
    assert voting.step_weight(4, 4, e) == pytest.approx(np.exp(5.0))


@pytest.mark.parametrize("cfg,text,want", [
    (VotingConfig(extractor="last_number"), "3 apples and -12.5 pears", "-12.5"),
    (VotingConfig(extractor="last_number"), "no digits", None),
    (VotingConfig(extractor="boxed"), r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}", "x^{2}"),
    (VotingConfig(extractor="boxed"), r"\boxed{unclosed", None),
    (VotingConfig(extractor="regex", pattern=r"answer: (\w+)"), "answer: foo, answer: bar", "bar"),
])
def test_extractors(cfg, text, want):
    assert voting.extract(text, cfg) == want


def test_recorded_trajectory_is_the_running_prediction(cfg, params):
    """The last recorded step's prediction is the final text; every step's prediction keeps the
    tokens already committed; the vote is reported beside the text."""
    tok = load_tokenizer(REPO_ROOT / "configs/tokenizers/tiny.model")
    eng = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=32, tokenizer=tok,
                 record_steps=64, record_len=24)
    decode = DecodeConfig(max_new_tokens=24, buffer_size=2, add_block_threshold=0.0,
                          voting=VotingConfig(extractor="regex", pattern=r"(\w+)"))
    prompts = [np.array(tok.encode("What is 12 + 30?"), np.int32), np.arange(10, 23, dtype=np.int32)]
    state = eng.run_decode(eng.admit(eng.empty_state(), {0: (prompts[0], decode), 1: (prompts[1], decode)}))
    results = eng.results(state, 2, 0.0, [decode] * 2)
    traj = jax.device_get(state.trajectory)
    for i, r in enumerate(results):
        assert r.nfe >= 2
        final = traj[i, (r.nfe - 1) % 64]
        assert final.tolist() == r.token_ids[:24]
        first = traj[i, 0]
        assert (first != cfg.mask_token_id).sum() >= 1  # a prediction, not an empty record
        for t in range(r.nfe):  # every step fills >= 1 position, and filled ones never change
            assert (traj[i, t] == final).sum() >= min(t + 1, 24)
        assert r.voted_answer is not None and r.voted_answer in r.vote_scores
        assert r.final_answer == voting.extract(r.text, decode.voting)


def test_voting_needs_a_recording_engine(cfg, params):
    eng = Engine(cfg, params, batch_size=1)
    with pytest.raises(UserError, match="voting needs an engine that records"):
        eng.generate([[11, 12]], DecodeConfig(voting=VotingConfig()))


def test_a_backtracking_pattern_runs_in_linear_time():
    """(a+)+$ against a long run of a's and one b takes exponential time in a backtracking
    engine (Python's re froze the service for minutes); RE2 answers at once."""
    cfg = VotingConfig(extractor="regex", pattern=r"(a+)+$")
    t0 = time.perf_counter()
    assert voting.extract("a" * 100_000 + "b", cfg) is None
    assert voting.extract("x aaa", cfg) == "aaa"
    assert time.perf_counter() - t0 < 5.0  # generous: a backtracking engine needs years
