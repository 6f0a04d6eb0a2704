"""Tests with the power to catch what the exactness tests let through (issue 70): `exactness_p`, the chi-square test
the decoding tests run on every prefix of the sampled sequences, where a wrong residual or a drop on the drawn token
shows at the position it changes; and what a planner or online rule is shown of a round, which ends at its first
rejection (the positions after it were never checked: counting them as rejections would teach every estimate that
later positions fail)."""

from test_eval import PROMPT, chi_square_p, tiny_lm

from specheads.decoding import RoundEngine, make_policy
from specheads.decoding.online import PassivePlanner
from specheads.model_outputs.sampling import SamplingTransform


def exactness_p(samples: list[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> float:
    """The smallest chi-square p-value of the samples' first token, first two tokens, …, whole sequences against the
    `expected` distribution of sequences, times their number (Bonferroni). A wrong residual or rule changes the
    distribution at some position; the test of the prefix that ends there has few cells, where the test of whole
    sequences spreads the change over many (issue 70: p = 0.5 there, 6e-5 on two tokens)."""
    length = len(next(iter(expected)))
    values = []
    for size in range(1, length + 1):
        prefixes: dict[tuple[int, ...], float] = {}
        for sequence, probability in expected.items():
            prefixes[sequence[:size]] = prefixes.get(sequence[:size], 0.0) + probability
        values.append(chi_square_p([sample[:size] for sample in samples], prefixes))
    return min(1.0, min(values) * length)


class Recording(PassivePlanner):
    """A planner that plans nothing and keeps what the engine shows it of each round (`observe`)."""

    def __init__(self) -> None:
        self.rounds: list[dict] = []

    def observe(self, outcomes) -> None:
        self.rounds.append({row: list(checked) for row, checked in outcomes.items()})


def test_a_planner_observes_the_checked_candidates_up_to_the_first_rejection_and_none_past_it():
    """Every round shows a planner its accepted candidates then, where the target rejected one, that one alone: as
    many acceptances as the request kept, one rejection a round that rejected (constant K checks every candidate)."""
    engine = RoundEngine(tiny_lm(seed=1), tiny_lm(seed=2), SamplingTransform(1.0), stop_ids=[])
    recording, log = Recording(), []
    runs = 24
    results = engine.decode([PROMPT] * runs, make_policy("constant_k", 4, max_draft=4), 14, list(range(runs)),
                            batch_size=6, planner=recording, log=log)
    shown = {request: [] for request in range(runs)}
    for record, outcomes in zip(log, recording.rounds):  # a round's rows in the order the engine served them
        assert len(record.requests) == len(outcomes)
        for request, checked in zip(record.requests, outcomes.values()):
            shown[request].append([outcome.accepted for outcome in checked])
            assert [outcome.position for outcome in checked] == list(range(1, len(checked) + 1))
    rejected_rounds = early = 0
    for request, result in enumerate(results):
        rounds = [flags for flags in shown[request] if flags]
        assert all(flags == [True] * flags.count(True) + [False] * (len(flags) - flags.count(True)) and
                   flags.count(False) <= 1 for flags in rounds), (request, rounds)
        assert sum(flags.count(True) for flags in rounds) == result.accepted
        rejections = sum(1 for a, d in zip(result.accepted_per_round, result.drafted_per_round) if a < d)
        assert sum(flags.count(False) for flags in rounds) == rejections
        rejected_rounds += rejections
        early += sum(1 for a, d in zip(result.accepted_per_round, result.drafted_per_round) if a < d - 1)
    assert rejected_rounds > 20 and early > 10  # rounds with unchecked candidates after their rejection
