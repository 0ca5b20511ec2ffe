"""The id of the GPU a rank runs on, as an operator finds it on the host (rank side; never raises).

:func:`gpu_id` gives the CUDA device UUID as ``nvidia-smi -L`` writes it (``GPU-<uuid>``), else the device's PCI
bus id as ``nvidia-smi`` writes it (``<domain>:<bus>:<device>.0``, hexadecimal), else ''. It reads
``torch.cuda.get_device_properties`` (``uuid`` since torch 2.2, ``pci_*_id`` since 2.4) of the current device
or the one given: without torch, without CUDA, or with an older torch it returns '' and training goes on.
:func:`kineto_gpu` names a GPU seen only in a trace: its index on its host (``cuda:<index>``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__all__ = ["gpu_id", "kineto_gpu"]

log = logging.getLogger(__name__)


def gpu_id(device: int | None = None, torch_module: Any = None) -> str:
    """The id of CUDA device ``device`` (default: the current one) of ``torch_module`` (default: ``torch`` if
    installed), '' when unknown (see the module docstring)."""
    torch = torch_module
    if torch is None:
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            return ""
    try:
        if not torch.cuda.is_available():
            return ""
        index = torch.cuda.current_device() if device is None else int(device)
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        if uuid:
            text = str(uuid)
            return text if text.startswith("GPU-") else f"GPU-{text}"
        bus = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
        if all(isinstance(v, int) for v in bus):
            return f"{bus[0]:08X}:{bus[1]:02X}:{bus[2]:02X}.0"
    except Exception as exc:  # a broken driver must not stop training: the id is a convenience
        log.debug("argus: no GPU id: %s", exc)
    return ""


def kineto_gpu(device: object) -> str:
    """``cuda:<index>`` for a trace's device index (a kernel's ``device`` arg), '' for anything else."""
    return f"cuda:{device}" if isinstance(device, int) and not isinstance(device, bool) and device >= 0 else ""
