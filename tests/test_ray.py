"""`repro matrix --ray` on a real Ray cluster of this machine: a head and two worker nodes
started with Ray's own `ray start`, on the loopback address, the workers declaring GPUs
(2 and 1) so placement by GPU count is exercised, though the trials themselves are CPU ones
(gloo): no GPU was used, only declared resources.

The nodes get no PYTHONPATH: repro reaches them as the driver's copy (runtime_env py_modules).
Skipped only where Ray is not importable (`pip install -e '.[test]'` installs it).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_MATRIX, alive, watch_argv

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

# Small nodes: this machine has 2 cores. Node death is noticed within ~2 s, not Ray's default 30 s.
OBJECT_STORE = "100000000"
HEALTH = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "500",
}


# One trial that runs for minutes (a gloo all-gather per step) unless stopped, and a short one.
LONG = """\
[matrix]
device = "cpu"
deadline_s = 300
[[trial]]
scenario = "selftest"
tp = 2
steps = {steps}
[[trial]]
scenario = "selftest"
tp = 1
steps = 2
"""


# Ports Ray takes by default when not told otherwise (GCS, dashboard, client server, dashboard
# agent HTTP) and its worker range: a port of ours must be none of these. A node-manager port
# drawn at random once came out as 52365, the agent's default, and `ray start` refused it.
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365}
RAY_WORKER_PORTS = range(10002, 20000)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, none of them one Ray uses by default."""
    held, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            held.append(s)  # held open until all are drawn: all distinct
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in RAY_DEFAULT_PORTS and port not in RAY_WORKER_PORTS:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def node_ports(manager: int, agent_http: int) -> list[str]:
    """The per-node ports `ray start` would otherwise default (and collide on, three nodes on one machine)."""
    return ["--node-manager-port", str(manager), "--dashboard-agent-listen-port", str(agent_http)]


# Token authentication off, said explicitly: with the mode unset Ray turns it on wherever a
# ~/.ray/auth_token exists (any local ray.init() writes one), and nodes started otherwise
# then cannot join.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def node_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **HEALTH, **NO_AUTH}


def driver_env() -> dict:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("REPRO_WATCH")},
        "PYTHONPATH": str(REPO),
        **NO_AUTH,
    }


def ray_start(*args) -> None:
    done = subprocess.run(
        [
            "ray",
            "start",
            "--node-ip-address",
            "127.0.0.1",
            "--object-store-memory",
            OBJECT_STORE,
            "--disable-usage-stats",
            *args,
        ],
        env=node_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def start_worker(address: str, name: str, gpus: int, ports: list[int]) -> None:
    ray_start(
        "--address", address, "--node-name", name, "--num-cpus", "2", "--num-gpus", str(gpus), *node_ports(*ports)
    )


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU, no GPU) + worker-a (2 CPUs, 2 GPUs declared) + worker-b (2 CPUs, 1 GPU)."""
    started = time.monotonic()
    gcs, *ports = free_ports(7)  # drawn together: the cluster's ports all differ
    address = f"127.0.0.1:{gcs}"
    try:
        ray_start(
            "--head",
            "--port",
            str(gcs),
            "--node-name",
            "head",
            "--num-cpus",
            "1",
            "--num-gpus",
            "0",
            "--include-dashboard",
            "false",
            *node_ports(*ports[0:2]),
        )
        start_worker(address, "worker-a", 2, ports[2:4])  # one at a time: two at once overload 2 cores
        start_worker(address, "worker-b", 1, ports[4:6])
        sys.stderr.write(f"ray cluster up in {time.monotonic() - started:.1f} s\n")
        yield address
    finally:
        # Stops every Ray process of this user on this machine: the ones started above.
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)


def repro(*args, cwd, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "repro", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=driver_env(),
        timeout=timeout,
    )


def spawn(*args, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "repro", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=driver_env(),
    )


def outcomes(doc):
    return [(t["id"], t["outcome"], t["met"]) for t in doc["trials"]]


def test_matrix_on_ray_gives_each_trial_the_local_outcome(cluster, tmp_path):
    (tmp_path / "m.toml").write_text(TINY_MATRIX)
    local = repro("matrix", "--config", "m.toml", "--json", "local.json", "--artifacts", "runs", cwd=tmp_path)
    remote = repro(
        "matrix",
        "--config",
        "m.toml",
        "--ray",
        cluster,
        "--json",
        "ray.json",
        "--junit",
        "ray.xml",
        "--artifacts",
        "runs",
        cwd=tmp_path,
    )
    assert remote.returncode == local.returncode == 1, remote.stderr
    here, there = (json.loads((tmp_path / n).read_text()) for n in ("local.json", "ray.json"))
    assert outcomes(there) == outcomes(here)
    # Placed on the workers (the head's single CPU cannot hold a TP=2 trial's bundle of 2).
    by_id = {t["id"]: t for t in there["trials"]}
    assert by_id["00-selftest-clean-tp2-keep"]["node"] in ("worker-a", "worker-b")
    assert all("node" not in t for t in here["trials"])
    # Records came back to the driver's run folder, and the report points there.
    for t in there["trials"]:
        for name, path in t["artifacts"].items():
            assert (tmp_path / path).is_file() and str(tmp_path / "runs") in str((tmp_path / path).resolve())
        steps = [json.loads(line) for line in (tmp_path / t["artifacts"]["rank 0 records"]).read_text().splitlines()]
        assert any(e["event"] == "step" for e in steps)
    assert sorted(n["node"] for n in there["environment"]["ray"]["nodes"]) == ["head", "worker-a", "worker-b"]
    assert 'name="node" value="worker-' in (tmp_path / "ray.xml").read_text()


def test_gpu_trials_are_placed_by_their_gpu_count(cluster, tmp_path):
    # CUDA trials on nodes that only declare GPUs: the ranks cannot use CUDA here (CPU torch),
    # so each ends CRASH; what is checked is where Ray put them and which GPUs it gave them.
    (tmp_path / "g.toml").write_text("""\
[matrix]
device = "cuda"
deadline_s = 60
expect = "CRASH"
[[trial]]
scenario = "selftest"
tp = 2
steps = 1
[[trial]]
scenario = "selftest"
tp = 2
steps = 1
share_gpu = true
""")
    done = repro(
        "matrix", "--config", "g.toml", "--ray", cluster, "--json", "g.json", "--artifacts", "runs", cwd=tmp_path
    )
    trials = json.loads((tmp_path / "g.json").read_text())["trials"]
    assert done.returncode == 0, done.stderr
    two, shared = trials
    assert two["node"] == "worker-a"  # the only node with 2 GPUs
    assert "Ray gave this trial GPU(s) 0, 1 of its node" in two["notes"]
    assert shared["node"] in ("worker-a", "worker-b")  # --share-gpu: one GPU is enough
    assert any(n.startswith("Ray gave this trial GPU(s) ") and "," not in n for n in shared["notes"])


@pytest.mark.parametrize(
    "trial, line",
    [
        ('device = "cuda"\ntp = 4', "trial 00-selftest-clean-tp4-keep needs a node with 4 GPUs; largest has 2"),
        (
            'device = "cpu"\ntp = 3',
            "trial 00-selftest-clean-tp3-keep needs a node with 3 CPUs (one per rank); largest has 2",
        ),
    ],
)
def test_what_no_node_can_hold_is_refused_in_one_line(cluster, tmp_path, trial, line):
    (tmp_path / "r.toml").write_text(f'[[trial]]\nscenario = "selftest"\nsteps = 1\n{trial}\n')
    done = repro("matrix", "--config", "r.toml", "--ray", cluster, "--artifacts", "runs", cwd=tmp_path)
    assert done.returncode == 3
    assert done.stderr == f"repro: error: {line}\n"


def test_an_unreachable_cluster_is_exit_3_in_one_line(tmp_path):
    done = repro("matrix", "--ray", f"127.0.0.1:{free_ports(1)[0]}", "--list", cwd=tmp_path, timeout=120)
    assert done.returncode == 3 and done.stderr.startswith("repro: error: --ray 127.0.0.1:")
    assert done.stderr.count("\n") == 1 and "cannot reach a Ray cluster" in done.stderr


def test_watch_reaches_actors_on_every_node_and_ships_their_records(cluster, tmp_path):
    program = [sys.executable, str(REPO / "tests" / "watch_programs" / "ray_actors.py"), cluster]
    env = driver_env()
    plain = subprocess.run(program, capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode == 0, plain.stderr
    run_dir = tmp_path / "run"
    watched = subprocess.run(
        watch_argv(run_dir, *program, report=tmp_path / "w.json"),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert watched.returncode == 1, watched.stderr  # the stale capture on worker-a's actor
    assert watched.stdout == plain.stdout  # the program's output is its own
    assert "program_var mine" in plain.stdout  # its runtime_env reached the actors, watched too
    assert watched.stderr.count("watched=True") == 2 and plain.stderr.count("watched=False") == 2
    doc = json.loads((tmp_path / "w.json").read_text())
    actor_pids = {
        int(line.split()[2]): line.split()[0]
        for line in watched.stderr.splitlines()
        if line.startswith("worker-") and " pid " in line
    }
    assert sorted(actor_pids.values()) == ["worker-a", "worker-b"]
    # Records of each node's actor came back to the driver's run directory, one folder per node.
    for node in ("worker-a", "worker-b"):
        files = list((run_dir / f"ray-{node}").glob("*.jsonl"))
        assert files, f"no records shipped from {node}"
    listed = {p["pid"]: p for p in doc["processes"]}
    for pid, node in actor_pids.items():
        assert pid in listed and listed[pid]["record_file"].startswith(str(run_dir / f"ray-{node}"))
        assert listed[pid]["torch_hooked"]
    assert [f["pid"] for f in doc["findings"]] and {f["pid"] for f in doc["findings"]} == {
        pid for pid, node in actor_pids.items() if node == "worker-a"
    }
    assert any(n.startswith("Ray node worker-a: 1 watched process") for n in doc.get("notes", [])), doc.get("notes")
    assert any(n.startswith("Ray node worker-b: 1 watched process") for n in doc.get("notes", []))


def worker_pids(marker: str) -> list[int]:
    """Rank processes (`python -m repro.rank.worker SPEC RANK`) of the node-local trial folders
    (repro-trial-*) whose path holds marker."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"repro.rank.worker" in argv and any(marker.encode() in a and b"repro-trial-" in a for a in argv):
            pids.append(int(proc.name))
    return pids


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def raylet_of(pid: int) -> int:
    """The raylet above a process: the node it runs on."""
    while pid > 1:
        pid = parent(pid)
        if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
            return pid
    raise AssertionError("no raylet above the rank")


def wait_for(predicate, timeout=120.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def long_ranks():
    """Both ranks of the long trial (00-, TP=2), once they stepped."""
    pids = worker_pids("00-selftest-clean-tp2-keep")
    return pids if len(pids) == 2 else None


def stepped(folder: Path) -> bool:
    """The driver's copy of the long trial's rank 1 records holds a step (copied while it runs)."""
    return any('"event": "step"' in p.read_text() for p in folder.glob("runs/*/00-*/rank1.jsonl"))


def spawn_long_matrix(cluster: str, tmp_path: Path):
    """`repro matrix --ray` of the long trial (a million steps), from tmp_path."""
    (tmp_path / "l.toml").write_text(LONG.format(steps=1_000_000))
    return spawn(
        "matrix", "--config", "l.toml", "--ray", cluster, "--json", "l.json", "--artifacts", "runs", cwd=tmp_path
    )


def wait_stepping(tmp_path: Path) -> list[int]:
    """The long trial's rank pids, once its step records reach the driver."""
    ranks = wait_for(long_ranks, what="the long trial's ranks")
    wait_for(lambda: stepped(tmp_path), what="step records on the driver")
    return ranks


def test_sigterm_cancels_every_remote_trial_and_leaves_no_rank(cluster, tmp_path):
    run = spawn_long_matrix(cluster, tmp_path)
    try:
        ranks = wait_stepping(tmp_path)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 143, err
    doc = json.loads((tmp_path / "l.json").read_text())
    long = doc["trials"][0]
    assert long["outcome"] == "INTERRUPTED" and not long["met"] and doc["interrupted_by"] == "SIGTERM"
    assert long["node"] in ("worker-a", "worker-b") and any(s["rank"] == 1 for s in long["steps"])
    wait_for(lambda: not any(alive(p) for p in ranks), timeout=30, what="the ranks to be gone")
    assert not worker_pids("00-selftest-clean-tp2-keep")


def test_a_node_lost_mid_trial_is_crash_naming_it_and_a_retry_runs_it_elsewhere(cluster, tmp_path):
    run = spawn_long_matrix(cluster, tmp_path)
    try:
        ranks = wait_stepping(tmp_path)
        raylet = raylet_of(ranks[0])
        os.kill(raylet, signal.SIGKILL)  # the node is gone: its raylet and so its workers
        _, err = run.communicate(timeout=180)
    finally:
        run.kill()
    assert run.returncode == 1, err
    long, short = json.loads((tmp_path / "l.json").read_text())["trials"]
    assert long["outcome"] == "CRASH" and long["node"] in ("worker-a", "worker-b")
    assert long["first_failure"]["detail"] == f"node {long['node']} was lost during the trial"
    assert any(st["rank"] == 1 for st in long["steps"])  # what reached the driver before the loss is kept
    assert short["outcome"] == "CLEAN" and short["met"]  # the other trial completed
    wait_for(lambda: not any(alive(p) for p in ranks), timeout=30, what="the lost node's ranks to be gone")
    lost = long["node"]

    # The node comes back; with --retries 1 a loss runs the trial once more, on a live node.
    start_worker(cluster, lost, 2 if lost == "worker-a" else 1, free_ports(2))
    (tmp_path / "r.toml").write_text(LONG.format(steps=3000))
    run = spawn(
        "matrix",
        "--config",
        "r.toml",
        "--ray",
        cluster,
        "--retries",
        "1",
        "--json",
        "r.json",
        "--artifacts",
        "runs",
        cwd=tmp_path,
    )
    try:
        ranks = wait_for(long_ranks, what="the first attempt's ranks")
        os.kill(raylet_of(ranks[0]), signal.SIGKILL)
        _, err = run.communicate(timeout=240)
    finally:
        run.kill()
    long = json.loads((tmp_path / "r.json").read_text())["trials"][0]
    assert run.returncode == 0, err
    assert long["outcome"] == "CLEAN" and long["met"]
    assert any(
        n.startswith("run again (--retries 1) after: node ") and n.endswith(" was lost during the trial")
        for n in long["notes"]
    )
    assert not any(alive(p) for p in ranks)


def test_runtime_env_hook_keeps_what_the_program_set_and_chains_its_hooks(monkeypatch, tmp_path):
    from repro.watch import ray as watch_ray

    started = []
    monkeypatch.setattr(watch_ray, "start_collector_thread", lambda run_dir, name: started.append(name))
    calls = []
    monkeypatch.setitem(sys.modules, "chained_mod", type(sys)("chained_mod"))
    sys.modules["chained_mod"].hook = lambda env: {**(env or {}), "working_dir": "theirs", "seen": calls.append("hook")}
    sys.modules["chained_mod"].setup = lambda: calls.append("their setup")
    monkeypatch.setenv("REPRO_WATCH", "1")
    monkeypatch.setenv("REPRO_WATCH_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("REPRO_WATCH_ON_FINDING", "raise")
    monkeypatch.setenv(watch_ray.ENV_CHAIN, "chained_mod.hook")
    env = watch_ray.runtime_env_hook(
        {"env_vars": {"MINE": "1"}, "py_modules": ["/x/mine"], "worker_process_setup_hook": "chained_mod.setup"}
    )
    assert calls == ["hook"] and env["working_dir"] == "theirs"  # theirs ran first, kept
    assert env["env_vars"]["MINE"] == "1" and env["env_vars"]["REPRO_WATCH_ON_FINDING"] == "raise"
    assert env["env_vars"]["REPRO_WATCH_RAY_DIR"].endswith("repro-watch-run")
    assert env["py_modules"] == ["/x/mine", str(watch_ray.PACKAGE_DIR)]
    assert started == ["repro-watch-collector-run"]
    monkeypatch.setattr(watch_ray, "setup_worker", lambda: calls.append("our setup"))
    env["worker_process_setup_hook"]()
    assert calls == ["hook", "our setup", "their setup"]
    monkeypatch.delenv("REPRO_WATCH")
    monkeypatch.delenv(watch_ray.ENV_CHAIN)
    untouched = {"env_vars": {"MINE": "1"}}
    assert watch_ray.runtime_env_hook(untouched) is untouched  # not watched: as given


def test_watch_sets_rays_hook_and_keeps_one_already_set(tmp_path):
    from repro.watch.command import watch_env

    env = watch_env({"RAY_RUNTIME_ENV_HOOK": "their.hook"}, tmp_path, "warn")
    assert env["RAY_RUNTIME_ENV_HOOK"] == "repro.watch.ray.runtime_env_hook"
    assert env["REPRO_WATCH_RAY_CHAIN"] == "their.hook"
    assert "REPRO_WATCH_RAY_CHAIN" not in watch_env({}, tmp_path, "warn")
