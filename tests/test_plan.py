"""The plan contract: the scanned runs cover every layer once, in order, with the fewest layer bodies."""
import functools
import random

import pytest

from jaxmodels.plan import Run, _cost, _runs


def expand(runs) -> list[int]:
    """The layer indices the runs execute, in order."""
    out = []
    for r in runs:
        inner = [r.start] if r.body is None else expand(r.body)
        out += [i + k * r.period for k in range(r.repeats) for i in inner]
    return out


def best(seq) -> tuple[int, int]:
    """(bodies, runs) of the best split, by exhaustive search (an independent reference for short plans)."""
    @functools.lru_cache(None)
    def f(s):
        if not s:
            return 0, 0
        out = (1 + f(s[1:])[0], 1 + f(s[1:])[1])
        for p in range(1, len(s) // 2 + 1):
            for r in range(2, len(s) // p + 1):
                if all(s[k * p:(k + 1) * p] == s[:p] for k in range(r)):
                    out = min(out, (f(s[:p])[0] + f(s[r * p:])[0], 1 + f(s[r * p:])[1]))
        return out
    return f(tuple(seq))


def test_runs_cover_every_layer_with_the_fewest_bodies():
    rng = random.Random(0)
    for _ in range(600):
        seq = tuple(rng.randrange(rng.randint(1, 3)) for _ in range(rng.randint(1, 11)))
        runs = _runs(seq, 0)
        assert expand(runs) == list(range(len(seq))), seq
        assert (_cost(runs), len(runs)) == best(seq), seq


@pytest.mark.parametrize("seq,bodies", [
    ("LL" + "LLLG" * 8, 3),  # the two extra sliding layers scan alone: stopping the first run early pays
    ("0011110101", 4),
    ("W" + "E" + ("S" + "R" * 5) * 2 + "s" + "R" * 5 + "C" + "r" * 3 + ("X" + "r" * 3) * 4, 10),  # V4.1-Flash roles
])
def test_known_plans(seq, bodies):
    runs = _runs(tuple(seq), 0)
    assert expand(runs) == list(range(len(seq))) and _cost(runs) == bodies


def test_a_uniform_stack_is_one_scan():
    assert _runs((0,) * 126, 0) == (Run(0, 1, 126, (Run(0, 1, 1),)),)
