"""The repository's promises: CI runs the README's test command, and engine never imports Ray."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", (ROOT / "README.md").read_text())


def test_readme_gives_exactly_two_fresh_machine_commands():
    commands = _readme_commands()
    assert len(commands) == 2
    assert "pytest" in commands[1] and "pytest" not in commands[0]


def test_ci_runs_the_readme_test_command():
    assert _readme_commands()[1] in (ROOT / ".ci" / "run").read_text()


def test_engine_never_imports_ray():
    code = "import sys, engine, engine.llm_engine, engine.runner.model_runner; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False"
    offenders = [p for p in (ROOT / "engine").rglob("*.py")
                 if re.search(r"^\s*(import ray|from ray)", p.read_text(), re.M)]
    assert offenders == []
