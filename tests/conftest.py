import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# the project, and the shared test helpers (tiny_models, exactness) wherever a test sits in the tree
for path in (ROOT, TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# Under pytest-xdist (run.sh test runs one worker per core) each worker gets its share of the cores: torch's
# default of one thread per core in every worker would oversubscribe them and slow every test down.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session", autouse=True)
def _cost_tables_apart(tmp_path_factory):
    """Cost tables timed here are timed beside the other workers' tests: cached where real runs read them, they
    would price every later run at that load (generation.scheduling.profiler)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSPARK_COST_CACHE", str(tmp_path_factory.mktemp("cost_tables")))
        yield


@pytest.fixture(scope="module")
def parity_report(request):
    """Largest absolute difference per checked tensor; printed at the end of the module (pytest -s)."""
    report: dict[str, float] = {}
    yield report
    if report:
        worst = max(report, key=report.get)
        print(f"\n[parity] {len(report)} tensors checked, largest diff {report[worst]:.2e} ({worst})")
        for name, diff in report.items():
            print(f"[parity]   {name}: {diff:.2e}")
