"""A reader that closes stdout early (``argus ddl | head``) ends the command quietly: exit 141, no traceback;
a broken socket is still reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from argus.cli import Exit, _stdout_reader_gone

ROOT = Path(__file__).resolve().parents[2]


def _run_into_closed_pipe(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[bytes]:
    """``argus argv`` with stdout a pipe whose reader closed before the first write (deterministic, unlike
    ``| head``, where the command may finish writing before head exits)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "ARGUS_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, "-m", "argus", *argv], stdout=write_end, stderr=subprocess.PIPE,
                              env=env, timeout=120, check=False)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("argv", [["ddl"], ["ddl", "--cluster", "c"], ["--version"], ["ddl", "--help"]])
def test_closed_stdout_exits_quietly(argv: list[str], tmp_path: Path) -> None:
    done = _run_into_closed_pipe(argv, tmp_path)
    assert b"Traceback" not in done.stderr and b"BrokenPipeError" not in done.stderr, done.stderr.decode()
    # argparse's own output (--version, --help) exits 0 from inside parse_args; the rest says the pipe broke.
    assert done.returncode in (Exit.OK, Exit.BROKEN_PIPE), done.stderr.decode()
    if argv[0] == "ddl" and "--help" not in argv:
        assert done.returncode == Exit.BROKEN_PIPE


def test_open_stdout_is_not_taken_for_a_closed_one() -> None:
    """A BrokenPipeError of a socket, with stdout still read, is an error to show, not a reader gone."""
    read_end, write_end = os.pipe()
    saved = os.dup(sys.__stdout__.fileno())
    try:
        os.dup2(write_end, sys.__stdout__.fileno())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "stdout", sys.__stdout__)
            assert not _stdout_reader_gone()
            os.close(read_end)
            assert _stdout_reader_gone()
    finally:
        os.dup2(saved, sys.__stdout__.fileno())
        os.close(saved)
        os.close(write_end)
