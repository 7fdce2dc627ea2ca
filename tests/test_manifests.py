"""The Kubernetes manifests of examples/clusters (a Kubeflow TrainJob, a JobSet, a GKE TPU slice), validated offline
against the published API models (``kubeflow-trainer-api``: pydantic models of TrainJob and JobSet,
typed down to the core pod spec). Those models ignore unknown keys, so every key is also checked
against the fields of the model it belongs to: a misspelt ``numNode`` fails here, not on a cluster.
docs/clusters.md shows the same files."""

import pathlib
import typing

import pytest

yaml = pytest.importorskip("yaml")
models = pytest.importorskip("kubeflow_trainer_api.models", reason="the dev extra's kubeflow-trainer-api")
from pydantic import BaseModel  # noqa: E402

CLUSTERS = pathlib.Path(__file__).parent.parent / "examples" / "clusters"
KINDS = {"TrainJob": models.TrainerV1alpha1TrainJob, "JobSet": models.JobsetV1alpha2JobSet}


def unknown_keys(model: type[BaseModel], data: dict, path: str = "") -> list[str]:
    """The keys of ``data`` (and of everything in it) that are no field of their model."""
    fields = {field.alias or name: field.annotation for name, field in model.model_fields.items()}
    unknown = []
    for key, value in data.items():
        if key in fields:
            unknown += unknown_keys_in(fields[key], value, f"{path}{key}")
        else:
            unknown.append(f"{path}{key}")
    return unknown


def unknown_keys_in(annotation: typing.Any, value: typing.Any, path: str) -> list[str]:
    """``unknown_keys`` through an annotation: Optional / Annotated, List, Dict, a model."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and isinstance(value, list):
        return [key for i, item in enumerate(value) for key in unknown_keys_in(arguments[0], item, f"{path}[{i}]")]
    if origin is dict and isinstance(value, dict):
        return [key for name, item in value.items() for key in unknown_keys_in(arguments[1], item, f"{path}.{name}")]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return unknown_keys(annotation, value, f"{path}.") if isinstance(value, dict) else []
    if origin is not None:  # Optional[...], Annotated[...]
        return next((keys for argument in arguments for keys in [unknown_keys_in(argument, value, path)] if keys), [])
    return []


@pytest.mark.parametrize("name", ["trainjob.yaml", "jobset.yaml", "gke_tpu.yaml"])
def test_each_manifest_is_valid_against_its_published_schema(name):
    manifest = yaml.safe_load((CLUSTERS / name).read_text())
    model = KINDS[manifest["kind"]]
    assert unknown_keys(model, manifest) == []
    parsed = model.from_dict(manifest)  # types and required fields (pydantic, strict)
    assert parsed.to_dict()["kind"] == manifest["kind"]


def test_the_jobset_gives_every_pod_the_three_jax_variables():
    manifest = yaml.safe_load((CLUSTERS / "jobset.yaml").read_text())
    job = manifest["spec"]["replicatedJobs"][0]
    pods = job["template"]["spec"]
    env = {item["name"]: item for item in pods["template"]["spec"]["containers"][0]["env"]}
    assert int(env["JAX_NUM_PROCESSES"]["value"]) == pods["completions"] * job["replicas"] == pods["parallelism"]
    host = f"{manifest['metadata']['name']}-{job['name']}-0-0.{manifest['metadata']['name']}"
    assert env["JAX_COORDINATOR_ADDRESS"]["value"].split(":")[0] == host  # JobSet's name for pod 0
    assert "job-completion-index" in env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert pods["completionMode"] == "Indexed" and manifest["spec"]["network"]["enableDNSHostnames"]


def test_a_misspelt_key_or_a_wrong_type_is_found():
    manifest = yaml.safe_load((CLUSTERS / "trainjob.yaml").read_text())
    manifest["spec"]["trainer"]["numNode"] = manifest["spec"]["trainer"].pop("numNodes")
    assert unknown_keys(models.TrainerV1alpha1TrainJob, manifest) == ["spec.trainer.numNode"]
    jobset = yaml.safe_load((CLUSTERS / "jobset.yaml").read_text())
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["env"][2]["valueFrom"]["fieldRef"]["fieldPth"] = container["env"][2]["valueFrom"]["fieldRef"].pop(
        "fieldPath"
    )
    path = "spec.replicatedJobs[0].template.spec.template.spec.containers[0].env[2].valueFrom.fieldRef.fieldPth"
    assert unknown_keys(models.JobsetV1alpha2JobSet, jobset) == [path]
    manifest["spec"]["trainer"]["numNodes"] = "2"  # a string where Kubernetes wants an integer
    with pytest.raises(ValueError, match="numNodes|num_nodes"):
        models.TrainerV1alpha1TrainJob.from_dict(manifest)


@pytest.mark.parametrize("name", ["trainjob.yaml", "jobset.yaml", "gke_tpu.yaml", "slurm.sbatch", "ray_digits.py"])
def test_the_clusters_guide_shows_the_files_as_they_are(name):
    guide = (CLUSTERS.parent.parent / "docs" / "clusters.md").read_text()
    assert (CLUSTERS / name).read_text().strip() in guide, f"docs/clusters.md does not show examples/clusters/{name}"


def test_the_tpu_jobset_takes_every_chip_of_its_slice_one_pod_per_host():
    """A v5e slice of topology 2x4 has 8 chips on 2 hosts of 4: one pod per host, each asking for
    its host's 4 chips, pinned to that slice's node pool; no JAX_* variable (GKE's TPU_WORKER_*
    and JAX's TPU detection name the hosts)."""
    manifest = yaml.safe_load((CLUSTERS / "gke_tpu.yaml").read_text())
    job = manifest["spec"]["replicatedJobs"][0]
    pods = job["template"]["spec"]
    pod = pods["template"]["spec"]
    chips = int(pod["containers"][0]["resources"]["limits"]["google.com/tpu"])
    topology = [int(side) for side in pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x")]
    assert pods["parallelism"] == pods["completions"] and job["replicas"] == 1
    assert pods["parallelism"] * chips == topology[0] * topology[1], "every chip of the slice, once"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    assert not any(env["name"].startswith("JAX_") for env in pod["containers"][0].get("env", []))
