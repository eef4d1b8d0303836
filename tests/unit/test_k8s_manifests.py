"""The Kubernetes manifests under deploy/k8s/: rendered as kustomize renders them, checked against the
Kubernetes OpenAPI schemas, and held to what the launcher and the image actually do.

No kubectl and no cluster here: `render` below is a small kustomize that implements exactly the
fields our kustomizations use (`resources`, JSON 6902 `patches` with a kind/name target, `images`)
and refuses any other, so a manifest change that needs more of kustomize fails here instead of being
rendered wrongly. Schemas come from the `kubernetes-validate` package (bundled, offline); the
ServiceMonitor (a Prometheus Operator CRD it does not bundle) is checked field by field.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

import yaml  # pinned in requirements.txt

from backends.topology import AUTOSCALE_MODEL

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("single-gpu", "multi-gpu", "mps")
GPUS = {"single-gpu": 1, "multi-gpu": 2, "mps": 1}
# moonvit3d instances per GPU: one, except under MPS (overlays/mps; docs/operations.md#scale-out).
ENCODERS = {"single-gpu": "1", "multi-gpu": "1", "mps": "2"}
# Kubernetes versions the manifests must be valid for (schemas bundled by kubernetes-validate).
K8S_VERSIONS = ("1.29", "1.33")
HPA_METRIC = "kimi_vision_queue_us_per_request"
# Variables the Deployment may set although neither the launcher nor the entrypoint reads them.
NON_LAUNCHER_ENV = {"HOME": "uid 1000 has no writable home in the image; Triton-language and torch caches go there"}


# ----------------------------------------------------------------------------------------------------
# A minimal kustomize
# ----------------------------------------------------------------------------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}
TARGET_FIELDS = {"group", "version", "kind", "name"}


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list, token: str, *, for_add: bool = False) -> int:
    if token == "-" and for_add:
        return len(container)
    if not re.fullmatch(r"0|[1-9][0-9]*", token):
        raise ValueError(f"bad array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not for_add):
        raise IndexError(f"array index {i} out of range (length {len(container)})")
    return i


def _walk(doc, tokens: list[str]):
    for t in tokens:
        if isinstance(doc, list):
            doc = doc[_index(doc, t)]
        elif isinstance(doc, dict):
            if t not in doc:
                raise KeyError(f"no member {t!r}")
            doc = doc[t]
        else:
            raise KeyError(f"cannot descend into a scalar at {t!r}")
    return doc


def apply_json6902(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add / remove / replace / test (kustomize also has move and copy; we use neither)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, tokens = op["op"], _pointer(op["path"])
        if kind not in ("add", "remove", "replace", "test"):
            raise ValueError(f"unsupported JSON patch op {kind!r}")
        if kind == "test":
            if _walk(doc, tokens) != op["value"]:
                raise AssertionError(f"test failed at {op['path']}: {_walk(doc, tokens)!r} != {op['value']!r}")
            continue
        if not tokens:
            raise ValueError("patching the whole document is not supported")
        parent, last = _walk(doc, tokens[:-1]), tokens[-1]
        if isinstance(parent, list):
            i = _index(parent, last, for_add=kind == "add")
            if kind == "add":
                parent.insert(i, copy.deepcopy(op["value"]))
            elif kind == "remove":
                del parent[i]
            else:
                parent[i] = copy.deepcopy(op["value"])
        elif isinstance(parent, dict):
            if kind != "add" and last not in parent:
                raise KeyError(f"{kind} of a missing member {op['path']}")
            if kind == "remove":
                del parent[last]
            else:
                parent[last] = copy.deepcopy(op["value"])
        else:
            raise KeyError(f"cannot patch inside a scalar at {op['path']}")
    return doc


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return all([target.get("group", group) == group, target.get("version", version) == version,
                target.get("kind", obj["kind"]) == obj["kind"],
                target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]])


def _split_image(image: str) -> tuple[str, str, str]:
    """name, tag, digest (kustomize's image.Split)."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest


def _set_images(obj: dict, images: list[dict]) -> None:
    pod = obj.get("spec", {}).get("template", {}).get("spec")
    if not pod:
        return
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        name, tag, digest = _split_image(c["image"])
        for rule in images:
            if set(rule) - {"name", "newName", "newTag", "digest"}:
                raise ValueError(f"unsupported images fields: {sorted(set(rule) - {'name', 'newName', 'newTag', 'digest'})}")
            if rule["name"] != name:
                continue
            name = rule.get("newName", name)
            if "digest" in rule:
                tag, digest = "", rule["digest"]
            elif "newTag" in rule:
                tag, digest = rule["newTag"], ""
            c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
            break


def render(directory: Path) -> list[dict]:
    """What `kubectl kustomize <directory>` prints, as a list of objects (order aside)."""
    kfile = directory / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text())
    unknown = set(k) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{kfile}: kustomize fields {sorted(unknown)} are not implemented by this test's renderer"
    assert k.get("kind") == "Kustomization", kfile
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for patch in k.get("patches", []):
        assert set(patch) == {"path", "target"}, f"{kfile}: only file patches with a target are implemented"
        assert set(patch["target"]) <= TARGET_FIELDS, f"{kfile}: target fields {sorted(patch['target'])}"
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        assert isinstance(ops, list), f"{patch['path']}: only JSON 6902 patches (a list of ops) are implemented"
        hits = [i for i, o in enumerate(objects) if _matches(o, patch["target"])]
        assert hits, f"{kfile}: patch {patch['path']} matches no resource"
        for i in hits:
            objects[i] = apply_json6902(objects[i], ops)
    for obj in objects:
        _set_images(obj, k.get("images", []))
    ids = [(o["apiVersion"].rpartition("/")[0], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), f"{kfile}: kustomize refuses duplicate resources: {ids}"
    return objects


def test_json6902_follows_the_rfc():
    doc = {"a": {"b": [1, 2, 3]}, "c/d": {"e~f": 0}}
    out = apply_json6902(doc, [{"op": "test", "path": "/a/b/1", "value": 2},
                               {"op": "replace", "path": "/a/b/1", "value": 20},
                               {"op": "add", "path": "/a/b/-", "value": 4},
                               {"op": "add", "path": "/a/b/0", "value": 0},
                               {"op": "remove", "path": "/a/b/4"},
                               {"op": "replace", "path": "/c~1d/e~0f", "value": 1},
                               {"op": "add", "path": "/a/x", "value": {"y": 1}}])
    assert out == {"a": {"b": [0, 1, 20, 3], "x": {"y": 1}}, "c/d": {"e~f": 1}}
    assert doc["a"]["b"] == [1, 2, 3]  # the input is left alone
    for bad in ({"op": "test", "path": "/a/b/0", "value": 9}, {"op": "replace", "path": "/a/z", "value": 1},
                {"op": "replace", "path": "/a/b/3", "value": 1}, {"op": "remove", "path": "/a/b/01"},
                {"op": "move", "from": "/a", "path": "/z"}):
        with pytest.raises((AssertionError, KeyError, IndexError, ValueError)):
            apply_json6902(doc, [bad])


def test_images_are_set_like_kustomize():
    assert _split_image("registry:5000/team/kimi:1.2@sha256:ab") == ("registry:5000/team/kimi", "1.2", "sha256:ab")
    dep = {"spec": {"template": {"spec": {"containers": [{"image": "kimi-vision-triton:latest"}],
                                          "initContainers": [{"image": "kimi-vision-triton"}]}}}}
    _set_images(dep, [{"name": "kimi-vision-triton", "newName": "reg.example/kimi", "newTag": "v2"}])
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == pod["initContainers"][0]["image"] == "reg.example/kimi:v2"


# ----------------------------------------------------------------------------------------------------
# Rendered objects
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    out = {name: render(K8S / "overlays" / name) for name in OVERLAYS}
    out["prometheus-adapter"] = render(K8S / "prometheus-adapter")
    return out


def one(objects: list[dict], kind: str) -> dict:
    hits = [o for o in objects if o["kind"] == kind]
    assert len(hits) == 1, f"expected one {kind}, got {len(hits)}"
    return hits[0]


def main_container(objects: list[dict]) -> dict:
    (c,) = [c for c in one(objects, "Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == "tritonserver"]
    return c


def test_every_overlay_renders_the_whole_service(rendered):
    for name in OVERLAYS:
        kinds = sorted(o["kind"] for o in rendered[name])
        assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service", "ServiceMonitor"], name
    assert [o["kind"] for o in rendered["prometheus-adapter"]] == ["ConfigMap"]


def test_core_objects_match_the_kubernetes_schemas(rendered):
    import kubernetes_validate as kv  # pinned in requirements.txt
    checked = 0
    for name, objects in rendered.items():
        for obj in objects:
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: test_service_monitor_scrapes_the_metrics_port
            for version in K8S_VERSIONS:
                try:
                    kv.validate(obj, version, strict=True)
                except kv.ValidationError as e:
                    path = ".".join(str(p) for p in e.path)
                    pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version} at {path}: {e.message}")
                checked += 1
    assert checked == len(K8S_VERSIONS) * (len(OVERLAYS) * 4 + 1)


def test_service_monitor_scrapes_the_metrics_port(rendered):
    # The CRD is not bundled: the fields used here are checked by hand against the
    # monitoring.coreos.com/v1 ServiceMonitor schema (prometheus-operator's
    # example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml: spec.selector and
    # spec.endpoints required, its duration pattern). Extend the known fields from that schema.
    duration = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
    known_endpoint_fields = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings", "metricRelabelings"}

    def seconds(d: str) -> float:
        units = {"y": 31536000, "w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
        return sum(int(n) * units[u] for n, u in re.findall(r"([0-9]+)(ms|y|w|d|h|m|s)", d))

    for name in OVERLAYS:
        sm, svc = one(rendered[name], "ServiceMonitor"), one(rendered[name], "Service")
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(sm) == {"apiVersion", "kind", "metadata", "spec"} and sm["metadata"]["name"]
        spec = sm["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels"}
        labels = spec["selector"]["matchLabels"]
        assert labels.items() <= svc["metadata"]["labels"].items(), "the ServiceMonitor must select our Service"
        (ep,) = spec["endpoints"]
        assert set(ep) <= known_endpoint_fields
        assert ep["port"] == "metrics" and ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
        assert ep.get("path", "/metrics") == "/metrics"  # what the launcher's metrics relay serves
        assert duration.match(ep["interval"]) and seconds(ep["interval"]) == 15
        assert duration.match(ep["scrapeTimeout"]) and seconds(ep["scrapeTimeout"]) <= seconds(ep["interval"])


# ----------------------------------------------------------------------------------------------------
# The contract with the launcher and the image
# ----------------------------------------------------------------------------------------------------

LAUNCHER = (ROOT / "backends" / "deploy" / "launcher.py").read_text()
SUPERVISOR = (ROOT / "backends" / "deploy" / "supervisor.py").read_text()
MPS = (ROOT / "backends" / "deploy" / "mps.py").read_text()
ENTRYPOINT = (ROOT / "docker" / "entrypoint.sh").read_text()
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def _number(pattern: str, text: str, what: str) -> float:
    m = re.search(pattern, text)
    assert m, f"cannot find {what} in the source any more; update this test"
    return float(m.group(1))


def env_read_by_launcher() -> set[str]:
    names = set(re.findall(r"os\.environ(?:\.get\(|\[)\s*[\"']([A-Z0-9_]+)[\"']", LAUNCHER))
    names |= set(re.findall(r"env_(?:flag|int)\(\s*[\"']([A-Z0-9_]+)[\"']", LAUNCHER))  # backends.config
    names |= set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", ENTRYPOINT))
    return names


def test_ports_and_probes(rendered):
    ports = {"http": _number(r"http: int = (\d+)", LAUNCHER, "Ports.http"),
             "grpc": _number(r"grpc: int = (\d+)", LAUNCHER, "Ports.grpc"),
             "metrics": _number(r"metrics: int = (\d+)", LAUNCHER, "Ports.metrics")}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    start_timeout = _number(r"start_timeout: float = ([\d.]+)", SUPERVISOR, "Supervisor start_timeout")
    for name in OVERLAYS:
        c = main_container(rendered[name])
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports
        svc = one(rendered[name], "Service")
        assert svc["spec"]["type"] == "ClusterIP"
        assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {n: (v, n) for n, v in ports.items()}
        pod_labels = one(rendered[name], "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()

        def probe(kind):
            p = c[kind]
            assert p["httpGet"]["port"] in ("http", 8000)
            return p["httpGet"]["path"], p["periodSeconds"] * p["failureThreshold"]

        assert probe("readinessProbe")[0] == "/v2/health/ready"
        path, window = probe("livenessProbe")
        # A supervised restart closes the ports for up to about a minute with a real checkpoint:
        # the kubelet must not kill the container meanwhile.
        assert path == "/v2/health/live" and window >= 120
        path, window = probe("startupProbe")
        assert path.startswith("/v2/health/") and window >= start_timeout  # the launcher's own start timeout ends a stuck start


def test_graceful_shutdown_outlasts_the_drain(rendered):
    exit_timeout = _number(r"EXIT_TIMEOUT_S = (\d+)", LAUNCHER, "EXIT_TIMEOUT_S")
    # launcher main -> Supervisor.stop(timeout=30.0) -> TritonServer.stop(30): drain, then kill.
    supervisor_stop = _number(r"def stop\(self, timeout: float = ([\d.]+)\)", SUPERVISOR, "Supervisor.stop timeout")
    assert supervisor_stop >= exit_timeout
    for name in OVERLAYS:
        pod = one(rendered[name], "Deployment")["spec"]["template"]["spec"]
        cmd = main_container(rendered[name])["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[0] == "sleep"
        pre_stop = float(cmd[1])
        assert 0 < pre_stop <= 15
        # Under MPS the launcher then stops its daemon too (Daemon.stop's default timeout).
        mps_stop = _number(r"STOP_TIMEOUT_S = ([\d.]+)", MPS, "Daemon.stop timeout") if name == "mps" else 0
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + supervisor_stop + mps_stop + 10


def test_pod_runs_unprivileged_with_its_writable_paths(rendered):
    workdir = re.search(r"^WORKDIR\s+(\S+)", DOCKERFILE, re.M).group(1)
    assert re.search(r"^COPY backends \./backends", DOCKERFILE, re.M), "the launcher's REPO_ROOT is the WORKDIR"
    assert "BUILD = REPO_ROOT / \"build\"" in LAUNCHER
    repository_dir = re.search(r"--repository-dir\s+(\S+)", ENTRYPOINT).group(1)
    for name in OVERLAYS:
        dep = one(rendered[name], "Deployment")
        pod = dep["spec"]["template"]["spec"]
        assert "replicas" not in dep["spec"], "the HPA owns the replica count"
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 1000
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"] + pod.get("initContainers", []):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
            assert csc.get("privileged", False) is False
            assert all(m["name"] in volumes for m in c.get("volumeMounts", []))
        c = main_container(rendered[name])
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        # /dev/shm: the Python backend's regions, memory-backed and bounded.
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory" and mounts["/dev/shm"]["emptyDir"]["sizeLimit"]
        # The image's files are root's: what uid 1000 writes must be a volume, or /tmp.
        writable = [p for p, v in mounts.items() if "emptyDir" in v]
        if c["securityContext"].get("readOnlyRootFilesystem") is False:
            writable.append("/tmp")  # world-writable in the image's own filesystem
        env = {e["name"]: e.get("value") for e in c["env"]}
        for path in (f"{workdir}/build", env["HOME"], repository_dir):
            assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), path
        # The checkpoint: read-only, where KIMI_VISION_CHECKPOINT points, and checked before start-up
        # (the entrypoint would fall back to the untrained demo model without a config.json).
        ckpt = [m for m in c["volumeMounts"] if m["mountPath"] == env["KIMI_VISION_CHECKPOINT"]]
        assert len(ckpt) == 1 and ckpt[0]["readOnly"] is True
        assert any("/checkpoint/config.json" in " ".join(i["command"]) for i in pod["initContainers"])
        assert "config.json" in ENTRYPOINT


QUANTITY = re.compile(r"^([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")


def quantity(q) -> float:
    """A Kubernetes resource quantity (the OpenAPI schema only says string or number)."""
    m = QUANTITY.match(str(q))
    assert m and re.fullmatch(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)", m.group(1)), f"not a quantity: {q!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    return float(m.group(1)) * scale[m.group(2)]


def test_gpu_resources_and_instances_per_gpu(rendered):
    assert quantity("500m") == 0.5 and quantity("2Gi") == 2 * 2**30 and quantity(2) == 2
    for bad in ("16 cores", "2GB", "1.2.3"):
        with pytest.raises(AssertionError):
            quantity(bad)
    for name in OVERLAYS:
        c = main_container(rendered[name])
        res = c["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == GPUS[name]
        pod = one(rendered[name], "Deployment")["spec"]["template"]["spec"]
        for x in pod["containers"] + pod["initContainers"]:
            for key in ("cpu", "memory"):
                assert 0 < quantity(x["resources"]["requests"][key]) <= quantity(x["resources"]["limits"][key])
        shm = next(v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "dshm")
        # A memory-backed /dev/shm counts against the container's memory limit.
        assert quantity(shm) <= quantity(res["limits"]["memory"]) / 4
        for v in pod["volumes"]:
            if "emptyDir" in v:
                quantity(v["emptyDir"]["sizeLimit"])
        target = one(rendered[name], "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
        assert 0 < quantity(target) <= 1e6  # microseconds of queue time per request
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["KIMI_DEVICE"] == "gpu"
        # Per GPU (the launcher renders one instance group per GPU), hence the same whatever the GPU count;
        # two encoder instances only where MPS lets them run side by side.
        assert env["KIMI_ENCODER_INSTANCES"] == ENCODERS[name] and env["KIMI_PREPROCESS_INSTANCES"] == "2"
        assert env.get("KIMI_MPS") == ("1" if name == "mps" else None)
        assert "moonvit3d instances per GPU" in LAUNCHER and "kimi_preprocess instances per GPU" in LAUNCHER
        images = {x["image"] for x in pod["containers"] + pod["initContainers"]}
        assert images == {"kimi-vision-triton:latest"}


def test_env_is_what_the_launcher_reads(rendered):
    read = env_read_by_launcher()
    assert {"KIMI_DEVICE", "KIMI_VISION_CHECKPOINT", "KIMI_ADMIN_KEY", "KIMI_ENCODER_INSTANCES"} <= read, read
    for name in OVERLAYS:
        env = main_container(rendered[name])["env"]
        names = [e["name"] for e in env]
        assert len(names) == len(set(names))
        unread = set(names) - read - set(NON_LAUNCHER_ENV)
        assert not unread, f"{name}: the Deployment sets {sorted(unread)}, which neither the launcher nor the entrypoint reads"
        admin = next(e for e in env if e["name"] == "KIMI_ADMIN_KEY")
        assert admin["valueFrom"]["secretKeyRef"]["optional"] is True  # "<header>=<value>" from a Secret


def test_hpa_metric_is_the_one_the_adapter_rule_serves(rendered):
    cm = one(rendered["prometheus-adapter"], "ConfigMap")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    # The adapter parses its config strictly (yaml.UnmarshalStrict into MetricsDiscoveryConfig,
    # prometheus-adapter pkg/config): no field it does not know.
    assert set(config) <= {"rules", "resourceRules", "externalRules"}
    (rule,) = config["rules"]
    assert set(rule) <= {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery", "labelValueReplacements"}
    assert set(rule["resources"]) <= {"template", "overrides"} and set(rule["name"]) == {"matches", "as"}
    assert rule["name"]["as"] == HPA_METRIC and re.fullmatch(rule["name"]["matches"], "nv_inference_queue_duration_us")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    query = " ".join(rule["metricsQuery"].split())
    num, den = query.split(" / ")
    watched = f'model="{AUTOSCALE_MODEL}"'  # the model the topology says the autoscaler reads
    assert f"rate(nv_inference_queue_duration_us{{{watched},<<.LabelMatchers>>}}[1m])" in num
    assert f"rate(nv_inference_request_success{{{watched},<<.LabelMatchers>>}}[1m])" in den
    assert num.count("<<.GroupBy>>") == den.count("<<.GroupBy>>") == 1
    # What the adapter sends Prometheus for two pods: brackets balanced, no template left.
    promql = query.replace("<<.LabelMatchers>>", 'namespace="ns",pod=~"a|b"').replace("<<.GroupBy>>", "pod")
    assert "<<" not in promql
    for left, right in ("()", "{}", "[]"):
        depth = 0
        for ch in re.sub(r'"[^"]*"', '""', promql):
            depth += (ch == left) - (ch == right)
            assert depth >= 0, promql
        assert depth == 0, promql
    assert watched in rule["seriesQuery"]
    for name in OVERLAYS:
        hpa = one(rendered[name], "HorizontalPodAutoscaler")
        dep = one(rendered[name], "Deployment")
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", dep["metadata"]["name"])
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == HPA_METRIC
        assert metric["pods"]["target"]["type"] == "AverageValue"
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_disruption_budget_covers_the_pods(rendered):
    for name in OVERLAYS:
        pdb = one(rendered[name], "PodDisruptionBudget")
        pod_labels = one(rendered[name], "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable") == 1
