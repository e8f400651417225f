import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


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
