"""The rank side as a training host installs it: ``pip install argus-failslow`` (no extras) into a clean
virtualenv beside the torch the image already has (``tests/rank_venv.py`` builds it from a wheel of this
checkout). Nothing of the server side is installed there, importing the rank side loads nothing of it, the
``rank`` extra keeps the image's torch, and a 2-rank DDP (gloo) job traced by ``argus.attach`` from that venv
is diagnosed by the real worker and sink of this environment through to ClickHouse.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from argus.core.settings import Settings
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from load_tests.rank_footprint import BUDGET_INSTALLED_MB, measure
from tests.integration.conftest import SinkThread, WorkerProcess
from tests.integration.ranks import EXAMPLES, run_ranks
from tests.rank_venv import (
    CONSTRAINTS,
    SERVER_MODULES,
    RankVenv,
    build_rank_venv,
    clean_env,
    probe,
)

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch", reason="torch is a test dependency (extra 'rank'); CI installs it")

WORLD, STEPS = 2, 20
JOB = "rank-install"
#: What the base distribution may install, and nothing else (canonical names).
BASE = {"argus-failslow", "confluent-kafka", "fastavro", "numpy", "prometheus-client"}


@pytest.fixture(scope="module")
def rank_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankVenv]:
    yield build_rank_venv(tmp_path_factory.mktemp("rank-venv"))


def test_base_install_is_the_rank_side_only(rank_venv: RankVenv) -> None:
    # The benchmark's measurement (load_tests/rank_footprint.py) on this venv; its import-time budget is judged
    # by the benchmark, not on a busy test machine.
    footprint = measure(rank_venv, repeats=1)
    assert {canonicalize_name(n) for n in footprint["installed_mb"]} == BASE, footprint
    assert footprint["installed_mb_beyond_image"] <= BUDGET_INSTALLED_MB, footprint
    assert footprint["server_modules_importable"] == [] and footprint["server_modules_loaded"] == [], footprint
    assert footprint["import_s_beyond_torch"] > 0 and footprint["torch_version"] == torch.__version__, footprint
    assert {"scipy", "numba", "chdb", "clickhouse_connect", "faust", "aiokafka", "pyarrow", "plotly"} \
        <= set(SERVER_MODULES)
    # argus from the installed wheel, torch the image's (this environment's, not a copy or a download).
    seen = probe(rank_venv)
    assert Path(seen["argus_file"]).is_relative_to(rank_venv.site_packages), seen
    with zipfile.ZipFile(rank_venv.wheel) as wheel:
        assert {"argus/py.typed", "argus/__main__.py", "argus/schemas/kernel_batch.v2.avsc"} <= set(wheel.namelist())


def test_server_names_say_which_extra_to_install(rank_venv: RankVenv) -> None:
    out = rank_venv.run("import argus\n"
                        "try:\n    argus.fetch_findings\n"
                        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n")
    assert out.startswith("MissingExtraError argus.fetch_findings needs the 'server' extra"), out
    assert "pip install 'argus-failslow[server]'" in out
    # The command line is in the base distribution: its console script and python -m argus.
    for cmd in ([str(rank_venv.python.parent / "argus"), "--help"], [str(rank_venv.python), "-m", "argus", "--help"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=rank_venv.root, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: argus"), (cmd, proc.stderr[-2000:])
    out = rank_venv.run("from argus.core.extras import Extra, require_extra\n"
                        "try:\n    require_extra(Extra.SERVER, 'argus up')\n"
                        "except ImportError as exc:\n    print(exc)\n")
    assert out.startswith("argus up needs the 'server' extra ("), out
    # A server command in the base install: one line naming the extra, exit 1, no traceback.
    for argv in (["worker"], ["sql", "SELECT 1"], ["findings", "--job", "j"]):
        proc = subprocess.run([str(rank_venv.python.parent / "argus"), *argv], capture_output=True, text=True,
                              env=clean_env(), cwd=rank_venv.root, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
        assert f"argus {argv[0]} needs the 'server' extra" in proc.stderr, proc.stderr
        assert "pip install 'argus-failslow[server]'" in proc.stderr, proc.stderr


def test_rank_extra_keeps_the_images_torch(rank_venv: RankVenv) -> None:
    """``argus-failslow[rank]`` declares the torch it supports as a range: pip leaves the image's in place."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(rank_venv.python), "install", "--dry-run",
                           "--quiet", "--report", "-", "-c", str(CONSTRAINTS), f"{rank_venv.wheel}[rank]"],
                          capture_output=True, text=True, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    would_install = {canonicalize_name(item["metadata"]["name"]) for item in json.loads(proc.stdout)["install"]}
    assert "torch" not in would_install and not any(n.startswith("nvidia-") for n in would_install), would_install
    assert "py-spy" in would_install, would_install


def test_job_traced_from_the_clean_install_is_diagnosed(rank_venv: RankVenv, settings: Settings,
                                                        worker: WorkerProcess, sink: SinkThread,
                                                        tmp_path: Path) -> None:
    # The ranks run the clean venv's Python outside the checkout: argus is the wheel's, torch the image's.
    run_ranks(EXAMPLES / "train_ddp.py", ["--steps", str(STEPS)], world=WORLD, settings=settings, log_dir=tmp_path,
              python=str(rank_venv.python), base_env=clean_env(), cwd=tmp_path,
              extra_env={"ARGUS_JOB_ID": JOB, "PYTHONNOUSERSITE": "1"})
    assert wait_diagnosed(settings, JOB, 120, query=sink.store.query)
    assert sink.scalar(f"SELECT count() FROM {{db}}.steps FINAL WHERE job_id = '{JOB}'") == WORLD * STEPS
    rows = sink.store.query(f"SELECT name, uniqExact(rank), count() FROM {sink.store.database}.phases FINAL "
                            f"WHERE job_id = '{JOB}' AND name != '' GROUP BY name ORDER BY name").rows
    assert {r[0]: int(r[1]) for r in rows} == {"backward": WORLD, "dp-allreduce": WORLD, "forward": WORLD,
                                                "optimizer": WORLD}, rows
    # The job's END (published by the clean install's tracer) counted every step of every rank.
    assert sink.scalar(f"SELECT groupArray(steps) FROM {{db}}.jobs FINAL WHERE job_id = '{JOB}' AND event = 'END'") \
        == [WORLD * STEPS]
    findings = fetch_findings(settings, JOB, query=sink.store.query)
    assert isinstance(findings, list)


_ON_NUMPY_1 = """
import sys
import numpy
from argus.core.settings import Settings
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.faults import Fault
from argus.producers.simulator import JobSimulator
assert numpy.__version__.startswith("1.26"), numpy.__version__
spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=sys.argv[1], steps=4)
with Publisher(Settings.load(), lossless=True) as pub:
    n = sum(pub.publish(r.topic, r.key, r.record) for r in JobSimulator(spec, batch_events=512).records())
    stats = pub.close()
assert stats.delivered == stats.accepted == n and not stats.failed and not stats.encode_errors, stats
print(n)
"""


def test_the_rank_side_runs_on_numpy_1_26(rank_venv: RankVenv, settings: Settings, tmp_path: Path) -> None:
    """Training images still ship numpy 1.26: the base distribution accepts it (numpy>=1.26) and the rank side
    encodes and publishes every record kind of a simulated job with it (the server side needs numpy 2)."""
    venv = tmp_path / "np1"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pins = tmp_path / "constraints.txt"
    pins.write_text("".join(line + "\n" for line in CONSTRAINTS.read_text().splitlines()
                            if not line.lower().startswith("numpy==")))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "-c", str(pins),
                              str(rank_venv.wheel), "numpy==1.26.4"], capture_output=True, text=True, timeout=600,
                             env=clean_env())
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**clean_env(), **settings.to_env()}
    proc = subprocess.run([str(python), "-c", _ON_NUMPY_1, "numpy-1"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and int(proc.stdout) > 50, proc.stderr[-3000:]  # every record of 8 ranks x 4 steps
