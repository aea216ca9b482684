"""Fixtures of the fault suite, and the generator of its table (tests/faults/README.md).

Each fault test declares its row with `@pytest.mark.fault(fault=..., where=..., checked=...)` and may add
measured facts through the `fault_row` fixture; the outcome is filled in from the test's reports (a failed
shared scenario shows as an error of its tests), and at the end of the session the table in README.md is
rewritten. Rows of tests that did not run in the session keep their previous line.

Expensive runs are session fixtures shared by several tests (see scenarios.py for what each does).
"""

from __future__ import annotations

import datetime
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fault_kit import PREFECT_API, forbidden_modules_loaded, prefect_environment

prefect_environment(Path(tempfile.mkdtemp(prefix="forge-faults-prefect-home-")))

README = Path(__file__).with_name("README.md")
_TABLE_START = "<!-- fault-table:start -->"
_TABLE_END = "<!-- fault-table:end -->"


@dataclass
class FaultRow:
    test: str
    fault: str
    where: str
    checked: str
    facts: list[str] = field(default_factory=list)
    result: str = "not run"

    def fact(self, text: str) -> None:
        """A measured value worth reading in the table (e.g. "resumed from step 1")."""
        self.facts.append(text)

    def markdown(self) -> str:
        checked = self.checked + (f" ({'; '.join(self.facts)})" if self.facts else "")
        cells = [self.fault, self.where, checked, self.result, f"`{self.test}`"]
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


_rows: dict[str, FaultRow] = {}


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "fault(fault, where, checked): this test's row in tests/faults/README.md"
    )


def _row_of(item) -> FaultRow | None:
    marker = item.get_closest_marker("fault")
    if marker is None:
        return None
    if item.nodeid not in _rows:
        _rows[item.nodeid] = FaultRow(item.name, **marker.kwargs)
    return _rows[item.nodeid]


_SUITES = (Path(__file__).parent, Path(__file__).parents[1] / "security")


def _phase(item) -> int:
    """0: cheap tests (scenario 1 runs in the background meanwhile); 1: scenario 4's (once scenario 1's SFT
    is done); 2: scenario 3's (scenario 2 runs in the background meanwhile); 3: scenarios 1-2's."""
    names = getattr(item, "fixturenames", ())
    if "flow_rerun" in names:
        return 3
    if "faulted_run" in names:
        return 2
    return 1 if "outage_run" in names else 0


def pytest_collection_modifyitems(session, config, items) -> None:
    """Order the fault and security tests by `_phase`, kept together where the first of them was, so that
    the scenarios that run as processes of their own overlap with the others."""
    ours = [item for item in items if any(item.path.is_relative_to(suite) for suite in _SUITES)]
    if not ours:
        return
    first = items.index(ours[0])
    mine = set(ours)
    others = [item for item in items if item not in mine]
    items[:] = others[:first] + sorted(ours, key=_phase) + others[first:]


@pytest.fixture
def fault_row(request) -> FaultRow:
    """This test's line in the README table (declared by its `fault` marker), for measured facts."""
    row = _row_of(request.node)
    assert row is not None, (
        f"{request.node.nodeid}: add @pytest.mark.fault(fault=..., where=..., checked=...)"
    )
    return row


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    row = _row_of(item)
    if row is None:
        return
    if report.when == "call":
        row.result = (
            "pass" if report.passed else ("skipped" if report.skipped else f"FAIL: {_first_line(report)}")
        )
    elif report.failed:  # setup or teardown failed (e.g. a shared scenario)
        row.result = f"ERROR in {report.when}: {_first_line(report)}"


def _first_line(report) -> str:
    text = str(getattr(report, "longrepr", "") or "")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("E ")]
    return (lines[0][2:].strip() if lines else text.strip().splitlines()[-1:][0] if text.strip() else "")[
        :160
    ]


def pytest_sessionfinish(session, exitstatus):
    if _rows:
        write_table(list(_rows.values()))


def write_table(rows: list[FaultRow]) -> None:
    """Rewrite the README table: this session's rows replace the previous lines of the same tests."""
    previous = _previous_lines()
    lines = dict(previous)
    for row in rows:
        lines[row.test] = row.markdown()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    table = "\n".join(
        [
            _TABLE_START,
            (
                f"_Last written by `pytest tests/faults` on {stamp}; rows of tests that did not run then "
                "keep their previous result._"
            ),
            "",
            "| fault | where | what was checked | result | test |",
            "| --- | --- | --- | --- | --- |",
            *lines.values(),
            _TABLE_END,
        ]
    )
    text = README.read_text() if README.exists() else _README_HEAD
    if _TABLE_START in text and _TABLE_END in text:
        head, rest = text.split(_TABLE_START, 1)
        tail = rest.split(_TABLE_END, 1)[1]
        text = head + table + tail
    else:
        text = text.rstrip() + "\n\n" + table + "\n"
    README.write_text(text)


def _previous_lines() -> dict[str, str]:
    if not README.exists():
        return {}
    text = README.read_text()
    if _TABLE_START not in text:
        return {}
    block = text.split(_TABLE_START, 1)[1].split(_TABLE_END, 1)[0]
    lines = {}
    for line in block.splitlines():
        match = re.search(r"\| `([^`]+)` \|$", line.strip())
        if match:
            lines[match.group(1)] = line.strip()
    return lines


_README_HEAD = """# Fault suite

`pytest tests/faults` runs the tiny pipeline (configs/tiny_test.yaml) or single stages under injected
faults and checks that the stages are retryable as promised. The faults are real: a rank SIGKILLs itself
or hangs (FORGE_FAULT, forge_core/faults.py), the vLLM engine core process is SIGKILLed mid-generation,
the moto S3 server is shut down in the middle of a checkpoint commit and restarted, bytes of a committed
checkpoint are overwritten, the flow process itself is SIGKILLed. torchrun, the launcher, Prefect (a real
API) and the storage layer handle them as they would in production.

The table below is written by the suite itself (tests/faults/conftest.py) at the end of every pytest session
that ran fault tests; rows of tests that did not run keep their previous line. To regenerate it:

    .venv/bin/python -m pytest tests/faults -q -p no:cacheprovider -m "not slow"

The measured facts in parentheses (attempt outcomes and times, deadlines, counts) come from that run.
"""


# ---- session resources ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (the test harness), shared with tests/security; yields its URL."""
    url = PREFECT_API.acquire()
    try:
        yield url
    finally:
        PREFECT_API.release()


def _session_uses(session, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session", autouse=True)
def flow_to_kill(request, tmp_path_factory):
    """Scenario 1 (scenarios.FlowToKill), started with the first fault test of a session that needs it: it is
    a process of its own, so the cheap tests and scenario 4 run meanwhile. On teardown it is ended with
    whatever it left running, had the re-run that should reap that not run."""
    if not _session_uses(request.session, "killed_flow"):
        yield None
        return
    from scenarios import FlowToKill

    flow = FlowToKill(tmp_path_factory.mktemp("flow-killed"), request.getfixturevalue("prefect_api"))
    try:
        yield flow
    finally:
        flow.close()


@pytest.fixture(scope="session")
def killed_flow(flow_to_kill):
    """Scenario 1's outcome: its prepare/SFT/eval/rollout are the uninterrupted reference."""
    return flow_to_kill.result()


@pytest.fixture(scope="session")
def flow_rerun_process(prefect_api, killed_flow):
    """Scenario 2 (scenarios.FlowRerunProcess), started as soon as scenario 1 is killed: the orphans it must
    end are there only until their collective times out."""
    from scenarios import FlowRerunProcess

    rerun = FlowRerunProcess(killed_flow, prefect_api)
    try:
        yield rerun
    finally:
        rerun.close()


@pytest.fixture(scope="session")
def flow_rerun(flow_rerun_process):
    """Scenario 2's outcome."""
    return flow_rerun_process.result()


@pytest.fixture(scope="session")
def faulted_run(request, prefect_api, killed_flow, tmp_path_factory):
    """Scenario 3 (SFT hang + kill + corrupt checkpoint, vLLM engine kill). The SFT deadline is sized from
    the uninterrupted SFT launch of scenario 1, so that a healthy attempt always fits and a hung one ends
    soon (the hung attempt costs the whole deadline). Scenario 2, a process of its own, is started first
    when the session needs it: it runs mostly while the hung attempt waits, and has mostly ended by the
    time the healthy attempts run (the factor 3 leaves room for some overlap)."""
    from scenarios import faulted_sft_and_rollout

    if _session_uses(request.session, "flow_rerun"):
        request.getfixturevalue("flow_rerun_process")
    deadline_s = max(60.0, 3.0 * killed_flow.sft_launch_s)
    return faulted_sft_and_rollout(tmp_path_factory.mktemp("faulted"), deadline_s)


@pytest.fixture(scope="session")
def outage_run(prefect_api, fake_aws_credentials, fake_aws_env, tmp_path_factory, flow_to_kill):
    """Scenario 4 (moto S3 down mid checkpoint commit), with fake AWS and wandb secrets planted."""
    from scenarios import FAKE_WANDB_API_KEY, s3_outage

    secrets = {**fake_aws_credentials, "WANDB_API_KEY": FAKE_WANDB_API_KEY}
    if flow_to_kill is not None:
        # Scenario 1's SFT time sizes scenario 3's hang deadline: measure it without this run competing.
        flow_to_kill.wait_until_stage_done("sft")
    return s3_outage(tmp_path_factory.mktemp("s3-outage"), secrets)


@pytest.fixture(autouse=True)
def _keeps_flask_out_of_the_test_process(request):
    """After each test: no moto server / Flask in this process (it would break tests/rollout's in-process
    vLLM engine later in the same session; servers belong in child processes)."""
    yield
    loaded = forbidden_modules_loaded()
    assert not loaded, f"{request.node.nodeid} left {loaded} in sys.modules of the pytest process"
