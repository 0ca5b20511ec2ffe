"""Keys land on the partition Kafka's Java client (and Faust's aiokafka producer) would choose."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from argus.topics import job_key, key_partition


@given(st.binary(max_size=64), st.integers(1, 64))
def test_key_partition_matches_aiokafka_default_partitioner(key: bytes, partitions: int) -> None:
    every = list(range(partitions))
    assert key_partition(key, partitions) == DefaultPartitioner()(key, every, every)


def test_known_java_values() -> None:
    # Kafka's own Utils.murmur2 test vectors (positive form): "21" -> -973932308, "foobar" -> -790332482.
    assert key_partition(b"21", 2**31 - 1) == (-973932308 & 0x7FFFFFFF) % (2**31 - 1)
    assert key_partition(b"foobar", 2**31 - 1) == (-790332482 & 0x7FFFFFFF) % (2**31 - 1)
    assert key_partition(job_key("job-1"), 1) == 0


def test_partitions_must_be_positive() -> None:
    with pytest.raises(ValueError, match="partitions"):
        key_partition(b"k", 0)
