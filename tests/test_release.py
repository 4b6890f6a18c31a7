"""What a user installs and reads first: the version, the licence, the dependencies, the wheel, the README's size, and
a bench/ that holds reports rather than a lab."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from planner.version import DISTRIBUTION, version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PRODUCT = ("planner", "runtime", "search_spaces", "jobs", "bench")
README_MAX_BYTES = 12 * 1024
RESULTS_MAX_BYTES = 1024 * 1024


def test_the_version_has_one_source_and_the_command_prints_it():
    assert version() == PROJECT["version"]
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"prefetch-planner {PROJECT['version']}"


def test_the_changelog_has_a_section_for_the_version_and_the_licence_is_bsd3():
    assert f"## [{PROJECT['version']}]" in (ROOT / "CHANGELOG.md").read_text()
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert PROJECT["license"] == "BSD-3-Clause"


def test_transformers_is_an_extra_that_the_first_command_and_the_tests_install():
    core = {Requirement(d).name for d in PROJECT["dependencies"]}
    assert "transformers" not in core and "lightning" not in core
    extras = {name: {Requirement(d).name for d in deps} for name, deps in PROJECT["optional-dependencies"].items()}
    assert "transformers" in extras["hf"] and "transformers" in extras["test"]
    readme = (ROOT / "README.md").read_text().splitlines()
    first_command = next(line for line in readme if "prefetch-planner tune" in line)
    assert "'.[hf]'" in first_command


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= README_MAX_BYTES, f"README.md is {len(readme)} bytes; depth goes in docs/"
    text = readme.decode()
    order = ["pip install torch==2.13.0", "## Results", "## Tune inside your loop", "## What it costs", "## GPU status",
             "## Documentation"]
    positions = [text.index(marker) for marker in order]
    assert positions == sorted(positions)


def test_bench_results_are_dated_reports_under_a_mebibyte():
    results = ROOT / "bench" / "results"
    files = [p for p in results.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= RESULTS_MAX_BYTES
    reports = [p.name for p in files if p.name != "README.md"]
    assert reports and all(re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", name) for name in reports), reports
    for report in reports:
        text = (results / report).read_text()
        for field in ("**Workload", "**Hardware:**", "**Versions:**", "**Command:**", "|---|"):
            assert field in text, f"{report} lacks {field}"


def test_no_product_file_points_at_a_results_diary_or_a_date():
    offenders = []
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if "NOTES.md" in text or re.search(r"\b20\d\d-\d\d-\d\d\b", text):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_the_wheel_carries_its_dependencies_entry_point_and_type_markers(tmp_path):
    pytest.importorskip("build")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    (wheel,) = tmp_path.glob("prefetch_planner-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert {f"{p}/py.typed" for p in ("planner", "runtime", "search_spaces", "jobs")} <= names
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    core = [Requirement(r) for r in requires if "extra ==" not in r]
    torch_req = next(r for r in core if r.name == "torch")
    assert torch_req.specifier.contains("2.14.1") and torch_req.specifier.contains("2.13.0")
    assert not torch_req.specifier.contains("2.16.0") and not torch_req.specifier.contains("2.12.0")
    assert "transformers" not in {r.name for r in core}
    assert f"Name: {DISTRIBUTION}" in metadata and "License-Expression: BSD-3-Clause" in metadata
    assert "prefetch-planner = jobs.cli:main" in entry_points
    assert not any(n.startswith(("tests/", "bench/", "docs/")) for n in names)


def test_the_top_level_is_the_design_cards_and_the_release_files():
    card = {"pyproject.toml", "planner", "runtime", "search_spaces", "tests", "studies", "README.md"}
    release = {"LICENSE", "CHANGELOG.md", "mkdocs.yml", "docs", "jobs", "bench", ".ci", ".gitignore"}
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    top = {line.split("/", 1)[0] for line in tracked.stdout.splitlines()}
    assert top == card | release
