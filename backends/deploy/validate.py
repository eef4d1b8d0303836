"""Offline check of a model repository (`make validate`): parse every config.pbtxt with Triton's own
protobuf definitions and check the ensemble graph.

Checks: each config parses into `ModelConfig` and names its folder; each model has a version folder
with a file (git drops empty folders, and then the model does not load); each ensemble step names an
existing model, maps only tensors that model declares, feeds every required input, and connects
tensors with equal dtypes and compatible shapes; every ensemble input is consumed, every ensemble
output produced exactly once, and no step output is left dangling; and no ensemble output is also
the input of a step (tritonserver 2.51 then fails requests for a subset of the outputs with
"unexpected deadlock"; docs/triton_runtime.md#known-server-limitations).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from backends import topology
from backends.config import Limits


@dataclass(frozen=True)
class TensorSpec:
    dtype: int
    dims: tuple[int, ...]

    def describe(self) -> str:
        return f"{mc.DataType.Name(self.dtype)}{list(self.dims)}"


# Model-config parameters that bound a request: backends.config.Limits' fields.
LIMIT_PARAMETERS = tuple(f.name for f in dataclasses.fields(Limits))


def compatible(a: TensorSpec, b: TensorSpec) -> bool:
    """Same dtype, same rank, and each dimension equal or variable (-1) on either side."""
    if a.dtype != b.dtype or len(a.dims) != len(b.dims):
        return False
    return all(x == y or x == -1 or y == -1 for x, y in zip(a.dims, b.dims))


def _dims(dims) -> tuple[int, ...]:
    # Triton matches ensemble tensors on the dims as declared, batch dimension excluded on both sides
    # (an unbatched ensemble may feed a batching model: Triton gives each request a batch dimension of 1).
    return tuple(dims)


def load_configs(repo: Path) -> tuple[dict[str, mc.ModelConfig], list[str]]:
    configs, problems = {}, []
    for folder in sorted(p for p in Path(repo).iterdir() if p.is_dir()):
        path = folder / "config.pbtxt"
        if not path.is_file():
            problems.append(f"{folder.name}: no config.pbtxt")
            continue
        config = mc.ModelConfig()
        try:
            text_format.Parse(path.read_text(), config)
        except text_format.ParseError as exc:
            problems.append(f"{folder.name}/config.pbtxt does not parse as a Triton ModelConfig: {exc}")
            continue
        if config.name and config.name != folder.name:
            problems.append(f"{folder.name}/config.pbtxt names the model {config.name!r}, not {folder.name!r}")
        versions = [v for v in folder.iterdir() if v.is_dir() and v.name.isdigit()]
        if not versions or not any(any(v.iterdir()) for v in versions):
            problems.append(f"{folder.name}: no version folder with a file in it (git drops empty folders)")
        if config.backend == "python" and not any((v / "model.py").is_file() for v in versions):
            problems.append(f"{folder.name}: python backend model without a <version>/model.py")
        configs[folder.name] = config
    return configs, problems


def check_ensemble(name: str, ens: mc.ModelConfig, configs: dict[str, mc.ModelConfig]) -> list[str]:
    problems = []
    where = f"ensemble {name}"
    available: dict[str, TensorSpec] = {t.name: TensorSpec(t.data_type, _dims(t.dims)) for t in ens.input}
    produced_by: dict[str, str] = {}
    consumed: set[str] = set()
    for i, step in enumerate(ens.ensemble_scheduling.step):
        label = f"{where} step {i} ({step.model_name})"
        model = configs.get(step.model_name)
        if model is None:
            problems.append(f"{label}: no model named {step.model_name!r} in the repository")
            continue
        if ens.max_batch_size > model.max_batch_size:
            problems.append(f"{label}: the ensemble batches up to {ens.max_batch_size} but {step.model_name} "
                            f"only {model.max_batch_size}")
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t for t in model.output}
        for model_input, tensor in step.input_map.items():
            if model_input not in inputs:
                problems.append(f"{label}: maps {model_input!r}, which is not an input of {step.model_name}")
                continue
            consumed.add(tensor)
            spec = available.get(tensor)
            if spec is None:
                problems.append(f"{label}: input {model_input!r} reads {tensor!r}, which no ensemble input "
                                f"or earlier step provides")
                continue
            want = TensorSpec(inputs[model_input].data_type, _dims(inputs[model_input].dims))
            if not compatible(spec, want):
                problems.append(f"{label}: {tensor!r} is {spec.describe()} but {step.model_name}.{model_input} "
                                f"expects {want.describe()}")
        for model_input, t in inputs.items():
            if model_input not in step.input_map and not t.optional:
                problems.append(f"{label}: required input {model_input!r} is not mapped")
        for model_output, tensor in step.output_map.items():
            if model_output not in outputs:
                problems.append(f"{label}: maps {model_output!r}, which is not an output of {step.model_name}")
                continue
            if tensor in available:
                problems.append(f"{label}: {tensor!r} is produced twice (also by "
                                f"{produced_by.get(tensor, 'the ensemble inputs')})")
            o = outputs[model_output]
            available[tensor] = TensorSpec(o.data_type, _dims(o.dims))
            produced_by[tensor] = step.model_name
    # One set of request limits for every step: a step with a smaller limit than the one before it would
    # refuse a request that step passed, and the two steps after preprocessing run side by side
    # (tritonserver 2.51 never answers a request whose parallel steps both fail).
    for key in LIMIT_PARAMETERS:
        values = {s.model_name: configs[s.model_name].parameters[key].string_value
                  for s in ens.ensemble_scheduling.step
                  if s.model_name in configs and key in configs[s.model_name].parameters}
        if len(set(values.values())) > 1:
            problems.append(f"{where}: its steps set {key} differently ({values}); give them one value")
    ens_outputs = {t.name: t for t in ens.output}
    for t in ens.input:
        if t.name not in consumed:
            problems.append(f"{where}: input {t.name!r} is never used")
    for out_name, t in ens_outputs.items():
        spec = available.get(out_name)
        if spec is None or out_name not in produced_by:
            problems.append(f"{where}: output {out_name!r} is not produced by any step")
            continue
        want = TensorSpec(t.data_type, _dims(t.dims))
        if not compatible(spec, want):
            problems.append(f"{where}: output {out_name!r} is declared {want.describe()} but "
                            f"{produced_by[out_name]} produces {spec.describe()}")
    for tensor in sorted(consumed & set(ens_outputs)):
        problems.append(f"{where}: output {tensor!r} also feeds a step; asking for a subset of the outputs "
                        f"would then fail in tritonserver 2.51 (feed the step a _FORWARD copy instead)")
    for tensor, model in produced_by.items():
        if tensor not in consumed and tensor not in ens_outputs:
            problems.append(f"{where}: {tensor!r} from {model} is dangling (neither consumed nor an output)")
    return problems


def validate_repository(repo: Path) -> list[str]:
    """All problems found, as sentences; an empty list means the repository is consistent and holds
    exactly the models of the serving topology (backends/topology.py)."""
    configs, problems = load_configs(Path(repo))
    missing, extra = sorted(set(topology.MODELS) - set(configs)), sorted(set(configs) - set(topology.MODELS))
    if missing:
        problems.append(f"the repository lacks {', '.join(missing)} (backends/topology.py declares them)")
    if extra:
        problems.append(f"the repository holds {', '.join(extra)}, which backends/topology.py does not declare")
    for name in topology.PYTHON_MODELS:
        config = configs.get(name)
        if config is not None and (config.max_batch_size > 0) != topology.batching(name):
            problems.append(f"{name}: max_batch_size {config.max_batch_size}, but it "
                            f"{'batches' if topology.batching(name) else 'takes no batch dimension'} in the topology")
    ensembles = [n for n, c in configs.items() if c.platform == "ensemble"]
    if not ensembles:
        problems.append("no ensemble in the repository")
    for name in ensembles:
        problems += check_ensemble(name, configs[name], configs)
    return problems


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    repo = Path(args[0] if args else "model_repository")
    problems = validate_repository(repo)
    for p in problems:
        print(f"invalid: {p}")
    if problems:
        return 1
    print(f"{repo}: all model configs parse and the ensemble graph is consistent")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
