"""ARCHITECTURE.md describes the packages as they are: a section per package folder
(``### psserver/store/``), each naming exactly the modules in that folder."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "ARCHITECTURE.md"
TOP_LEVELS = ("psserver", "coordinator", "worker")

SECTION = re.compile(r"^### ((?:psserver|coordinator|worker)(?:/[A-Za-z_][A-Za-z0-9_]*)*/)[ \t]*$", re.MULTILINE)
NEXT_HEADING = re.compile(r"^#{1,3} ", re.MULTILINE)
MODULE = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*\.py)\b")


def _sections() -> dict[str, str]:
    """Each ``### <folder>/`` section's text, up to the next heading of level 1 to 3."""
    text = DOC.read_text()
    sections: dict[str, str] = {}
    for match in SECTION.finditer(text):
        end = NEXT_HEADING.search(text, match.end())
        assert match.group(1) not in sections, f"two sections for {match.group(1)}"
        sections[match.group(1)] = text[match.end() : end.start() if end else len(text)]
    return sections


def _package_folders() -> list[str]:
    """Every folder of psserver/, worker/ and coordinator/ that holds an __init__.py."""
    folders = set()
    for top in ("psserver", "worker", "coordinator"):
        for init in (ROOT / top).rglob("__init__.py"):
            folders.add(init.parent.relative_to(ROOT).as_posix() + "/")
    return sorted(folders)


def _modules(folder: str) -> set[str]:
    return {path.name for path in (ROOT / folder).glob("*.py") if path.name != "__init__.py"}


def test_every_package_folder_has_a_section():
    assert sorted(set(_package_folders()) - set(_sections())) == []


def test_every_section_names_a_package_folder():
    assert sorted(set(_sections()) - set(_package_folders())) == []


@pytest.mark.parametrize("folder", _package_folders())
def test_a_package_section_names_exactly_the_modules_of_its_folder(folder):
    section = _sections().get(folder)
    if section is None:
        pytest.fail(f"ARCHITECTURE.md has no '### {folder}' section")
    named = set(MODULE.findall(section))
    actual = _modules(folder)
    assert (sorted(named - actual), sorted(actual - named)) == ([], []), (
        f"### {folder}: (named but not in the folder, in the folder but not named)"
    )
