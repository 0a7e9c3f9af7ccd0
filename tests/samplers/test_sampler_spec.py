"""A sampler's spec, as it reaches a remote controller: built back, or refused loudly."""

from __future__ import annotations

import pytest

from tq_stream.errors import ConfigError
from tq_stream.samplers import StalenessSampler
from tq_stream.samplers.spec import from_spec, to_spec


def test_a_spec_builds_the_sampler_back():
    sampler = from_spec(to_spec(StalenessSampler(max_staleness=2)))
    assert isinstance(sampler, StalenessSampler)
    assert to_spec(sampler) == to_spec(StalenessSampler(max_staleness=2))


@pytest.mark.parametrize("args, kwargs", [("ab", {}), ([], [["max_staleness", 1]]),
                                          ({"max_staleness": 1}, {})])
def test_a_spec_whose_args_are_not_a_list_and_kwargs_not_a_dict_is_refused(args, kwargs):
    spec = {**to_spec(StalenessSampler(max_staleness=0)), "args": args, "kwargs": kwargs}
    with pytest.raises(ConfigError, match="list of args and a dict of kwargs"):
        from_spec(spec)
