"""`specee serve --ray` on a local Ray cluster on loopback: two replicas share the requests; a
replica killed mid-run is restarted by Ray, and requests sent after the restart succeed."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest
from conftest import real_model_dir

pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'ray[serve]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]')")

import openai  # noqa: E402

from specee.cli import build_parser  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A one-node cluster started by `ray start`, as a user starts one, then joined. The head's
    processes are spawned by `ray start`, not forked from this test process, whose gigabytes of
    reserved model memory made Ray's fork fail with ENOMEM in CI."""
    from ray import serve

    from specee.server.ray_serve import run

    port, gcs_port = free_port(), free_port()
    args = build_parser().parse_args(["serve", "--model", str(real_model_dir("stories260K")), "--ray",
                                      "--replicas", "2", "--port", str(port), "--served-model-name", "tiny"])
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")  # a throwaway cluster on loopback (read by `ray start` and ray.init)
    try:
        subprocess.run([*ray_cli, "start", "--head", "--port", str(gcs_port), "--node-ip-address", "127.0.0.1",
                        "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"],
                       check=True, timeout=120)
        ray.init(address=f"127.0.0.1:{gcs_port}", _node_ip_address="127.0.0.1", logging_level="warning",
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
        run({k: v for k, v in vars(args).items() if k != "func"}, {"model_name": "tiny"}, replicas=2,
            host="127.0.0.1", port=port, blocking=False)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        subprocess.run([*ray_cli, "stop", "--force"], capture_output=True, timeout=120)
        mp.undo()


def ask(client) -> str:
    """One request; the replica that answered it."""
    raw = client.completions.with_raw_response.create(model="tiny", prompt="Once upon a time", max_tokens=4,
                                                      temperature=0)
    assert raw.parse().usage.completion_tokens == 4
    return raw.headers["x-specee-replica"]


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get("specee")
    return app.deployments["SpecEEReplica"].replica_states.get("RUNNING", 0) if app else 0


def test_two_replicas_share_requests_and_a_killed_one_is_restarted(cluster):
    served = Counter(ask(cluster) for _ in range(16))
    assert len(served) == 2, served
    victim = next(iter(served))
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)  # as a crashed process dies
    deadline = time.monotonic() + 120
    while running_replicas() < 2 or victim_alive(victim):
        assert time.monotonic() < deadline, "Ray did not restart the replica"
        time.sleep(0.5)
    after = Counter()
    while len(after) < 2:  # every request succeeds; the proxy learns of the new replica within seconds
        assert time.monotonic() < deadline, f"requests reached only {after}"
        after[ask(cluster)] += 1
    assert victim not in after, after


def victim_alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace="serve")
        return True
    except ValueError:
        return False


def test_an_older_ray_is_a_one_line_error_naming_the_version(monkeypatch):
    """An older Ray's serve.ingress takes the app as its argument: importing the deployment raised a
    TypeError traceback (pyproject said ray>=2.40)."""
    from ray import serve

    from specee.cli.serve import RAY_AT_LEAST, serve_on_ray
    from specee.cli.args import CLIError

    def ingress(app):  # Ray 2.40's signature
        return lambda cls: cls

    monkeypatch.setattr(serve, "ingress", ingress)
    monkeypatch.delitem(sys.modules, "specee.server.ray_serve", raising=False)
    with pytest.raises(CLIError, match=rf"--ray needs Ray Serve {RAY_AT_LEAST} or newer \(this is {ray.__version__}\)"):
        serve_on_ray(build_parser().parse_args(["serve", "--ray"]), {})
