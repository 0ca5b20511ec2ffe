"""The worker's producer partitioner: aiokafka's default placement (murmur2 of the key), hashes remembered."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.streams.app import KeyHashPartitioner


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=60), min_size=1, max_size=20), st.integers(1, 64))
def test_places_every_key_where_the_default_partitioner_does(keys: list[bytes], n: int) -> None:
    cached, default = KeyHashPartitioner(max_keys=4), DefaultPartitioner()
    parts = list(range(n))
    for key in keys + keys:  # the second time from the cache (or past its size)
        assert cached(key, parts, parts) == default(key, parts, parts)


def test_a_key_of_none_goes_to_an_available_partition() -> None:
    assert KeyHashPartitioner()(None, [0, 1, 2], [2]) == 2
