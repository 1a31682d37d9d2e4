"""The diagnostics dump (psserver/runtime/diagnostics.py): glibc's malloc_info summed, the
allocation sites that grew, a dump's content, and off unless the environment asks."""

from __future__ import annotations

import json
import tracemalloc

from paramserve.psserver.runtime import diagnostics

MALLOC_INFO = """<malloc version="1">
<heap nr="0">
<sizes>
  <size from="49" to="49" total="49" count="1"/>
</sizes>
<total type="fast" count="2" size="100"/>
<total type="rest" count="9" size="1000"/>
<system type="current" size="8000"/>
<system type="max" size="9000"/>
<aspace type="total" size="8000"/>
<aspace type="mprotect" size="8000"/>
</heap>
<heap nr="1">
<sizes>
</sizes>
<total type="fast" count="0" size="0"/>
<total type="rest" count="1" size="500"/>
<system type="current" size="4000"/>
<system type="max" size="4000"/>
<aspace type="total" size="4000"/>
<aspace type="mprotect" size="4000"/>
<aspace type="subheaps" size="1"/>
</heap>
<total type="fast" count="2" size="100"/>
<total type="rest" count="10" size="1500"/>
<total type="mmap" count="3" size="300000"/>
<system type="current" size="12000"/>
<system type="max" size="13000"/>
<aspace type="total" size="12000"/>
<aspace type="mprotect" size="12000"/>
</malloc>
"""


def test_malloc_info_is_summed_over_the_arenas_and_the_totals_are_not_counted_twice():
    assert diagnostics.malloc_summary(MALLOC_INFO) == {
        "arenas": 2,
        "system_bytes": 12000,
        "free_bytes": 1600,
        "in_use_bytes": 10400,
        "mmap_chunks": 3,
        "mmap_bytes": 300000,
    }


def test_this_process_malloc_info_parses_where_the_c_library_is_glibc():
    xml = diagnostics.malloc_info()
    if xml is not None:
        summary = diagnostics.malloc_summary(xml)
        assert summary["arenas"] >= 1 and summary["system_bytes"] >= summary["in_use_bytes"] > 0


def test_the_sites_that_grew_most_come_first_and_shrunk_or_new_empty_ones_are_left_out():
    before = {"a.py:1": (100, 1), "b.py:2": (500, 5), "c.py:3": (50, 1)}
    after = {"a.py:1": (1100, 11), "b.py:2": (400, 4), "c.py:3": (50, 1), "d.py:4": (300, 3)}
    grown = diagnostics.top_growth(before, after)
    assert [(entry["site"], entry["grew_bytes"], entry["grew_blocks"]) for entry in grown] == [
        ("a.py:1", 1000, 10),
        ("d.py:4", 300, 3),
    ]
    assert diagnostics.top_growth(before, after, limit=1)[0]["site"] == "a.py:1"


def test_nothing_is_installed_unless_the_environment_names_a_directory(tmp_path):
    assert diagnostics.from_environment("ps", dict, {}) is None
    assert diagnostics.from_environment("ps", dict, {diagnostics.DIRECTORY_ENV: ""}) is None
    made = diagnostics.from_environment("ps", dict, {diagnostics.DIRECTORY_ENV: str(tmp_path)})
    assert made is not None


def test_a_dump_holds_the_process_the_structures_and_numbered_files(tmp_path):
    dumps = diagnostics.Diagnostics(tmp_path, "ps", lambda: {"idempotency_keys": 7})
    first, second = dumps.dump(), dumps.dump()
    assert first.name.startswith("ps-") and first.name.endswith("-1.json") and second.name.endswith("-2.json")
    report = json.loads(second.read_text())
    assert report["dump"] == 2 and report["structures"] == {"idempotency_keys": 7}
    assert report["process"]["descriptors"] > 0 and report["process"]["python_threads"] >= 1
    assert "python_heap" not in report or tracemalloc.is_tracing()


def test_a_structures_callable_that_raises_is_reported_not_raised(tmp_path):
    def broken() -> dict[str, int]:
        raise RuntimeError("no store")

    report = json.loads(diagnostics.Diagnostics(tmp_path, "worker", broken).dump().read_text())
    assert "no store" in report["structures"]["error"]


def test_with_tracing_the_growing_allocation_site_is_named(tmp_path):
    was_tracing = tracemalloc.is_tracing()
    dumps = diagnostics.Diagnostics(tmp_path, "ps", dict, trace_frames=1)
    try:
        dumps.dump()
        kept = [bytearray(1000) for _ in range(200)]  # this line grows by about 200 kB
        report = json.loads(dumps.dump().read_text())
    finally:
        if not was_tracing:
            tracemalloc.stop()
    top = report["python_heap"]["grew_since_previous"][0]
    assert top["site"].endswith(f"{__file__}:{kept_line()}") and top["grew_bytes"] >= 200_000
    del kept


def kept_line() -> int:
    """The line of ``kept = ...`` in the test above."""
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, 1) if "kept = [bytearray" in line)
