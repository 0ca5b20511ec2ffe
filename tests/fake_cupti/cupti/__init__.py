"""A stand-in for NVIDIA's ``cupti-python`` package in CPU-only tests (put ``tests/fake_cupti`` on PYTHONPATH):
``from cupti import cupti`` then gives :mod:`cupti.cupti`, which emits synthetic kernel records while kernel
activities are enabled, so that a gloo job on the CPU publishes KernelBatches the way a GPU job would."""
