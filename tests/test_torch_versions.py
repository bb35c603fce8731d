"""The torch versions the project states are the ones CI tests: the floor in pyproject.toml,
the version the README's commands install and the table of tested versions in
docs/getting-started.md all agree with the list at the top of ``.ci/run``."""

from __future__ import annotations

import re

from launch_helpers import ROOT
from test_torchrun_compat import NOT_ACCEPTED_YET
from torch_support import NEEDS_TORCH_2_6, ci_variables, version_tuple

GETTING_STARTED = ROOT / "docs" / "getting-started.md"
# Pages whose install commands name a torch: each names the README's.
INSTALL_PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", GETTING_STARTED,
                 ROOT / "docs" / "gpus.md"]


def _versions() -> dict[str, str]:
    ci = ci_variables()
    return {role: ci[f"TORCH_{role.upper()}"] for role in ("readme", "oldest", "newest")}


def _minor(version: str) -> str:
    return "{}.{}".format(*version_tuple(version))


def _section(text: str, heading: str) -> str:
    found = re.search(rf"^(#+) {re.escape(heading)}\n(.*?)(?=^#{{1,3}} )", text,
                      re.MULTILINE | re.DOTALL)
    assert found, f"no section {heading!r}"
    return found.group(2)


def test_ci_runs_an_oldest_a_readme_and_a_newest_torch_in_that_order():
    v = _versions()
    assert version_tuple(v["oldest"]) < version_tuple(v["readme"]) \
        <= version_tuple(v["newest"]), v


def test_the_floor_in_pyproject_is_the_oldest_torch_ci_runs():
    floors = re.findall(r'^\s*"torch>=([\d.]+)",', (ROOT / "pyproject.toml").read_text(),
                        re.MULTILINE)
    assert floors == [_minor(_versions()["oldest"])]


def test_the_readme_and_getting_started_state_that_floor():
    said = f"torch {_minor(_versions()['oldest'])} or later"
    for page in (ROOT / "README.md", GETTING_STARTED):
        assert said in " ".join(page.read_text().split()), f"{page.name}: {said!r}"


def test_every_install_command_installs_the_readme_s_torch():
    readme = _versions()["readme"]
    for page in INSTALL_PAGES:
        text = page.read_text().replace(_section(GETTING_STARTED.read_text(), "Torch versions"),
                                        "")
        pinned = set(re.findall(r"torch==([\d.]+)", text))
        assert pinned == {readme}, f"{page.name}: torch=={pinned}, CI's README torch {readme}"


def test_the_table_of_tested_versions_is_what_ci_runs():
    v = _versions()
    section = _section(GETTING_STARTED.read_text(), "Torch versions")
    rows = dict(re.findall(r"^\| ([\d.]+), [^|]+\| ([^|]+) \|$", section, re.MULTILINE))
    assert rows.keys() == set(v.values()), rows
    assert "whole suite" in rows[v["readme"]]
    for role in ("oldest", "newest"):
        assert "fast tier" in rows[v[role]] and "demo" in rows[v[role]], rows[v[role]]


def test_the_packages_left_out_below_torch_2_6_are_named_alike_everywhere():
    left_out = ci_variables()["NEEDS_TORCH_2_6"].split()
    assert set(left_out) == set(NEEDS_TORCH_2_6)
    section = " ".join(_section(GETTING_STARTED.read_text(), "Torch versions").split())
    assert f"--without {' '.join(left_out)}" in section
    assert f"pip install torch=={_versions()['oldest']} " in section


def test_the_torchrun_options_not_accepted_yet_are_named_in_getting_started():
    section = _section(GETTING_STARTED.read_text(), "Torch versions")
    for dest in NOT_ACCEPTED_YET:
        assert f"`--{dest.replace('_', '-')}`" in section, dest
