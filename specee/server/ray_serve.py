"""`specee serve --ray`: the same ASGI app as a Ray Serve deployment, so replicas spread over a Ray
cluster and Ray restarts and scales them (specee itself stays one engine per process).

Each replica loads its own model in its constructor (Ray routes to it once that returns) and
answers with an `x-specee-replica` header naming its Ray actor. Workers import specee from where the
driver did (a local cluster; on several machines specee must be installed on each)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ray import serve

REPLICA_HEADER = b"x-specee-replica"


@serve.deployment(ray_actor_options={"num_cpus": 1}, health_check_period_s=2, health_check_timeout_s=30)
@serve.ingress()
class SpecEEReplica:
    """One engine: the LLM the command-line options describe, behind `create_app`."""

    def __init__(self, options: dict[str, Any], app_options: dict[str, Any]):
        from ..cli.serve import load_warm_llm
        from .app import create_app

        self.name = serve.get_replica_context().replica_id.to_full_id_str()  # its Ray actor's name
        self._asgi = create_app(load_warm_llm(argparse.Namespace(**options)), **app_options)

    def __serve_build_asgi_app__(self):
        app, name = self._asgi, self.name.encode()

        async def tagged(scope, receive, send):
            async def send_tagged(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, name)]}
                await send(message)
            await app(scope, receive, send_tagged)
        return tagged


def run(options: dict[str, Any], app_options: dict[str, Any], replicas: int, host: str, port: int,
        blocking: bool = True) -> None:
    """Deploy `replicas` engines behind Ray Serve's proxy on host:port (a new local cluster on this
    machine unless RAY_ADDRESS names one)."""
    import ray

    root = str(Path(__file__).resolve().parents[2])  # the specee the driver runs, for the workers
    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": root}}, include_dashboard=False,
                 _node_ip_address="127.0.0.1" if host in ("127.0.0.1", "localhost") else None)
    serve.start(http_options={"host": host, "port": port})
    deployment = SpecEEReplica.options(num_replicas=replicas)
    serve.run(deployment.bind(options, app_options), name="specee", route_prefix="/", blocking=blocking)
