"""A stage's job on the cluster (plain Python, no Dagster): its spec, what its backend launches
for it (an argv, an sbatch script, a pod manifest: ``Backend.render``) and its verified result;
running it to its end is the backend's (``Backend.launch``).

    job = job_spec(cluster, {"entry": ..., "config": ..., "outputs": ...}, name)
    failure, why = backend_for(cluster, log).launch(spec_url, name, env)   # (None, None): it completed
    result = job_result(job["entry"], messages, failure, why, storage)

The job itself is ``python -m composer_dag.cluster.job --spec URL`` (``cluster/job.py``). The
Dagster resource (``resources/cluster.py``) adds the Pipes session around it and runs the pod of
a backend that does not launch its jobs itself (``k8s``) through ``dagster_k8s``; everything that
decides what runs where is the backend's (``composer_dag.cluster.backends``).
"""

from __future__ import annotations

from typing import Any

from .backends import backend_for
from .spec import ClusterConfig, job_env, launch_spec


def render(cluster: ClusterConfig, spec_url: str, name: str = "composer-job", env: dict[str, str] | None = None,
           scratch: str | None = None) -> Any:
    """What the backend launches for the job spec at ``spec_url``: an argv (local), a pod manifest
    (k8s), an sbatch script (slurm)."""
    backend = backend_for(cluster)
    return backend.render(spec_url, name, job_env(cluster, name, env), scratch or backend.scratch(name))


# ---- the job's spec and its result ----------------------------------------------------------
class JobError(RuntimeError):
    """A stage's job failed, reported nothing, or published something other than it reported
    (one line)."""


def job_spec(cluster: ClusterConfig, job: dict[str, Any], name: str) -> dict[str, Any]:
    """``job`` (entry, args, inputs, outputs, ...) with the cluster's launcher, processes, nodes
    and environment filled in where it does not set them."""
    job = {"launcher": cluster.launcher, "nproc_per_node": cluster.nproc_per_node, "nnodes": cluster.nnodes, **job}
    if job["launcher"] == "python":
        job["nproc_per_node"] = job["nnodes"] = 1
    job["env"] = {**launch_spec(cluster, job["entry"], [], name, job["launcher"]).env, **(job.get("env") or {})}
    return job


def job_result(entry: str, messages: list, failure: str | None, why: str | None, storage) -> dict[str, Any]:
    """The job's verified result from its Pipes messages: ``{"summary", "outputs": {name: {"url",
    "digest"}}}``, each output's manifest on ``storage`` matching the digest the job reported."""
    error = next((m["error"] for m in reversed(messages) if isinstance(m, dict) and m.get("error")), why)
    if failure or error:
        raise JobError(f"{entry} {failure or 'failed'}" + (f": {error}" if error else ""))
    result = next((m for m in reversed(messages) if isinstance(m, dict) and "outputs" in m), None)
    if result is None:
        raise JobError(f"{entry} finished without reporting a result through Pipes")
    for out_name, out in result["outputs"].items():
        if storage.manifest_digest(out["url"]) != out["digest"]:
            raise JobError(f"{out_name} at {out['url']} does not match the digest its job reported")
    return result

