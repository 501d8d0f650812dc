"""The global random generators' state (gpuhub/kernel/random_state.py): captured as data, taken on
by another process (here: this one, after other draws)."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from gpuhub.kernel import random_state


@pytest.fixture(autouse=True)
def _restored():
    saved, saved_np = random.getstate(), np.random.get_state()
    random_state.take_baseline()
    yield
    random.setstate(saved)
    np.random.set_state(saved_np)


def test_an_unseeded_untouched_generator_is_not_carried():
    assert "random" not in random_state.capture()


def test_the_sequences_continue_where_the_state_was_taken():
    random.seed(0)
    np.random.seed(0)
    random.random()
    random.gauss(0, 1)  # leaves a cached value: part of the state
    state = pickle.loads(pickle.dumps(random_state.capture()))
    want = (random.random(), random.gauss(0, 1), float(np.random.rand()))
    random.seed(99)
    np.random.seed(99)
    random_state.apply(state)
    assert (random.random(), random.gauss(0, 1), float(np.random.rand())) == want


def test_whatever_a_state_holds_apply_never_raises():
    for state in (None, 1, {"random": "x"}, {"numpy": [1]}):  # (torch: test_torch_training.py)
        random_state.apply(state)
