"""The Dagster UI in a real browser: `dagster dev` on loopback, driven by headless Chromium.

One test walks what a user does on a fresh instance: open the asset graph, dismiss the
community modal, launch `code_corpus` for one partition from the asset page, watch the run
page until it shows Success, and find the schedules and sensors on the Automation page.
Running schedules are stopped once the server is up, so that no scheduled run (the nightly
refresh is on by default) lands in the middle of the test.
Screenshots land in tests/artifacts/ (and, on failure, a screenshot, the page text and the
tail of the `dagster dev` log).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest
from selenium import webdriver
from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.conftest import ROOT, _free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = ROOT / "tests" / "artifacts"
SOURCE = "ui-demo"
SECOND = "ui-more"  # a second source, for the backfill through the daemon
AUTOMATIONS = ["new_source_sensor", "record_run_failures", "rebuild_shards_after_ingest", "nightly_data_refresh", "weekly_train",
               "production_traces_sensor", "cycle_schedule"]
SERVER_START_S = 180
RUN_S = 150
UI_S = 45


def _graphql(base: str, query: str, variables: dict | None = None) -> dict:
    req = urllib.request.Request(
        base + "/graphql",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.load(resp)
    if doc.get("errors"):
        raise AssertionError(f"GraphQL error: {doc['errors'][0].get('message')}")
    return doc["data"]


def _group_alive(pgid: int) -> list[int]:
    """Processes of the group that are still running (zombies excluded)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


LOCATIONS_QUERY = """{ workspaceOrError { __typename ... on Workspace { locationEntries {
  name loadStatus locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


SCHEDULES_QUERY = """{ schedulesOrError(repositorySelector: {repositoryName: "__repository__",
  repositoryLocationName: "composer_dag"}) { __typename ... on Schedules { results {
  name scheduleState { id status } } } } }"""
STOP_SCHEDULE = """mutation($id: String!) { stopRunningSchedule(id: $id) { __typename
  ... on PythonError { message } } }"""


def _stop_schedules(base: str) -> list[str]:
    """Stop every running schedule, so that no scheduled run (nightly_data_refresh is on by
    default) lands in the middle of the test; returns the names stopped."""
    schedules = _graphql(base, SCHEDULES_QUERY)["schedulesOrError"]["results"]
    stopped = []
    for s in schedules:
        if s["scheduleState"]["status"] == "RUNNING":
            result = _graphql(base, STOP_SCHEDULE, {"id": s["scheduleState"]["id"]})["stopRunningSchedule"]
            assert result["__typename"] == "ScheduleStateResult", f"cannot stop {s['name']}: {result}"
            stopped.append(s["name"])
    return stopped


BACKFILL = """mutation($params: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $params) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message }
  ... on InvalidSubsetError { message } ... on UnauthorizedError { message } } }"""
BACKFILL_STATUS = """query($id: String!) { partitionBackfillOrError(backfillId: $id) {
  __typename ... on PartitionBackfill { status } ... on PythonError { message } } }"""


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory):
    """`dagster dev` on 127.0.0.1 with a fresh instance and two tiny local sources, started once
    for the tests of this module, with the two-partition backfill of the last test launched as
    soon as it serves (the daemon runs it while the browser test launches its own run)."""
    tmp_path = tmp_path_factory.mktemp("dagster_ui")
    src = tmp_path / "src"
    src.mkdir()
    (src / "shapes.py").write_text("def area(w, h):\n    return w * h\n")
    (src / "greet.py").write_text("def greet(name):\n    return f'hello {name}'\n")
    more = tmp_path / "more"
    more.mkdir()
    (more / "units.py").write_text("def to_cm(inches):\n    return inches * 2.54\n")
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: {SOURCE}\n    kind: local\n    uri: {src}\n"
                       f"  - name: {SECOND}\n    kind: local\n    uri: {more}\n")
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "deploy" / "dagster.yaml", home / "dagster.yaml")
    (tmp_path / "tmp").mkdir()

    # The partition exists before the daemon starts, so new_source_sensor requests no run of
    # its own: the only run is the one launched from the browser.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("sources", [SOURCE, SECOND])

    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSER_", "DAGSTER_", "AWS_"))}
    env.update(
        DAGSTER_HOME=str(home),
        COMPOSER_HOME=str(tmp_path / "composer"),
        COMPOSER_STORAGE_ROOT=str(tmp_path / "artifacts"),
        COMPOSER_CATALOG=str(tmp_path / "catalog.duckdb"),
        COMPOSER_SOURCES=str(sources),
        TMPDIR=str(tmp_path / "tmp"),  # gRPC sockets and temp workspaces stay inside tmp_path
    )
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "dagster_dev.log"
    dagster = Path(sys.executable).with_name("dagster")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(dagster), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline, last = time.monotonic() + SERVER_START_S, "no answer yet"
        while True:
            try:
                urllib.request.urlopen(base + "/server_info", timeout=2).read()
                entries = _graphql(base, LOCATIONS_QUERY)["workspaceOrError"]["locationEntries"]
                if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                    break
                last = f"code location {[e['loadStatus'] for e in entries]}"
            except (OSError, ValueError, AssertionError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if proc.poll() is not None:
                pytest.fail(f"dagster dev exited with {proc.returncode} before serving:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"dagster dev did not serve {base} within {SERVER_START_S}s ({last}):\n{_log_tail(log)}")
            time.sleep(0.5)
        errors = [e for e in entries if e["locationOrLoadError"]["__typename"] == "PythonError"]
        assert not errors, f"code location failed to load: {errors[0]['locationOrLoadError']['message']}"
        _stop_schedules(base)
        # The backfill of the last test is launched now, as the Materialize dialog would launch
        # it, so that the daemon (which looks for backfills every 30 s) runs it while the browser
        # test runs; that test checks only its own run.
        backfill = _graphql(base, BACKFILL, {"params": {"assetSelection": [{"path": ["code_corpus"]}],
                                                         "partitionNames": [SOURCE, SECOND]}})["launchPartitionBackfill"]
        yield {"base": base, "home": home, "log": log, "storage": tmp_path / "artifacts", "backfill": backfill}
    finally:
        # Ctrl-C for the whole group, as in a terminal; whatever has not exited after a few
        # seconds is killed, and nothing of the group may survive.
        pgid = proc.pid
        try:
            os.killpg(pgid, signal.SIGINT)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(pgid), f"processes of dagster dev survived teardown: {_group_alive(pgid)}"


@pytest.fixture
def browser():
    for exe in (CHROMIUM, CHROMEDRIVER):
        if not os.access(exe, os.X_OK):
            pytest.fail(f"{exe} is missing: install the Debian packages chromium and chromium-driver (make install)")
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1600,1000",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Page:
    """Explicit waits on what the page shows; nothing waits a fixed time."""

    def __init__(self, driver, base: str):
        self.d, self.base = driver, base
        self.retry = (StaleElementReferenceException, ElementClickInterceptedException)

    def open(self, path: str):
        self.d.get(self.base + path)

    def text(self) -> str:
        try:
            return self.d.find_element(By.TAG_NAME, "body").text
        except self.retry:
            return ""

    def wait(self, what: str, cond, timeout: float = UI_S):
        """Poll ``cond()`` until it returns something truthy; fail naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = cond()
                if got:
                    return got
            except self.retry:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} on {self.d.current_url}")
            time.sleep(0.25)

    def find(self, xpath: str, timeout: float = UI_S):
        def visible():
            els = [e for e in self.d.find_elements(By.XPATH, xpath) if e.is_displayed()]
            return els[0] if els else None

        return self.wait(f"element {xpath}", visible, timeout)

    def click(self, xpath: str, timeout: float = UI_S):
        """Click the first visible enabled match, retrying while React re-renders it."""

        def clicked():
            el = self.find(xpath, timeout)
            if not el.is_enabled():
                return False
            el.click()
            return True

        self.wait(f"a clickable {xpath}", clicked, timeout)

    def gone(self, xpath: str, timeout: float = UI_S):
        self.wait(f"{xpath} to disappear", lambda: not any(e.is_displayed() for e in self.d.find_elements(By.XPATH, xpath)), timeout)

    def shows(self, *words: str, timeout: float = UI_S):
        try:
            self.wait(f"{words}", lambda: all(w in self.text() for w in words), timeout)
        except AssertionError:
            body = self.text()
            missing = [w for w in words if w not in body]
            raise AssertionError(f"{self.d.current_url} does not show {missing}") from None

    def shot(self, name: str) -> Path:
        path = ARTIFACTS / name
        assert self.d.save_screenshot(str(path)), f"could not save {path}"
        return path


def _save_failure(page: Page, log: Path):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        page.d.save_screenshot(str(ARTIFACTS / "ui_failure.png"))
        url, body = page.d.current_url, page.text()
    except Exception as exc:  # the browser itself may be gone
        url, body = "?", f"(page unavailable: {exc})"
    (ARTIFACTS / "ui_failure.txt").write_text(
        f"url: {url}\n\n--- page text ---\n{body}\n\n--- dagster dev log (tail) ---\n{_log_tail(log, 80)}\n"
    )


def _no_community_modal(page: Page, base: str):
    """The instance configuration `make` writes (deploy/dagster.yaml, ``nux: enabled: false``) turns
    Dagster's first-run 'Join the Dagster community' dialog off: a fresh `make dev` opens on the page."""
    assert _graphql(base, "{ shouldShowNux }")["shouldShowNux"] is False
    assert "Join the Dagster community" not in page.text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ui_materializes_a_partition_and_lists_automations(dagster_ui, browser):
    """Proves the code location loads and works under `dagster dev` as a user meets it: the asset
    graph renders, a `code_corpus` partition launched from the asset page's dialog runs to
    Success (on the run page, in the instance and over GraphQL, with its artifacts where
    COMPOSER_STORAGE_ROOT points), and the Automation page lists every schedule and sensor the
    definitions declare. Fails if the location cannot load, the launch dialog cannot select the
    partition, the run fails, or any of the four automations is missing."""
    base, home = dagster_ui["base"], dagster_ui["home"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = Page(browser, base)
    try:
        # 1. The asset graph: the global lineage (groups), then the data group with its nodes.
        page.open("/asset-groups")
        page.shows("Global asset lineage", "data", "pretrain", "rl")
        _no_community_modal(page, base)
        page.open("/locations/composer_dag/asset-groups/data")
        page.find("//*[normalize-space()='code_corpus']")
        page.shows("code_corpus", "deduped_shards", "2 partitions")
        page.shot("ui_asset_graph.png")

        # 2. Launch code_corpus[ui-demo] from the asset page's Materialize dialog.
        page.open("/assets/code_corpus")
        page.click("//button[normalize-space()='Materialize…' or normalize-space()='Materialize']")
        dialog = "//*[@role='dialog'][.//*[contains(normalize-space(), 'Launch runs to materialize code_corpus')]]"
        page.find(dialog)
        page.click(dialog + "//*[normalize-space()='Select a partition or create one']")
        page.click(f"//label[.//*[@role='menuitem']][.//*[normalize-space()='{SOURCE}']]")
        page.d.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)  # closes the list
        page.find(dialog + "//*[normalize-space()='1 partition']")
        page.click(dialog + "//button[normalize-space()='Launch 1 run']")
        view = page.find("//a[normalize-space()='View'][contains(@href, '/runs/')]")
        run_id = view.get_attribute("href").split("/runs/", 1)[1].split("?")[0]
        assert len(run_id) == 36, f"unexpected run link {view.get_attribute('href')}"

        # 3. The run page shows Success.
        page.open(f"/runs/{run_id}")
        status_tag = "//*[starts-with(@aria-label, 'run_')]/following-sibling::*[1]"
        final = ("Success", "Failure", "Canceled")

        def final_status():
            shown = {e.text.strip() for e in page.d.find_elements(By.XPATH, status_tag)}
            return next((s for s in final if s in shown), None)

        done = page.wait(f"run {run_id} to finish", final_status, timeout=RUN_S)
        assert done == "Success", f"run {run_id} shows {done} in the UI"
        page.shows("code_corpus", f"partition: {SOURCE}")
        page.shot("ui_run_success.png")

        # 4. The Automation page lists the sensors and schedules.
        page.open("/automation")
        page.shows(*AUTOMATIONS)
        page.shot("ui_automation.png")
    except BaseException:
        _save_failure(page, dagster_ui["log"])
        raise

    # The run as the instance and the GraphQL API record it.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_run_by_id(run_id)
        assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
        assert run.tags.get("dagster/partition") == SOURCE
        assert run.tags.get("dagster/from_ui") == "true"
        # The partition existed before the daemon started, so the sensor launched nothing beside it.
        assert not [r.run_id for r in instance.get_runs() if r.tags.get("dagster/sensor_name") == "new_source_sensor"]
        events = instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        assert [e.dagster_event.partition for e in events] == [SOURCE]
        assert events[0].asset_materialization.metadata["files_ingested"].value == 2
    gql = _graphql(base, "query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }", {"id": run_id})
    assert gql["runOrError"] == {"__typename": "Run", "status": "SUCCESS"}
    assert (dagster_ui["storage"] / "code_corpus" / run_id).is_dir(), "artifacts missing under COMPOSER_STORAGE_ROOT"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_backfill_over_sources_is_one_run_through_the_daemon(dagster_ui):
    """Proves the single-run backfill policy where it matters, in the daemon: a backfill of both
    code_corpus partitions, launched over the UI's GraphQL API as the Materialize dialog does,
    completes as exactly one run whose range covers both sources, and each partition gets its
    own materialization and artifact. Fails if the backfill is split into a run per partition
    or a partition is left unmaterialized."""
    base, home = dagster_ui["base"], dagster_ui["home"]
    out = dagster_ui["backfill"]  # launched over the API when `dagster dev` came up (see the fixture)
    assert out["__typename"] == "LaunchBackfillSuccess", out
    backfill_id = out["backfillId"]
    deadline, status = time.monotonic() + RUN_S + 60, None
    while time.monotonic() < deadline:
        res = _graphql(base, BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        assert res["__typename"] == "PartitionBackfill", res
        status = res["status"]
        if status in ("COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"):
            break
        time.sleep(1)
    assert status in ("COMPLETED", "COMPLETED_SUCCESS"), f"backfill {backfill_id} ended {status}:\n{_log_tail(dagster_ui['log'])}"
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        assert len(runs) == 1, [r.tags for r in runs]
        (run,) = runs
        assert run.status == dg.DagsterRunStatus.SUCCESS
        assert (run.tags.get("dagster/asset_partition_range_start"), run.tags.get("dagster/asset_partition_range_end")) == (SOURCE, SECOND)
        events = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        per_source = {e.dagster_event.partition: e.asset_materialization.metadata for e in events
                      if "files_ingested" in e.asset_materialization.metadata
                      and "partition_uris" not in e.asset_materialization.metadata}
        assert set(per_source) == {SOURCE, SECOND}
        assert per_source[SECOND]["files_ingested"].value == 1
        for meta in per_source.values():
            assert Path(meta["dagster/uri"].value.removeprefix("file://")).is_dir()
