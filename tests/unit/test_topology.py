"""The serving topology (backends/topology.py) is the one statement of which models exist and how they
are wired: the rendered repository, the validator, the model.py adapters and the Grafana dashboard all
agree with it."""

import json
import re
import shutil
from pathlib import Path

from backends import topology
from backends.deploy.repository import SOURCE_REPOSITORY, Deployment, model_configs, render_repository
from backends.deploy.validate import validate_repository

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kimi-vision-triton.json"


def test_the_rendering_holds_the_topologys_models_and_wiring():
    configs = model_configs(Deployment())
    assert sorted(configs) == sorted(topology.MODELS)
    for ensemble in topology.ENSEMBLES:
        steps = [s.model_name for s in configs[ensemble.name].ensemble_scheduling.step]
        assert steps == list(ensemble.models)
        assert (configs[ensemble.name].max_batch_size > 0) == ensemble.batched
    def io(name):  # a twin's inputs also allow ragged batches; names, types and dims are its base's
        c = configs[name]
        return [(t.name, t.data_type, list(t.dims)) for t in [*c.input, *c.output]]

    for twin, base in topology.TWINS.items():
        assert io(twin) == io(base)


def test_every_python_model_runs_the_adapter_of_its_base_model():
    for name in topology.PYTHON_MODELS:
        adapter = topology.ADAPTERS[topology.base_model(name)]
        text = (SOURCE_REPOSITORY / name / "1" / "model.py").read_text()
        assert re.search(rf"import {adapter} as TritonPythonModel\b", text), (name, adapter)


def test_the_validator_refuses_a_repository_without_a_model_of_the_topology_or_with_a_stranger(tmp_path):
    repo = render_repository(Deployment(), tmp_path / "repo")
    shutil.copytree(repo / "kimi_placeholder", repo / "kimi_extra")
    (repo / "kimi_extra" / "config.pbtxt").write_text(
        (repo / "kimi_extra" / "config.pbtxt").read_text().replace('name: "kimi_placeholder"', 'name: "kimi_extra"'))
    problems = validate_repository(repo)
    assert any("kimi_extra, which backends/topology.py does not declare" in p for p in problems), problems
    shutil.rmtree(repo / "kimi_extra")
    shutil.rmtree(repo / "kimi_placeholder_batched")
    problems = validate_repository(repo)
    assert any("lacks kimi_placeholder_batched" in p for p in problems), problems


def test_the_dashboards_model_filters_match_models_of_the_topology():
    """A panel that filters on a model name no model carries would stay empty without a word."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    filters = re.findall(r'model(=~?)"([^"]*)"', exprs)
    assert filters
    for op, value in filters:
        matched = [m for m in topology.MODELS if (re.fullmatch(value, m) if op == "=~" else m == value)]
        assert matched, f'model{op}"{value}" matches no model of the topology'
