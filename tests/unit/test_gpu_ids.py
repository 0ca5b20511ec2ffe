"""GPU ids on the rank side: the CUDA UUID, else the PCI bus id, else nothing, never an error; carried by the
topology (schema v3) to the findings of the ranks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from argus.core.errors import SchemaError
from argus.core.kinds import FindingKind
from argus.detectors.incidents import form_incidents
from argus.producers.exchange import topology_from_posts
from argus.producers.gpu_ids import gpu_id, kineto_gpu
from argus.producers.topology import build_topology
from argus.schemas.codec import codec
from argus.schemas.records import JobTopology
from tests.unit.test_incidents import TOPO, slow_host_findings


def fake_torch(available: bool = True, **props: Any) -> Any:
    def get_device_properties(index: int) -> Any:
        if "boom" in props:
            raise RuntimeError("driver gone")
        return SimpleNamespace(name="H100", **props)

    cuda = SimpleNamespace(is_available=lambda: available, current_device=lambda: 3,
                           get_device_properties=get_device_properties)
    return SimpleNamespace(cuda=cuda)


def test_the_uuid_first_then_the_pci_bus_id_then_nothing() -> None:
    uuid = "8d2f1c1e-0b5a-4a7e-9a3c-2b1d2e3f4a5b"
    assert gpu_id(torch_module=fake_torch(uuid=uuid)) == f"GPU-{uuid}"
    assert gpu_id(torch_module=fake_torch(uuid=f"GPU-{uuid}")) == f"GPU-{uuid}"
    pci = fake_torch(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    assert gpu_id(2, torch_module=pci) == "00000000:1B:00.0"
    assert gpu_id(torch_module=fake_torch()) == ""  # an older torch: neither
    assert gpu_id(torch_module=fake_torch(available=False, uuid=uuid)) == ""  # no CUDA
    assert gpu_id(torch_module=fake_torch(boom=True)) == ""  # a failing driver never stops training


def test_kineto_device_indices() -> None:
    assert (kineto_gpu(3), kineto_gpu(None), kineto_gpu(True), kineto_gpu(-1)) == ("cuda:3", "", "", "")


def test_the_topology_carries_gpus_and_older_topologies_decode_without() -> None:
    topo = build_topology("j", dp=2)
    with_gpus = JobTopology(**{**topo.__dict__, "gpu": ("GPU-a", "")})
    assert JobTopology.decode(with_gpus.encode()).gpu == ("GPU-a", "") and with_gpus.gpu_of(1) == ""
    v2 = {k: v for k, v in with_gpus.to_avro().items() if k != "gpu"}
    assert JobTopology.decode(codec("job_topology").encode(v2, version=2)).gpu == ()
    bad = JobTopology(**{**topo.__dict__, "gpu": ("GPU-a",)})
    with pytest.raises(SchemaError, match="gpu has 1 entries"):
        JobTopology.decode(bad.encode())


def test_posted_gpus_reach_the_topology() -> None:
    posts = [{"host": "a", "gpu": "GPU-0"}, {"host": "a"}]
    assert topology_from_posts("j", 2, posts, {"dp": 2}).gpu == ("GPU-0", "")
    assert topology_from_posts("j", 2, [{"host": "a"}, {"host": "b"}], {"dp": 2}).gpu == ()


def test_findings_name_the_gpus_of_their_ranks() -> None:
    gpus = tuple(f"GPU-{r:02d}" for r in TOPO.rank)
    topo = JobTopology(**{**TOPO.__dict__, "gpu": gpus})
    found = form_incidents(slow_host_findings(kernels=1), topo)
    node = next(f for f in found if f.kind is FindingKind.NODE_DEGRADED)
    assert node.gpus == gpus[8:16]
    assert all(f.gpus == (f"GPU-{f.ranks[0]:02d}",) for f in found if f is not node)
    assert all(f.gpus == () for f in form_incidents(slow_host_findings(kernels=1), TOPO))  # unknown: none
