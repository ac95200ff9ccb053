"""The ``k8s`` backend: pod, Deployment + Service and Indexed Job objects, and ``K8sBackend`` (the
``kubernetes`` client). A stage's job is a pod manifest; a Kubernetes Pipes client runs it (the
Dagster resource's ``dagster_k8s``)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from typing import Optional

from ..spec import (ARRAY_INDEX_ENV, ArrayConfig, ArrayTask, BIND_ALL, JOB_ENTRY, LOG_LINES, LaunchSpec, ServiceConfig,
    ServiceError, ServiceHandle, check_abort, fill_address, launch_spec, track, untrack, why_from_log)
from .base import Backend, register_backend


def k8s_pod_spec(spec: LaunchSpec, namespace: str = "default", image: str | None = None,
                 gpu_resource: str = "nvidia.com/gpu", secret_name: str | None = None,
                 env: dict[str, str] | None = None, service_account: str | None = None,
                 node_selector: dict[str, str] | None = None,
                 tolerations: list[dict] | None = None) -> dict:
    """A pod manifest running the spec's entry as one process (a stage's job runner, which
    starts torchrun itself). No volume is shared with anything: inputs and outputs go through
    object storage, whose credentials come from the Secret ``secret_name`` (every key becomes
    an environment variable) and are never written into the manifest."""
    image = image or spec.image
    if not image:
        raise ValueError("k8s_pod_spec needs an image")
    if spec.nnodes > 1:
        raise ValueError("a k8s job runs on one node (one pod); multi-node needs an indexed Job")
    env_list = [{"name": k, "value": str(v)} for k, v in {**spec.env, **(env or {})}.items()]
    env_list += [{"name": k, "valueFrom": {"secretKeyRef": {"name": s, "key": key}}}
                 for k, (s, key) in spec.secret_env.items()]
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if spec.gpus_per_node:
        limits[gpu_resource] = requests[gpu_resource] = str(spec.gpus_per_node)
    if spec.cpu:
        requests["cpu"] = spec.cpu
    if spec.memory:
        requests["memory"] = limits["memory"] = spec.memory
    container: dict = {
        "name": "job", "image": image, "command": ["python", "-m", spec.entry, *spec.args],
        "env": env_list, "resources": {"limits": limits, "requests": requests},
        # torch.distributed and NCCL need a large /dev/shm; the job's scratch is the pod's own
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "scratch", "mountPath": "/scratch"}],
    }
    container["env"].append({"name": "COMPOSER_SCRATCH", "value": "/scratch"})
    if secret_name:
        container["envFrom"] = [{"secretRef": {"name": secret_name}}]
    pod_spec: dict = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "scratch", "emptyDir": {}}],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    tol = list(tolerations or [])
    if spec.gpus_per_node and not tol:
        tol = [{"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
    if tol:
        pod_spec["tolerations"] = tol
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": f"{spec.name}-", "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": spec.name,
                                "app.kubernetes.io/part-of": "composer-dag"}},
        "spec": pod_spec,
    }


K8S_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _k8s_pod_template(spec: LaunchSpec, argv: list[str], labels: dict[str, str], restart: str,
                      **pod_kw) -> dict:
    pod = k8s_pod_spec(spec, **pod_kw)
    container = pod["spec"]["containers"][0]
    container["name"] = spec.name
    container["command"] = list(argv)
    pod["spec"]["restartPolicy"] = restart
    return {"metadata": {"labels": {**pod["metadata"]["labels"], **labels}}, "spec": pod["spec"]}


def k8s_service_manifests(spec: LaunchSpec, argv: list[str], port: int, health_path: str = "/",
                          namespace: str = "default", replicas: int = 1, **pod_kw) -> tuple[dict, dict]:
    """A long-running service: a ``Deployment`` of ``replicas`` pods running ``argv`` (GPUs,
    image, Secret, node selector and tolerations as for a job's pod) that are ready when
    ``health_path`` answers on ``port``, and a ``Service`` in front of them
    (``http://<name>.<namespace>.svc:<port>``). Nothing is shared with other pods."""
    labels = {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": "service"}
    template = _k8s_pod_template(spec, argv, labels, "Always", namespace=namespace, **pod_kw)
    container = template["spec"]["containers"][0]
    container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    container["readinessProbe"] = {"httpGet": {"path": health_path, "port": port},
                                   "periodSeconds": 5, "failureThreshold": 3}
    meta = {"name": spec.name, "namespace": namespace, "labels": template["metadata"]["labels"]}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": template},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"selector": labels,
                 "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}]},
    }
    return deployment, service


def k8s_indexed_job(spec: LaunchSpec, argv: list[str], count: int, parallelism: int | None = None,
                    namespace: str = "default", **pod_kw) -> dict:
    """Map-style work: an Indexed ``Job`` of ``count`` pods, at most ``parallelism`` at once,
    each with its index in ``COMPOSER_ARRAY_INDEX`` (from the pod's completion-index
    annotation). A failing index is not retried by Kubernetes (``backoffLimitPerIndex: 0``,
    the step's retry decides), and does not stop the other indexes."""
    if count < 1:
        raise ValueError("an indexed job needs count >= 1")
    labels = {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": "array"}
    template = _k8s_pod_template(spec, argv, labels, "Never", namespace=namespace, **pod_kw)
    template["spec"]["containers"][0]["env"].append(
        {"name": ARRAY_INDEX_ENV, "valueFrom": {"fieldRef": {"fieldPath": K8S_COMPLETION_INDEX}}})
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"generateName": f"{spec.name}-", "namespace": namespace, "labels": template["metadata"]["labels"]},
        "spec": {"completionMode": "Indexed", "completions": count,
                 "parallelism": min(parallelism or count, count),
                 "backoffLimitPerIndex": 0, "maxFailedIndexes": count,
                 "template": template},
    }


@register_backend
class K8sBackend(Backend):
    """Pods, Deployments, Services and Indexed Jobs through the ``kubernetes`` client (in-cluster
    config, else ``~/.kube/config``). Not run on these machines: the manifests are tested
    against the API models."""

    name = "k8s"
    python = "python"      # the image's
    launches_jobs = False  # a stage's job: the pod ``render`` gives, run by a Kubernetes Pipes client

    def render(self, spec_url: str, name: str, env: dict[str, str], scratch: str) -> dict:
        """The job's pod manifest (its scratch: the pod's own ``/scratch``)."""
        c = self.cluster
        spec = launch_spec(c, JOB_ENTRY, ["--spec", spec_url], name, "python")
        spec.env.update(env)
        return k8s_pod_spec(spec, namespace=c.namespace, image=c.image, gpu_resource=c.gpu_resource,
                            service_account=c.service_account, secret_name=c.secret_name,
                            node_selector=c.node_selector, tolerations=c.tolerations)

    def _spec(self, name: str, cpus: int, gpus: int, memory: Optional[str], env: dict) -> LaunchSpec:
        env = dict(env)
        if not gpus:
            env.setdefault("DS_ACCELERATOR", "cpu")
        return LaunchSpec(entry=name, launcher="python", env=env, gpus_per_node=gpus, image=self.cluster.image,
                                 name=name, cpu=str(cpus), memory=memory)

    def _pod_kw(self, node: Optional[str] = None) -> dict:
        c = self.cluster
        selector = {**(c.node_selector or {}), **({"kubernetes.io/hostname": node} if node else {})}
        return dict(image=c.image, gpu_resource=c.gpu_resource, service_account=c.service_account,
                    secret_name=c.secret_name, node_selector=selector or None, tolerations=c.tolerations)

    def render_service(self, cfg: ServiceConfig, port: int, name: Optional[str] = None) -> tuple[dict, dict]:
        name = name or cfg.name
        host = f"{name}.{self.cluster.namespace}.svc"
        path = "/" + fill_address(cfg.health_url, host, port).split("://", 1)[-1].partition("/")[2]
        return k8s_service_manifests(
            self._spec(name, cfg.cpus, cfg.gpus, cfg.memory, {k: fill_address(v, BIND_ALL, port) for k, v in cfg.env.items()}),
            [fill_address(a, BIND_ALL, port) for a in cfg.argv], port, path, namespace=self.cluster.namespace,
            **self._pod_kw(cfg.node))

    def render_array(self, cfg: ArrayConfig) -> dict:
        return k8s_indexed_job(
            self._spec(cfg.name, cfg.cpus, cfg.gpus, cfg.memory, cfg.env), list(cfg.argv), cfg.count,
            cfg.parallelism or self.cluster.array_parallelism, namespace=self.cluster.namespace, **self._pod_kw())

    def _api(self):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client

    def start(self, cfg: ServiceConfig, abort: Optional[threading.Event] = None) -> ServiceHandle:
        client = self._api()
        port = cfg.port or 8000
        name = f"{cfg.name}-{uuid.uuid4().hex[:6]}"
        ns = self.cluster.namespace
        deployment, service = self.render_service(cfg, port, name)
        host = f"{name}.{ns}.svc"
        handle = ServiceHandle(cfg.name, self.name, host, port, f"http://{host}:{port}", fill_address(cfg.health_url, host, port),
                               k8s={"namespace": ns, "deployment": name, "service": name}, _backend=self)
        apps, core = client.AppsV1Api(), client.CoreV1Api()
        apps.create_namespaced_deployment(ns, deployment)
        track(handle)
        try:
            core.create_namespaced_service(ns, service)
            deadline = time.monotonic() + cfg.start_timeout_s
            while (apps.read_namespaced_deployment_status(name, ns).status.ready_replicas or 0) < 1:
                check_abort(cfg.name, abort)
                if time.monotonic() > deadline:
                    raise ServiceError(f"service {cfg.name} (deployment {ns}/{name}) was not ready within "
                                       f"{cfg.start_timeout_s:g} s; now deleted (kubectl -n {ns} logs deploy/{name})")
                time.sleep(self.cluster.poll_seconds)
        except BaseException:
            self.stop(handle)
            raise
        return handle

    def stop(self, handle: ServiceHandle) -> None:
        client = self._api()
        ns, name = handle.k8s["namespace"], handle.k8s["deployment"]
        with contextlib.suppress(client.exceptions.ApiException):
            client.CoreV1Api().delete_namespaced_service(name, ns)
        with contextlib.suppress(client.exceptions.ApiException):
            client.AppsV1Api().delete_namespaced_deployment(name, ns, propagation_policy="Foreground")
        untrack(handle)

    def run_array(self, cfg: ArrayConfig) -> list[ArrayTask]:
        client = self._api()
        ns = self.cluster.namespace
        batch, core = client.BatchV1Api(), client.CoreV1Api()
        job = batch.create_namespaced_job(ns, self.render_array(cfg))
        name = job.metadata.name
        self.log(f"[array:k8s] {cfg.name}: job {ns}/{name}, {cfg.count} indexes")
        deadline = time.monotonic() + cfg.timeout_s if cfg.timeout_s else None
        done: set[int] = set()
        failed: set[int] = set()
        logs: dict[int, list[str]] = {}
        try:
            while len(done) + len(failed) < cfg.count and not (deadline and time.monotonic() > deadline):
                time.sleep(self.cluster.poll_seconds)
                status = batch.read_namespaced_job_status(name, ns).status
                done, failed = _index_set(status.completed_indexes), _index_set(status.failed_indexes)
            for pod in core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items:
                i = int((pod.metadata.annotations or {}).get("batch.kubernetes.io/job-completion-index", -1))
                if i in failed:
                    with contextlib.suppress(client.exceptions.ApiException):
                        logs[i] = core.read_namespaced_pod_log(pod.metadata.name, ns, tail_lines=LOG_LINES).splitlines()
        finally:  # a cancelled step, a timeout, or done: the Job and its pods go
            with contextlib.suppress(client.exceptions.ApiException):
                batch.delete_namespaced_job(name, ns, propagation_policy="Foreground")
        return [ArrayTask(i, 0, "COMPLETED") if i in done else
                ArrayTask(i, 1 if i in failed else -signal.SIGTERM, "FAILED" if i in failed else "TIMEOUT",
                          why_from_log(logs.get(i, [])) or f"see the logs of job {ns}/{name}, index {i}")
                for i in range(cfg.count)]


def _index_set(text: Optional[str]) -> set[int]:
    """``"0-2,5"`` (a Job's completed/failed indexes) -> {0, 1, 2, 5}."""
    out: set[int] = set()
    for part in (text or "").split(","):
        if part.strip():
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
    return out
