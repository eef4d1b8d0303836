"""The rendered repository: committed configs come from the renderer, and the validator catches breakage."""

import re
import shutil

import pytest

from backends.deploy.repository import (MODELS, SOURCE_DEPLOYMENT, SOURCE_OF, SOURCE_REPOSITORY, Deployment,
                                        model_configs, render_config, render_repository)
from backends.deploy.validate import validate_repository


def test_committed_configs_are_the_rendered_cpu_default():
    assert sorted(model_configs(SOURCE_DEPLOYMENT)) == sorted(MODELS)
    assert sorted(p.name for p in SOURCE_REPOSITORY.iterdir() if p.is_dir()) == sorted(MODELS)
    for name, config in model_configs(SOURCE_DEPLOYMENT).items():
        committed = (SOURCE_REPOSITORY / name / "config.pbtxt").read_text()
        assert committed == render_config(config), f"{name}/config.pbtxt is stale: run `make configs`"
    for twin, base in SOURCE_OF.items():
        for src in (SOURCE_REPOSITORY / base / "1").iterdir():
            assert (SOURCE_REPOSITORY / twin / "1" / src.name).read_bytes() == src.read_bytes(), (twin, src.name)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_rendered_repositories_validate(tmp_path, device):
    repo = render_repository(Deployment(device=device), tmp_path / device)
    assert validate_repository(repo) == []
    assert sorted(p.name for p in repo.iterdir()) == sorted(MODELS)


def test_gpu_deployment_differs_only_in_placement_and_dtypes():
    cpu, gpu = model_configs(Deployment("cpu")), model_configs(Deployment("gpu"))
    for name in MODELS:
        a, b = render_config(cpu[name]).splitlines(), render_config(gpu[name]).splitlines()
        changed = {x.strip() for x in set(a) ^ set(b)}
        allowed = {"data_type: TYPE_FP32", "data_type: TYPE_BF16", "kind: KIND_CPU", "kind: KIND_GPU",
                   'string_value: "yes"', 'string_value: "no"', "gpus: 0",
                   # the embedding cache's default budget: device memory on a GPU, host memory on CPU
                   f'string_value: "{Deployment("cpu").cache_bytes}"', f'string_value: "{Deployment("gpu").cache_bytes}"',
                   # and the NIXL arena's, taken only once a client asks for a descriptor
                   f'string_value: "{Deployment("cpu").nixl_bytes}"', f'string_value: "{Deployment("gpu").nixl_bytes}"'}
        if name.startswith("kimi_preprocess"):  # 2 instances per GPU by default, 1 on CPU
            allowed |= {"count: 1", "count: 2"}
        if name == "moonvit3d":  # GPU only: how many encoder CUDA graphs to keep
            allowed |= {'key: "cuda_graphs"', f'string_value: "{Deployment("gpu").cuda_graphs}"'}
        assert changed <= allowed, (name, changed - allowed)
    assert gpu["moonvit3d"].instance_group[0].kind == gpu["moonvit3d"].instance_group[0].KIND_GPU
    assert gpu["kimi_placeholder"].instance_group[0].kind == gpu["kimi_placeholder"].instance_group[0].KIND_CPU


def _broken(tmp_path, model, old, new):
    repo = render_repository(Deployment(), tmp_path / "repo")
    path = repo / model / "config.pbtxt"
    text = path.read_text()
    assert re.search(old, text), old
    path.write_text(re.sub(old, new, text, count=1))
    return repo


@pytest.mark.parametrize("model,old,new,expected", [
    ("kimi_k25_vision", 'model_name: "moonvit3d"', 'model_name: "moonvit"', "no model named 'moonvit'"),
    ("kimi_k25_vision", 'value: "pixel_values"\n', 'value: "pixel_valuez"\n', "no ensemble input or earlier step"),
    ("moonvit3d", "TYPE_FP32", "TYPE_FP16", "expects TYPE_FP16"),
    ("kimi_k25_vision", r'key: "GRID_THWS"\n      value: "GRID_THWS"', 'key: "GRID_THWS"\n      value: "GRID_X"',
     "dangling"),
    ("kimi_preprocess", "dims: 14\n  dims: 14", "dims: 14\n  dims: 16", "is TYPE_FP32[-1, 3, 14, 16] but moonvit3d.PIXEL_VALUES expects TYPE_FP32[-1, 3, 14, 14]"),
    ("kimi_placeholder", "input {", "input {\n  name: 1 2 3", "does not parse"),
    ("kimi_k25_vision", r'output \{\n  name: "GRID_THWS"', 'output {\n  name: "GRID_THW"', "not produced by any step"),
    # moonvit3d reading the ensemble output GRID_THWS instead of its _FORWARD copy (the 2.51 subset bug)
    ("kimi_k25_vision", r'key: "GRID_THWS"\n      value: "grid_thws"', 'key: "GRID_THWS"\n      value: "GRID_THWS"',
     "also feeds a step"),
    # a smaller limit in the expansion than in preprocessing: it could refuse what preprocessing passed
    ("kimi_placeholder", r'key: "max_patches"\n  value \{\n    string_value: "131072"',
     'key: "max_patches"\n  value {\n    string_value: "4096"', "set max_patches differently"),
])
def test_validator_fails_on_a_broken_copy(tmp_path, model, old, new, expected):
    problems = validate_repository(_broken(tmp_path, model, old, new))
    assert problems, "a broken repository must not validate"
    assert any(expected in p for p in problems), problems


def test_validator_catches_an_empty_version_folder(tmp_path):
    repo = render_repository(Deployment(), tmp_path / "repo")
    shutil.rmtree(repo / "kimi_k25_vision" / "1")
    (repo / "kimi_k25_vision" / "1").mkdir()
    assert any("no version folder with a file" in p for p in validate_repository(repo))


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_gpu_deployment_puts_instances_on_every_gpu_with_a_pool_each(gpus):
    from backends.deploy.launcher import Ports, TritonInstall, tritonserver_command

    dep = Deployment(device="gpu", gpus=gpus, encoder_instances=2, preprocess_instances=3)
    configs = model_configs(dep)
    for model, per_gpu in (("moonvit3d", 2), ("kimi_preprocess", 3), ("kimi_preprocess_batched", 3)):
        groups = configs[model].instance_group
        assert [list(g.gpus) for g in groups] == [[g] for g in range(gpus)], model  # one group per device
        assert all(g.count == per_gpu and g.kind == g.KIND_GPU for g in groups), model
    assert [g.kind for g in configs["kimi_placeholder"].instance_group] == [configs["kimi_placeholder"].instance_group[0].KIND_CPU]
    cmd = tritonserver_command(TritonInstall("/bin/tritonserver", "/backends"), "/repo", Ports(),
                               cuda_pools=dep.cuda_pools())
    pools = [a for a in cmd if a.startswith("--cuda-memory-pool-byte-size=")]
    assert pools == [f"--cuda-memory-pool-byte-size={g}:{dep.cuda_pool_bytes()}" for g in range(gpus)]


def test_the_ensemble_runs_preprocessing_first_then_encoder_and_expansion_on_its_counts():
    """The layout the both-steps-fail hang rules out otherwise: preprocessing reads the prompt (so it
    refuses bad ones first), the expansion reads preprocessing's counts, never the images."""
    for ensemble, pre, placeholder in (("kimi_k25_vision", "kimi_preprocess", "kimi_placeholder"),
                                       ("kimi_k25_vision_batched", "kimi_preprocess_batched", "kimi_placeholder_batched")):
        steps = {s.model_name: s for s in model_configs(Deployment())[ensemble].ensemble_scheduling.step}
        assert list(steps) == [pre, "moonvit3d", placeholder]
        assert dict(steps[pre].input_map) == {"IMAGES": "IMAGES", "MEDIA_FRAMES": "MEDIA_FRAMES", "INPUT_IDS": "INPUT_IDS",
                                              # the prompt again: an encoder follows (backends/cache)
                                              "INPUT_IDS_ENCODER_FOLLOWS": "INPUT_IDS"}
        assert dict(steps[placeholder].input_map) == {"INPUT_IDS": "INPUT_IDS", "IMAGE_TOKEN_COUNTS": "image_token_counts"}
        assert steps[pre].output_map["IMAGE_TOKEN_COUNTS_FORWARD"] == "image_token_counts"


def test_a_gpu_deployment_passes_nothing_between_steps_through_shared_memory():
    """Tensors between steps stay on the GPU: the stubs' regions hold no pixels or embeddings there."""
    assert Deployment(device="gpu", gpus=2, encoder_instances=2).shm_ceiling_bytes() == 0
    assert Deployment().shm_ceiling_bytes() > 0
