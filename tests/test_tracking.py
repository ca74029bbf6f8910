"""MLflow store helpers on a real sqlite store: the experiment-type tag, the runs-page address `make ui` prints."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.runs import tracking
from pipeline.utils.paths import PROJECT_ROOT


@pytest.fixture()
def store(tmp_path: Path) -> dict:
    uri = f"sqlite:///{(tmp_path / 'mlflow.db').as_posix()}"
    return {"uri": uri, "client": MlflowClient(tracking_uri=uri), "artifacts": tmp_path / "mlartifacts"}


def test_new_experiment_carries_the_model_training_kind(store) -> None:
    client = store["client"]
    experiment_id = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client)
    experiment = client.get_experiment(experiment_id)
    assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert experiment.artifact_location == store["artifacts"].resolve().as_uri()


def test_older_experiment_gets_the_tag_and_a_chosen_kind_is_kept(store) -> None:
    client = store["client"]
    old = client.create_experiment("pain-cv", artifact_location=store["artifacts"].resolve().as_uri())
    assert tracking.EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    assert tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client) == old
    assert client.get_experiment(old).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"

    chosen = client.create_experiment("someone-else", tags={tracking.EXPERIMENT_KIND_TAG: "genai_development"})
    assert tracking.get_or_create_experiment("someone-else", store["artifacts"], client=client) == chosen
    assert client.get_experiment(chosen).tags[tracking.EXPERIMENT_KIND_TAG] == "genai_development"

    client.delete_experiment(old)
    assert tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client) == old
    assert client.get_experiment(old).lifecycle_stage == "active"


def test_find_experiment_id_reads_the_store_by_name(store, tmp_path: Path) -> None:
    client = store["client"]
    other = tracking.get_or_create_experiment("other", store["artifacts"], client=client)
    pain = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=client)
    assert other != pain
    assert tracking.find_experiment_id(store["uri"]) == pain
    assert tracking.find_experiment_id(store["uri"], "other") == other
    assert tracking.find_experiment_id(store["uri"], "absent") is None
    client.delete_experiment(other)
    assert tracking.find_experiment_id(store["uri"], "other") is None
    missing = tmp_path / "nowhere" / "mlflow.db"
    assert tracking.find_experiment_id(f"sqlite:///{missing}") is None
    assert not missing.parent.exists(), "looking up an address must not create a store"


def test_ui_url_opens_the_runs_table_in_model_training_mode() -> None:
    assert tracking.ui_url("127.0.0.1", 5000, "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning")
    assert tracking.ui_url("127.0.0.1", "5001", None) == "http://127.0.0.1:5001/#/experiments?workflowType=machine_learning"


def test_make_ui_prints_the_runs_url_and_runs_one_worker(store) -> None:
    """`make -n ui` shows the recipe without starting a server; its first line is then run for real."""
    experiment_id = tracking.get_or_create_experiment("pain-cv", store["artifacts"], client=store["client"])
    env = {**os.environ, "MLFLOW_TRACKING_URI": store["uri"]}
    recipe = subprocess.run(["make", "--no-print-directory", "-n", "ui", "MLFLOW_PORT=5123"], cwd=PROJECT_ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert recipe.returncode == 0, recipe.stderr
    lines = recipe.stdout.replace("\\\n", " ").splitlines()
    server = next(line for line in lines if "mlflow ui" in line)
    assert "--workers 1" in server and "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in server
    printer = next(line for line in lines if "-m pipeline ui-url" in line)
    # The check must be quick: no mlflow (nor torch) import on this path.
    probe = "import sys; from pipeline.cli import main; main(sys.argv[1:]); " \
            "print('mlflow imported' if {'mlflow', 'torch'} & set(sys.modules) else 'mlflow not imported')"
    args = shlex.split(printer)[shlex.split(printer).index("-m") + 2:]
    printed = subprocess.run([sys.executable, "-c", probe, *args], cwd=PROJECT_ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert f"http://127.0.0.1:5123/#/experiments/{experiment_id}/runs?workflowType=machine_learning" in printed.stdout
    assert "mlflow not imported" in printed.stdout
