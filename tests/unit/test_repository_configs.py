"""The rendered repository: committed configs come from the renderer, and the validator catches breakage."""

import re
import shutil

import pytest

from backends.deploy.repository import (MODELS, OPTIONAL_MODELS, SOURCE_DEPLOYMENT, SOURCE_OF, SOURCE_REPOSITORY,
                                        Deployment, model_configs, render_config, render_repository)
from backends.deploy.validate import validate_repository


def test_committed_configs_are_the_rendered_cpu_default():
    assert sorted(model_configs(SOURCE_DEPLOYMENT)) == sorted(MODELS + OPTIONAL_MODELS)
    assert sorted(p.name for p in SOURCE_REPOSITORY.iterdir() if p.is_dir()) == sorted(MODELS + OPTIONAL_MODELS)
    for name, config in model_configs(SOURCE_DEPLOYMENT).items():
        committed = (SOURCE_REPOSITORY / name / "config.pbtxt").read_text()
        assert committed == render_config(config), f"{name}/config.pbtxt is stale: run `make configs`"
    for twin, base in SOURCE_OF.items():
        for src in (SOURCE_REPOSITORY / base / "1").iterdir():
            assert (SOURCE_REPOSITORY / twin / "1" / src.name).read_bytes() == src.read_bytes(), (twin, src.name)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("fused", [False, True])
def test_rendered_repositories_validate(tmp_path, device, fused):
    repo = render_repository(Deployment(device=device, fused=fused), tmp_path / device)
    assert validate_repository(repo) == []
    assert sorted(p.name for p in repo.iterdir()) == sorted(MODELS + (OPTIONAL_MODELS if fused else ()))


def test_the_fused_model_has_the_ensembles_contract_and_the_encoders_placement():
    """Same inputs and outputs as the plain ensemble (a client switches by name alone); instances where
    moonvit3d's are, one request at a time (no batch dimension), the encoder's graphs on a GPU. Its
    pipeline off by default, and then no dynamic batcher (answered from execute, a request could wait in
    one ~500 ms); with its pipeline, its lanes and a bounded queue as moonvit3d's, no batching window."""
    for device in ("cpu", "gpu"):
        configs = model_configs(Deployment(device=device, fused=True, encoder_instances=2))
        fused, ensemble, encoder = configs["kimi_k25_vision_fused"], configs["kimi_k25_vision"], configs["moonvit3d"]
        assert fused.input == ensemble.input and fused.output == ensemble.output
        assert fused.max_batch_size == 0  # one request per execution, no batch dimension
        assert fused.instance_group == encoder.instance_group
        assert fused.parameters.get("cuda_graphs") == encoder.parameters.get("cuda_graphs")
        assert (device == "gpu") == ("cuda_graphs" in fused.parameters)
        # Its inputs are read on the host: a client's CUDA shared memory is copied out by the server.
        assert fused.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "yes"
        assert encoder.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == ("no" if device == "gpu" else "yes")
        assert fused.parameters["pipeline"].string_value == "no" and not fused.HasField("dynamic_batching")
        on = model_configs(Deployment(device=device, fused=True, fused_pipeline=True, fused_lanes=3))["kimi_k25_vision_fused"]
        assert on.parameters["pipeline"].string_value == "yes" and on.parameters["encoder_lanes"].string_value == "3"
        assert on.dynamic_batching.default_queue_policy.max_queue_size == Deployment().max_queue
        assert on.dynamic_batching.max_queue_delay_microseconds == 0
    for lanes in (0, 9):
        with pytest.raises(ValueError, match="fused_lanes"):
            Deployment(fused=True, fused_lanes=lanes)


def test_gpu_deployment_differs_only_in_placement_and_dtypes():
    cpu, gpu = model_configs(Deployment("cpu", fused=True)), model_configs(Deployment("gpu", fused=True))
    for name in MODELS + OPTIONAL_MODELS:
        a, b = render_config(cpu[name]).splitlines(), render_config(gpu[name]).splitlines()
        changed = {x.strip() for x in set(a) ^ set(b)}
        allowed = {"data_type: TYPE_FP32", "data_type: TYPE_BF16", "kind: KIND_CPU", "kind: KIND_GPU",
                   'string_value: "yes"', 'string_value: "no"', "gpus: 0"}
        if name.startswith("kimi_preprocess"):  # 2 instances per GPU by default, 1 on CPU
            allowed |= {"count: 1", "count: 2"}
        if name in ("moonvit3d", "kimi_k25_vision_fused"):  # GPU only: how many encoder CUDA graphs to keep
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
        assert dict(steps[pre].input_map) == {"IMAGES": "IMAGES", "MEDIA_FRAMES": "MEDIA_FRAMES", "INPUT_IDS": "INPUT_IDS"}
        assert dict(steps[placeholder].input_map) == {"INPUT_IDS": "INPUT_IDS", "IMAGE_TOKEN_COUNTS": "image_token_counts"}
        assert steps[pre].output_map["IMAGE_TOKEN_COUNTS_FORWARD"] == "image_token_counts"


def test_the_fused_models_answers_count_in_the_shared_memory_ceiling():
    """Its IMAGE_EMBEDS reach a host-memory client through the stub's regions: one largest answer per
    instance (BF16 on every GPU's instances, FP32 on CPU); a GPU deployment without it needs none."""
    enc = Deployment().vision.encoder
    rows = Deployment().limits.max_patches // enc.merge_tokens
    gpu = dict(device="gpu", gpus=2, encoder_instances=2)
    assert Deployment(**gpu).shm_ceiling_bytes() == 0
    assert Deployment(**gpu, fused=True).shm_ceiling_bytes() == 2 * 2 * rows * enc.text_hidden_size * 2
    cpu = Deployment(encoder_instances=2)
    assert Deployment(encoder_instances=2, fused=True).shm_ceiling_bytes() - cpu.shm_ceiling_bytes() \
        == 2 * rows * enc.text_hidden_size * 4
