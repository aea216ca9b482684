"""bench.run_all: discovery, RESULTS.md regeneration from result files, running a benchmark script."""

from __future__ import annotations

import json

import pytest

from bench import run_all
from bench.run_all import TABLE_END, TABLE_START, discover, load_results, render_table, update_results_md


def write_fixture(folder, name, value, baseline, target, details=None):
    result = {
        "name": name,
        "value": value,
        "baseline": baseline,
        "ratio": value / baseline,
        "target": target,
        "unit": "s",
        "details": details or {},
    }
    (folder / f"{name}.json").write_text(json.dumps(result))


def test_discover_skips_the_harness_runner_and_private_modules(tmp_path):
    for stem in ("__init__", "harness", "run_all", "_util", "sft_step", "rollout_tput"):
        (tmp_path / f"{stem}.py").write_text("")
    (tmp_path / "notes.md").write_text("")
    assert discover(tmp_path) == ["rollout_tput", "sft_step"]


def test_results_md_table_regenerated_between_markers(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write_fixture(results, "zeta", 2.0, 1.0, "<=1.1", {"repeats": 5, "ours_s": [1.9, 2.0, 2.1], "ok": True})
    write_fixture(results, "alpha", 0.98, 1.0, ">=0.95", {"note": "a|b"})
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# Results\n\nintro prose\n\n{TABLE_START}\nstale table\n{TABLE_END}\n\nclosing prose\n")

    text = update_results_md(md, results)

    assert text == md.read_text()
    assert "stale table" not in text and "intro prose" in text and text.endswith("closing prose\n")
    table = text.split(TABLE_START)[1].split(TABLE_END)[0].strip().splitlines()
    assert table[0] == "| benchmark | value | baseline | ratio | target | met? | unit | details |"
    assert table[2] == "| `alpha` | 0.98 | 1 | 0.980 | `>=0.95` | yes | s | note=a\\|b |"
    assert (
        table[3]
        == "| `zeta` | 2 | 1 | 2.000 | `<=1.1` | **no** | s | repeats=5, ours_s=[3 values], ok=true |"
    )
    # Idempotent: a second run gives the same file.
    assert update_results_md(md, results) == text


def test_results_md_without_markers_gets_the_table_appended(tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    text = update_results_md(md, tmp_path)
    assert text == f"# Results\n\n{TABLE_START}\n_No results yet: run `make bench`._\n{TABLE_END}\n"


def test_malformed_result_file_is_named(tmp_path):
    (tmp_path / "broken.json").write_text(json.dumps({"name": "broken", "value": 1}))
    with pytest.raises(ValueError, match=r"broken.json: missing keys \['baseline'"):
        load_results(tmp_path)


def test_details_summary_is_cut_to_width():
    (row,) = render_table(
        [
            {
                "name": "n",
                "value": 1.0,
                "baseline": 1.0,
                "ratio": 1.0,
                "target": ">=1",
                "unit": "s",
                "details": {f"key{i}": i for i in range(40)},
            }
        ]
    ).splitlines()[2:]
    assert row.endswith("… |") and len(row.split(" | ")[-1]) <= run_all.DETAILS_WIDTH + 2


def test_run_benchmark_runs_the_script_as_a_module(tmp_path):
    package = tmp_path / "bench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "ok_bench.py").write_text("print('ran')\n")
    (package / "bad_bench.py").write_text("raise SystemExit(3)\n")
    (package / "slow_bench.py").write_text("import time\ntime.sleep(60)\n")
    assert run_all.run_benchmark("ok_bench", timeout_s=60, cwd=tmp_path).ok
    assert run_all.run_benchmark("bad_bench", timeout_s=60, cwd=tmp_path).returncode == 3
    slow = run_all.run_benchmark("slow_bench", timeout_s=1, cwd=tmp_path)
    assert slow.returncode is None and not slow.ok
