"""The import contracts of pyproject.toml ([tool.importlinter]): the executor uses the planner and
never the reverse (but for the gRPC client and the kernel probe, named there), and no package has
an import cycle between its modules. Checked with import-linter, the tool CI would run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout, r.stdout
