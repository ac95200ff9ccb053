from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_KEY = "AKIAFAKEFAKEFAKE0001"
FAKE_SECRET = "fake/secret/never-printed-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Modules whose tests take minutes: started first on their worker.
LONG_FIRST = ("tests.rl.test_fleet", "tests.rl.test_rl_learn", "tests.graph.test_ui_browser", "tests.graph.test_faults_kill",
              "tests.train.test_midtrain", "tests.rl.test_sft")


# Modules that read the whole-graph run (the session's ``graph``) without running Slurm jobs of
# their own: they keep their place after the Slurm group.
READ_GRAPH = ("tests.traces.test_realtime_traces",)


def _group(item) -> str:
    names = getattr(item, "fixturenames", ())
    return "slurm" if "two_node_cluster" in names and item.module.__name__ not in READ_GRAPH else item.module.__name__


# What a test needs, from the fixtures it uses and the area it lies in (``pyproject.toml`` names the
# markers; ``make test-fast`` leaves out every test that needs a service or is slow).
NEEDS_BY_FIXTURE = {
    "slurm": {"two_node_cluster", "slurm_two_nodes", "cluster_bucket", "graph"},
    "vllm": {"servers", "promoted_servers", "promoted_base", "promoted_sessions"},
    "s3": {"s3_server", "s3_bucket", "cluster_bucket", "s3_root"},
    "browser": {"browser", "dagster_ui"},
}
# areas whose tests run programs in bubblewrap sandboxes, as root (the sandbox, the laptop,
# grading, harness episodes, repository environments, tasks verified in the sandbox)
BWRAP_AREAS = ("sandbox", "laptop", "grading", "harness", "repos", "tasks")
VLLM_MODULES = ("tests.rl.test_inference", "tests.rl.test_fleet")


def _needs(item) -> set[str]:
    names = set(getattr(item, "fixturenames", ()))
    needs = {mark for mark, fixtures in NEEDS_BY_FIXTURE.items() if names & fixtures}
    module = item.module.__name__
    area = module.split(".")[1] if module.count(".") >= 2 else ""
    if module in VLLM_MODULES:
        needs.add("vllm")
    if module == "tests.graph.test_ui_browser":
        needs.add("browser")
    if area in BWRAP_AREAS or "slurm" in needs:  # the Slurm nodes run their jobs under bubblewrap too
        needs.add("bwrap")
    if needs & {"bwrap", "slurm"}:
        needs.add("root")
    return needs


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Markers for what each test needs (``_needs``) and the xdist group of each test, then the
    longest modules first: the ones that use the Slurm cluster (the whole-graph run), then those in
    ``LONG_FIRST``. Under ``make test`` (two pytest-xdist workers, ``--dist loadgroup``) one worker
    runs the whole-graph run and every test that reads it, the other the rest, so the session's
    graph, its two-node cluster and each module's fixtures (a pair of vLLM servers, `dagster dev`)
    start once."""
    for it in items:
        for mark in sorted(_needs(it)):
            it.add_marker(mark)
        # `--dist loadgroup` (make test PYTEST_WORKERS=2): the whole-graph run and every test that
        # reads it on one worker, the rest on the other
        graph_side = _group(it) == "slurm" or it.module.__name__ in READ_GRAPH
        it.add_marker(pytest.mark.xdist_group("graph" if graph_side else "rest"))
    order = ["slurm", *LONG_FIRST]
    items.sort(key=lambda it: order.index(_group(it)) if _group(it) in order else len(order))


@pytest.fixture(scope="session")
def two_node_cluster():
    """A real two-node Slurm cluster for the whole session (``tests/slurm_cluster.py``,
    ``TwoNodeCluster``): each ``slurmd`` in network, UTS, PID and mount namespaces of its own on a
    bridge, no writable path shared, moto's S3 server on the bridge address (``.s3_endpoint``).
    Every process, namespace and interface is removed at the end, and that is checked. Tests
    take ``slurm_two_nodes``, which points the Slurm commands at it."""
    from tests.slurm_cluster import NODE_BINARIES, TwoNodeCluster, missing

    why = missing(NODE_BINARIES)
    if why.startswith("not installed"):
        pytest.fail(why)
    if why:
        pytest.skip(why)
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="composer-slurm2-", dir="/var/tmp")  # each node mounts its own /tmp
    os.chmod(root, 0o755)
    cluster = TwoNodeCluster(Path(root)).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.interfaces()
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"the two-node cluster left interfaces or namespaces behind: {left}"


@pytest.fixture
def slurm_two_nodes(two_node_cluster, monkeypatch):
    """The two-node cluster, with ``SLURM_CONF`` pointing at it for this test and S3
    credentials for its S3 server in the environment."""
    monkeypatch.setenv("SLURM_CONF", str(two_node_cluster.conf))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("COMPOSER_S3_ENDPOINT_URL", two_node_cluster.s3_endpoint)
    return two_node_cluster


@pytest.fixture(scope="session")
def s3_server():
    """moto in server mode, a separate process serving the S3 API over HTTP on loopback."""
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start")
            time.sleep(0.2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


def _bucket(endpoint: str, monkeypatch) -> dict:
    import boto3

    name = f"composer-{time.time_ns()}"
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=FAKE_KEY, aws_secret_access_key=FAKE_SECRET, region_name="us-east-1"
    ).create_bucket(Bucket=name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("COMPOSER_S3_ENDPOINT_URL", endpoint)
    return {"bucket": name, "endpoint": endpoint, "options": {"endpoint_url": endpoint, "key": FAKE_KEY, "secret": FAKE_SECRET}}


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A fresh bucket on the S3 server, with fake credentials in the environment."""
    return _bucket(s3_server, monkeypatch)


@pytest.fixture
def cluster_bucket(slurm_two_nodes, monkeypatch):
    """A fresh bucket on the two-node cluster's S3 server (on its bridge: the nodes reach it),
    with fake credentials in the environment; the Slurm commands point at that cluster."""
    return _bucket(slurm_two_nodes.s3_endpoint, monkeypatch)


@pytest.fixture
def composer_home(tmp_path, monkeypatch):
    home = tmp_path / "composer"
    home.mkdir()
    monkeypatch.setenv("COMPOSER_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def graph(tmp_path_factory, two_node_cluster, repo_sdists):
    """The whole graph materialized once per session on the tiny configuration, on S3 and the
    two-node Slurm cluster (``tests/graph/test_graph_full.py``: ``materialize_graph``); the production
    cycles (``tests/traces/test_realtime_traces.py``) continue from its promoted model."""
    from tests.graph.test_graph_full import materialize_graph

    yield from materialize_graph(tmp_path_factory, two_node_cluster, repo_sdists)


@pytest.fixture(scope="session")
def humaneval_tasks(tmp_path_factory):
    """Three HumanEval tasks built once per session (``out``, ``summary``): read them, copy them
    before changing anything."""
    from composer_dag.tasks.sources.build import build_tasks

    out = tmp_path_factory.mktemp("humaneval-tasks")
    return out, build_tasks(out, {"humaneval_limit": 3, "bugfix_count": 0, "learnable_count": 0})


@pytest.fixture(scope="session")
def learnable_base(tmp_path_factory):
    """Six learnable tasks, the tokenizer trained for them and an untrained tiny policy, built
    once per session (``make_learnable_setup`` without warm-up): read them, copy them before
    changing anything."""
    import torch

    from composer_dag.rl.learnable import make_learnable_setup

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make_learnable_setup(tmp_path_factory.mktemp("learnable") / "setup", n_tasks=6, seed=0,
                                    words=("red", "blue"), warmup_steps=0)
    finally:
        torch.set_num_threads(threads)


class Servers:
    """A pair of vLLM OpenAI rollout servers on one policy, each on its own CPU."""

    def __init__(self, policy_dir, logs):
        from composer_dag.inference.server import ServerProcess

        self.procs = [ServerProcess(policy_dir, _free_port(), log_path=str(logs / f"server_{i}.log"), cpu=i % 2,
                                    max_model_len=1024, kv_cache_mb=32) for i in range(2)]

    @property
    def urls(self):
        return [p.url for p in self.procs]

    def start(self, timeout=600):
        for p in self.procs:
            p.start()
        for p in self.procs:
            p.wait_ready(timeout)
        return self

    def stop(self):
        for p in self.procs:
            p.stop()


def start_followers(urls, weights_uri, work, skip=None) -> list:
    """``composer_dag.rl.fleet.serve --attach`` beside each server of ``urls`` on ``weights_uri``
    (the loop a server that shares no disk with the orchestrator runs), rebuilding versions in
    ``work/follower_<i>``; ``skip``: [server index, version] it reports without reloading."""
    procs = []
    for i, url in enumerate(urls):
        cmd = [sys.executable, "-m", "composer_dag.rl.fleet.serve", "--attach", url, "--weights-uri", weights_uri,
               "--work-dir", str(work / f"follower_{i}"), "--poll-seconds", "0.2"]
        if skip and skip[0] == i:
            cmd += ["--skip-reload", str(skip[1])]
        with open(work / f"follower_{i}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def stop_processes(procs) -> None:
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="session")
def servers(learnable_base, tmp_path_factory):
    """The session's pair of rollout servers on the learnable family's tiny policy (``learnable_base``),
    started once (about 20 s and 1.5 GB each, idle at 0% CPU between tests): the fleet tests run
    on them (the production cycles, which continue from the whole-graph run's model and its own
    vocabulary, have a pair on that model: ``promoted_servers``). They run after
    the Slurm tests (``pytest_collection_modifyitems``), so the whole-graph run does not share the
    machine with them. A test leaves them on whatever weights it loaded; a follower or an
    orchestrator brings them to its own."""
    s = Servers(learnable_base["policy_dir"], tmp_path_factory.mktemp("servers"))
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="session")
def learnable_warm(tmp_path_factory):
    """The learnable family's setup with the tool-call warm-up (eight tasks, 100 steps): the
    policy the learning tests start from, one process and distributed, built once per session
    (about 45 s). Read it, copy it before changing anything."""
    import torch

    from composer_dag.rl.learnable import make_learnable_setup

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the warm-up: 44 s on two threads, 62 s on one; the same curve after it
    try:
        return make_learnable_setup(tmp_path_factory.mktemp("learnable-warm") / "setup", n_tasks=8, seed=0,
                                    words=("red", "blue"), warmup_steps=100)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bugfix_tasks(tmp_path_factory):
    """Two stdlib bug-fix tasks (one module each) built once per session (``out``, ``summary``):
    read them, copy them before changing anything."""
    from composer_dag.tasks.sources.build import build_tasks

    out = tmp_path_factory.mktemp("bugfix-tasks")
    return out, build_tasks(out, {"humaneval_limit": 0, "bugfix_count": 2, "bugfix_modules": ["colorsys", "fnmatch"],
                                  "max_per_module": 1, "learnable_count": 0})


# three pure-Python projects whose sdists carry their test suites: a flat module with tests/
# (parse), a flat package with a root-level test file and heavy parametrize (inflection), a
# src/ layout with unittest-style tests (cachetools)
REPO_SDISTS = (("parse", "1.20.2"), ("inflection", "0.5.1"), ("cachetools", "5.5.0"))
SDIST_DIR = Path(__file__).parent / "artifacts" / "sdists"


@pytest.fixture(scope="session")
def repo_sdists():
    """The sdists of ``REPO_SDISTS`` from the package index, downloaded once and kept under
    ``tests/artifacts/sdists``: {name: path}."""
    from composer_dag.repos.fetch import fetch_sdist

    return {name: fetch_sdist(name, version, SDIST_DIR) for name, version in REPO_SDISTS}


@pytest.fixture(scope="session")
def repo_envs(repo_sdists, tmp_path_factory):
    """The three environments bootstrapped once per session into one wheel store, through the
    command line (``{name: (env_dir, summary)}``, plus ``"_store"``): read them, copy them before
    changing anything."""
    root = tmp_path_factory.mktemp("repo-envs")
    out = {"_store": root / "store"}
    for name, path in repo_sdists.items():
        r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "env", "bootstrap", str(path), "--out",
                            str(root / name), "--store", str(root / "store")], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = (root / name, json.loads(r.stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="session")
def mined_tasks(repo_envs, tmp_path_factory):
    """Three tasks mined from the parse environment once per session (``out``, ``summary``)."""
    from composer_dag.tasks.sources.repo_mined import mine

    out = tmp_path_factory.mktemp("mined")
    return out, mine(repo_envs["parse"][0], out, max_tasks=3, seed=0)

