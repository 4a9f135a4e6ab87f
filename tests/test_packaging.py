"""`pip install .` installs what Kestrel imports and a `kestrel` command."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def requirement_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[<>=!;\[ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_the_wheel_declares_the_dependencies_and_the_command(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("kestrel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        info = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
        assert "kestrel/distributed/worker.py" in archive.namelist()
        assert "kestrel/core/runtime/cpu_kernels.cpp" in archive.namelist()  # built on first use
    declared = {
        re.split(r"[<>=!;\[ ]", line.removeprefix("Requires-Dist: "), maxsplit=1)[0].lower().replace("_", "-")
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    }
    pinned = requirement_names((ROOT / "requirements.txt").read_text()) - {"matplotlib"}  # an extra: bench
    assert pinned <= declared, f"requirements.txt names {sorted(pinned - declared)} that the package does not declare"
    assert re.search(r"^kestrel = kestrel\.__main__:main$", entry_points, re.MULTILINE)


def test_the_command_entry_point_runs():
    from kestrel.__main__ import main

    result = subprocess.run(
        [sys.executable, "-c", "import sys; from kestrel.__main__ import main; sys.exit(main(['--help']))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert callable(main)
    assert result.returncode == 0 and "usage: kestrel" in result.stdout and "serve" in result.stdout
